#!/usr/bin/env bash
# The GPU checks of the precision modes, in one short run (prepared; no GPU was lent when written):
#  1. planned vs measured peak memory (torch.cuda.max_memory_allocated) of sampling and of one training
#     step for every mode (fp32, mixed, bf16) on the qwen3-0.6b / qwen3-1.7b shapes, and QLoRA
#     (4-bit base, LoRA rank 16; needs bitsandbytes) in mixed and bf16;
#  2. the follow ratio of each mode against fp32 on the embedded model (lr 1e-6, 10/100/300 steps).
# Usage: bash benchmarks/gpu_precision.sh [OUTDIR]   (tables as markdown in OUTDIR, default runs/gpu_precision)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_precision}"
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'needs a CUDA GPU'; print(torch.cuda.get_device_name())"
python benchmarks/memory.py --device cuda --precision all | tee "$out/memory.md"
python benchmarks/precision.py --device cuda --steps 10,100,300 --modes fp32,mixed,bf16,bf16_lossy \
  | tee "$out/precision.md"
