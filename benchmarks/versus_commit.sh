#!/usr/bin/env bash
# Side by side: the same `infsamp train` command from two checkouts, each pinned to its own core,
# started together; then the step times, phase split, evaluation times and (where both saved
# one) the weights of the same checkpoint compared. The issue-33 goals are ratios against main
# of 2026-12-02 (aab4575): `git worktree add /tmp/base aab4575` and pass it as BASE.
#
#   benchmarks/versus_commit.sh BASE_CHECKOUT OUT_DIR [infsamp train arguments...]
#   e.g. benchmarks/versus_commit.sh /tmp/base runs/vs-base \
#          examples/smollm2_reasoning_gym.yaml --training.max_steps 2 --checkpointing.save_every 2
#
# BASE_ARGS / HEAD_ARGS: more arguments for one side only (words), after the shared ones; e.g.
# HEAD_ARGS="--sampling.micro_group 32" for this side at a setting the base did not have.
# Both sides use this checkout's .venv (the same libraries); each side's own sources come first
# on PYTHONPATH. CPU seconds (user + sys) are reported beside wall time (GNU time).
set -euo pipefail
BASE=$(cd "$1" && pwd); OUT=$2; shift 2
HEAD=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$HEAD/.venv/bin/python}
mkdir -p "$OUT"
run_side() {  # name checkout core
    (cd "$2" && PYTHONPATH="$2/src" OMP_NUM_THREADS=1 /usr/bin/time -f "%e %U %S" \
        -o "$OUT/$1.time" taskset -c "$3" "$PY" -m infsamp train "${@:4}" \
        --logging.output_dir "$OUT/$1" > "$OUT/$1.log" 2>&1)
}
ARGS=("$@")
for i in "${!ARGS[@]}"; do  # a config file given relative to this checkout
    [[ -f "${ARGS[$i]}" ]] && ARGS[$i]=$(cd "$(dirname "${ARGS[$i]}")" && pwd)/$(basename "${ARGS[$i]}")
done
OUT=$(cd "$OUT" && pwd)
# shellcheck disable=SC2086  # the one-side arguments are words
run_side base "$BASE" 0 "${ARGS[@]}" ${BASE_ARGS:-} & BASE_PID=$!
# shellcheck disable=SC2086
run_side head "$HEAD" 1 "${ARGS[@]}" ${HEAD_ARGS:-} & HEAD_PID=$!
wait $BASE_PID; wait $HEAD_PID
"$PY" "$HEAD/benchmarks/versus_commit.py" "$OUT"
