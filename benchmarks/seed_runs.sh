#!/usr/bin/env bash
# Three seeds of each arm of a comparison, two runs at a time, each pinned to its own core, then
# the table and the plot of benchmarks/seed_curves.py.
#
#   benchmarks/seed_runs.sh OUT CONFIG SEEDS "ARM=OVERRIDES" ["ARM=OVERRIDES" ...]
#   benchmarks/seed_runs.sh runs/seeds examples/smollm2_reasoning_gym.yaml 0,1,2 \
#       "recipe=" "dynamic=--sampling.dynamic true --training.max_steps 12"
#
# Each run is `infsamp train CONFIG --training.seed S OVERRIDES --logging.output_dir OUT/ARM-sS`,
# under `/usr/bin/time` (OUT/ARM-sS.time: wall, user and system seconds). Runs alternate between
# core 0 and core 1 (two lanes, each sequential), seed by seed: with two arms, one seed's two
# runs go side by side, the first arm on core 0. A folder that already holds a finished run is
# skipped, so the script can be re-run after an interruption (a half-written one is resumed).
# PYTHON: the interpreter for the table (default python; one with infsamp installed).
# START=RUN: runs made with --eval.on_start false take RUN's step-0 evaluation as their start.
set -euo pipefail
out=$1 config=$2 seeds=$3
shift 3
mkdir -p "$out"
infsamp=${INFSAMP:-infsamp}
jobs=()
for seed in ${seeds//,/ }; do  # seed-major: with two arms, each seed's pair runs side by side
    for spec in "$@"; do jobs+=("${spec%%=*}|$seed|${spec#*=}"); done
done

run_one() {  # core arm seed overrides
    local dir="$out/$2-s$3"
    [[ -f "$dir.time" ]] && return 0
    local resume=()
    [[ -d "$dir" ]] && resume=(--resume)
    # shellcheck disable=SC2086  # the overrides are words
    taskset -c "$1" /usr/bin/time -f "%e %U %S" -o "$dir.time.part" "$infsamp" train "$config" \
        --training.seed "$3" $4 --logging.output_dir "$dir" "${resume[@]}" > "$dir.log" 2>&1 \
        && mv "$dir.time.part" "$dir.time"
}

lane() {  # core, then job indices
    local core=$1
    shift
    for i in "$@"; do
        IFS='|' read -r arm seed overrides <<< "${jobs[$i]}"
        run_one "$core" "$arm" "$seed" "$overrides" || echo "failed: $arm seed $seed (see $out/$arm-s$seed.log)"
    done
}

even=() odd=()
for i in "${!jobs[@]}"; do
    if (( i % 2 == 0 )); then even+=("$i"); else odd+=("$i"); fi
done
lane 0 "${even[@]}" &
lane 1 "${odd[@]}" &
wait

specs=()
for spec in "$@"; do
    arm=${spec%%=*}
    folders=$(for seed in ${seeds//,/ }; do printf '%s,' "$out/$arm-s$seed"; done)
    specs+=("$arm=${folders%,}")
done
"${PYTHON:-python}" "$(dirname "$0")/seed_curves.py" "${specs[@]}" --plot "$out/curves.png" ${START:+--start "$START"} \
    | tee "$out/table.md"
