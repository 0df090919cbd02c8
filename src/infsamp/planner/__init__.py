"""Memory planner: what fits on a GPU for a GRPO run, which g and micro-batch, which switch fixes it.

Pure Python (no torch): `load_shape` reads a preset or a config.json, `plan_memory` estimates the
generation and training phases in a precision mode (`precisions.py`), `auto_kv_budget_tokens` /
`auto_train_micro_batch_tokens` size the sampler's KV budget and the trainer's micro-batch at run
time. See docs/planner.md.
"""

from infsamp.planner.estimate import DTYPE_BYTES, OPTIMIZERS, PARTS, PlanInputs, kv_bytes_per_token
from infsamp.planner.precisions import PRECISIONS, PrecisionMode
from infsamp.planner.plan import (MemoryPlan, auto_kv_budget_tokens, auto_train_micro_batch_tokens,
                                  plan_memory)
from infsamp.planner.presets import (PRESETS, ModelShape, count_lora_parameters, count_parameters, load_shape,
                                     shape_from_config, with_layers)

__all__ = [
    "DTYPE_BYTES", "OPTIMIZERS", "PARTS", "PRECISIONS", "PRESETS",
    "MemoryPlan", "ModelShape", "PlanInputs", "PrecisionMode",
    "auto_kv_budget_tokens", "auto_train_micro_batch_tokens", "count_lora_parameters", "count_parameters",
    "kv_bytes_per_token", "load_shape", "plan_memory", "shape_from_config", "with_layers",
]
