#!/usr/bin/env bash
# One DDP step and one FSDP2 step on the GPUs at hand (one GPU still runs the code path), with each
# step's peak memory (memory/peak_gib: the busiest GPU's torch.cuda.max_memory_allocated) beside
# the planner's per-device figure for the same settings.
#
#   bash benchmarks/gpu_distributed.sh [OUT]            # OUT defaults to runs/gpu_distributed
#
# Needs no network: the model is a Qwen3-0.6B-shaped decoder (28 layers, hidden 1024, bf16) with
# random weights and the embedded character tokenizer (vocab 104), built from a config; the task
# is the embedded arithmetic task. Every run is `python -m infsamp train` under torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_distributed}
PY=${PY:-.venv/bin/python}
NUM_GPUS=${NUM_GPUS:-$($PY -c "import torch; print(torch.cuda.device_count())")}
G=8; B=$((2 * NUM_GPUS)); MAX_NEW=256
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
[ "$NUM_GPUS" -ge 1 ] || { echo "no CUDA GPU"; exit 1; }

$PY - "$OUT/model" <<'EOF'
import sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from infsamp.models.tiny import build_tokenizer
tok = build_tokenizer()
config = Qwen3Config(vocab_size=len(tok), hidden_size=1024, intermediate_size=3072,
                     num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, max_position_embeddings=2048, tie_word_embeddings=True,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                     bos_token_id=None, dtype="bfloat16")
torch.manual_seed(0)
Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
EOF

for STRATEGY in ddp fsdp; do
  RUN="$OUT/$STRATEGY"; rm -rf "$RUN"
  $PY -m torch.distributed.run --standalone --nproc-per-node "$NUM_GPUS" -m infsamp train \
    --model.name_or_path "$OUT/model" --model.dtype bf16 --distributed.strategy "$STRATEGY" \
    --training.max_steps 1 --training.prompts_per_step "$B" --sampling.num_generations "$G" \
    --sampling.max_new_tokens "$MAX_NEW" --eval.num_problems 0 --checkpointing.save_every 0 \
    --logging.output_dir "$RUN" --logging.progress_bar false --logging.plot false \
    > "$RUN.log" 2>&1 || { tail -30 "$RUN.log"; exit 1; }
  $PY -m infsamp plan --model "$OUT/model" --gpu-memory "$($PY -c \
    "import torch; print(torch.cuda.get_device_properties(0).total_memory)")B" \
    --num-gpus "$NUM_GPUS" --strategy "$STRATEGY" --num-generations $((G * B / NUM_GPUS)) \
    --max-prompt 256 --max-completion "$MAX_NEW" --json > "$RUN.plan.json"
  $PY - "$RUN" "$STRATEGY" "$NUM_GPUS" <<'EOF'
import json, sys
run, strategy, n = sys.argv[1:]
row = json.loads(open(f"{run}/metrics.jsonl").read().splitlines()[-1])
plan = json.loads(open(f"{run}.plan.json").read())
print(f"{strategy} on {n} GPU(s): step {row['step_time']:.1f} s, measured peak "
      f"{row.get('memory/peak_gib', float('nan')):.2f} GiB per GPU, planned "
      f"{plan['peak_bytes'] / 2**30:.2f} GiB "
      f"(generation {plan['generation']['peak'] / 2**30:.2f}, "
      f"training {plan['training']['peak'] / 2**30:.2f}), fits {plan['fits']}")
EOF
done
