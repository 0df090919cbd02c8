#!/usr/bin/env bash
# Side by side: one held-out evaluation (`benchmarks/eval_time.py`) from two checkouts, each
# pinned to its own core (base: core 0, head: this checkout, core 1), started together; then
# both sides' wall and CPU seconds, head / base, and how many completions differ.
#
#   benchmarks/eval_versus.sh BASE_CHECKOUT OUT_DIR CONFIG [key=value ...]
#   e.g. benchmarks/eval_versus.sh /work/wt/base runs/eval-vs-base examples/smollm2_reasoning_gym.yaml
#
# Both sides use this checkout's .venv and this checkout's eval_time.py (it only calls the
# trainer's own evaluation); each side's own sources come first on PYTHONPATH.
set -euo pipefail
BASE=$(cd "$1" && pwd); OUT=$2; CONFIG=$(cd "$(dirname "$3")" && pwd)/$(basename "$3"); shift 3
HEAD=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$HEAD/.venv/bin/python}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
run_side() {  # name checkout core
    (cd "$2" && PYTHONPATH="$2/src" OMP_NUM_THREADS=1 taskset -c "$3" "$PY" \
        "$HEAD/benchmarks/eval_time.py" "$CONFIG" "$OUT/$1" "${@:4}" > "$OUT/$1.log" 2>&1)
}
run_side base "$BASE" 0 "$@" & BASE_PID=$!
run_side head "$HEAD" 1 "$@" & HEAD_PID=$!
wait $BASE_PID; wait $HEAD_PID
"$PY" - "$OUT" <<'PYTHON'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
sides = {s: json.loads((out / f"{s}.log").read_text().splitlines()[-1]) for s in ("base", "head")}
ids = {s: json.loads((out / s / "ids.json").read_text()) for s in sides}
for side, row in sides.items():
    print(f"{side}: {json.dumps(row)}")
print(f"head / base: wall {sides['head']['wall_s'] / sides['base']['wall_s']:.2f}x, "
      f"CPU {sides['head']['cpu_s'] / sides['base']['cpu_s']:.2f}x; completions differing: "
      f"{sum(a != b for a, b in zip(ids['base'], ids['head']))} of {len(ids['head'])}")
PYTHON
