#!/usr/bin/env bash
# infsamp's GPU evidence in one command (issue 24): the paper's memory table, the planner against
# CUDA, infsamp against TRL, the precision modes and the engine's speed, in under 8 minutes on an
# H200, as OUT/results.json + OUT/results.md + OUT/suite.log.
#
#   bash benchmarks/gpu_wheels.sh                  # here, once: the wheels the H200 lacks -> .whl/
#   bash benchmarks/gpu_suite.sh OUT [ARGS...]     # on the GPU machine (device call: carry .whl)
#   bash benchmarks/gpu_suite.sh --cpu-smoke OUT   # the same plan at toy sizes on a CPU (< 5 min)
#
# ARGS go to benchmarks/gpu_suite.py (--parts 1,3, --cap 1=300, --budget-s 450). The GPU machine
# cannot reach a package index: the wheels in .whl/ (TRL, datasets and its dill/multiprocess,
# torchao, torch-optimi; built for Python 3.12 manylinux x86_64) are installed with --no-index
# into a folder of their own first. vLLM is left out of this plan: its CUDA wheel is far larger
# than the 64 MiB a device call carries.
# Models are public shapes (Qwen3-1.7B, Qwen3-0.6B, Llama-3.2-1B) with random weights built from
# their configs; completions run to their full length (no EOS).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=h200
if [ "${1:-}" = "--cpu-smoke" ]; then profile=cpu-smoke; shift; fi
out=${1:?usage: bash benchmarks/gpu_suite.sh [--cpu-smoke] OUT [ARGS...]}
shift
if [ -z "${PY:-}" ]; then
  PY=python3
  [ "$profile" = cpu-smoke ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
wheels=()
[ "$profile" = h200 ] && [ -d .whl ] && wheels=(--wheels .whl)
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_suite.py --out "$out" --profile "$profile" "${wheels[@]}" "$@"
