"""Per-device memory when a run spreads over several GPUs: DDP replicas or FSDP2 shards.

Pure Python (no torch). `per_device_parts` turns the one-device bytes of a phase (generation or
training, before allocator overhead) into what each of `num_devices` GPUs holds:

- `single`: unchanged.
- `ddp`: every device holds the whole model, gradients and optimizer states; DDP's gradient buckets
  (the gradients are views into them) stay allocated between steps, so generation holds them too.
- `fsdp` (FSDP2, as `distributed/strategies.py` runs it): weights, gradients and optimizer states are
  sharded 1/N, in the bytes of the precision mode (`planner/precisions.py`: fp32 master weights
  and states under fp32/mixed, bf16 under bf16, 8-bit states under adamw8bit). Generation on the
  slot engine decodes with a whole copy of the weights gathered for the sampler (the sharded
  forward is a collective and ranks decode different numbers of steps), so it holds the shards
  plus the whole weights; on vLLM the whole copy is vLLM's own (`vllm_weights`), pushed to it
  after each step, so nothing more is gathered. Training holds the shards plus what is gathered
  at a time: the root unit (embeddings, final norm, untied lm_head: kept for the whole forward
  and backward) and two decoder layers (the one computing, the one prefetched), and their unsharded gradients until
  they are reduce-scattered. The optimizer step runs on shards (its temporaries are 1/N too).

Deliberately simplified: a reference model (beta > 0) is whole on every device (it is not
sharded); `mixed`'s autocast copies (bf16 casts of the gathered weights, saved for the backward)
are counted whole; communication buffers are not counted (NCCL's are small next to these).
"""

from __future__ import annotations

from infsamp.planner.inputs import PlanInputs
from infsamp.planner.presets import embedding_parameters, layer_parameters


def shard_fraction(p: PlanInputs) -> float:
    """The share of sharded states one device keeps."""
    return 1.0 / p.num_devices if p.strategy == "fsdp" else 1.0


def gathered_parameters(p: PlanInputs) -> int:
    """FSDP: parameters whole on a device during training (root unit + two layers)."""
    s = p.shape
    root = embedding_parameters(s) * (1 if s.tie_word_embeddings else 2) + s.hidden_size
    return root + 2 * layer_parameters(s)


def per_device_parts(p: PlanInputs, parts: dict[str, int], phase: str) -> dict[str, int]:
    """Bytes of each part on one device (module docstring); `phase`: generation or training."""
    if p.strategy == "ddp" and phase == "generation":
        return {**parts, "gradients": p.num_trainable * p.trainable_bytes}
    if p.strategy != "fsdp":
        return parts
    n, weights = p.num_devices, parts["weights"]
    out = {**parts, "optimizer": parts["optimizer"] // n}
    if phase == "generation":  # shards + the whole copy the slot sampler uses (vLLM: its own)
        out["weights"] = weights // n + (weights if p.engine != "vllm" else 0)
    else:
        gathered = gathered_parameters(p) * p.dtype_bytes
        out["weights"] = weights // n + gathered
        out["gradients"] = parts["gradients"] // n + gathered_parameters(p) * p.trainable_bytes
    return out
