#!/usr/bin/env bash
# Download, here, the wheels the GPU suite (benchmarks/gpu_suite.sh) installs on the H200, into
# .whl/ (git-ignored; name it in the device call's `carry`). The H200's Python 3.12 already has
# torch 2.11 (CUDA 13), transformers 5.17, peft, accelerate, safetensors, tokenizers, numpy,
# matplotlib, pyyaml, tqdm, pyarrow, pandas, xxhash, fsspec, huggingface-hub, psutil, jinja2; it
# lacks what the suite's code paths import:
#   trl          part 3 (GRPOTrainer)                        needs datasets
#   datasets     TRL imports it; vs_trl.py builds its Dataset   needs dill, multiprocess
#   torchao      bf16 precision mode (stochastic-rounding AdamW; 0.18 loads its kernels on
#                torch >= 2.11)
#   torch-optimi part 4's bf16_kahan candidate (benchmarks/precision.py)
# vLLM's CUDA wheel (hundreds of MB with its CUDA kernels) cannot travel in the 64 MiB the device
# call carries, so the suite leaves vLLM out.
#   bash benchmarks/gpu_wheels.sh            # -> .whl/*.whl, sizes printed, limit checked
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PINS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchao==0.18.0
      torch-optimi==0.3.3)
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$tag")
done
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${PINS[@]}"
ls -l .whl
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb | tail -1 | cut -f1)
total=$((wheels + tree + ${untracked:-0}))
mib=1048576
echo "wheels $((wheels / mib)) MiB + working tree $(((tree + ${untracked:-0}) / mib)) MiB" \
     "= $((total / mib)) MiB (a device call carries at most 64 MiB)"
if [ "$total" -ge $((64 * mib)) ]; then
  echo "over 64 MiB: drop a wheel or shrink the tree" >&2
  exit 1
fi
