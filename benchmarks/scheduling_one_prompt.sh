#!/usr/bin/env bash
# Issue 22's scheduling figures in one script: length-aware scheduling with decisions after the first
# tokens against arrival order, side by side per call (every variant the same completions):
#  1. one prompt per step (B=1, G=32, g=8), seeds 0, 1, 2: continuous, rounds, length_aware with the
#     online and the hidden predictor (parking after k=8 tokens), and the oracle;
#  2. four prompts per step (B=4, the demo's setting): no worse than before parking;
#  3. peak KV at G=512 against G=8 (one call, continuous and length_aware + online);
#  4. with vLLM installed: 1 and 2 on vLLM (parking through its preemption), continuous against
#     length_aware with the online predictor and the oracle (seed 0 beside the slot engine).
# The embedded model on the slot engine; about 20 CPU-minutes on one thread (the B=1 part: 9);
# part 4 about 10 more.
# Usage: bash benchmarks/scheduling_one_prompt.sh [OUTDIR]  (scheduling.json + traces per folder,
# default runs/scheduling_one_prompt); the tables are what docs/benchmarks.md shows.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/scheduling_one_prompt}"
mkdir -p "$out"
bench() { python -m infsamp bench scheduling "$@"; }
bench -B 1 -G 32 --micro-group 8 --prompts 8 --epochs 2 --seeds 0,1,2 --out "$out/b1"
bench -B 4 --prompts 24 --out "$out/b4"
for G in 512 8; do
  bench -B 1 -G "$G" --micro-group 8 --prompts 1 --epochs 1 \
    --variants continuous,length_aware:online --out "$out/g$G"
done
if python -c "import vllm" 2>/dev/null; then
  three=continuous,length_aware:online,length_aware:oracle
  bench --engine slots,vllm -B 1 -G 32 --micro-group 8 --prompts 8 --epochs 2 --seed 0 \
    --variants "$three" --out "$out/vllm_b1"
  bench --engine vllm -B 1 -G 32 --micro-group 8 --prompts 8 --epochs 2 --seeds 1,2 \
    --variants "$three" --out "$out/vllm_b1_seeds12"
  bench --engine slots,vllm -B 4 -G 32 --micro-group 8 --prompts 8 --epochs 2 --seed 0 \
    --variants "$three" --out "$out/vllm_b4"
fi
