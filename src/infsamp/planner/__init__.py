"""Memory planner: what fits on a GPU for a GRPO run, which g and micro-batch, which switch fixes it.

Pure Python (no torch): `load_shape` reads a preset or a config.json, `plan_memory` estimates the
generation and training phases in a precision mode (`precisions.py`), `plan_run_sizes`
(`sizes.py`) decides the run's sizes once from the plan, for `infsamp train` and `infsamp plan`
alike. See docs/planner.md.
"""

from infsamp.planner.estimate import OPTIMIZERS, PARTS, kv_bytes_per_token
from infsamp.planner.inputs import DTYPE_BYTES, PlanInputs
from infsamp.planner.precisions import PRECISIONS, PrecisionMode
from infsamp.planner.plan import MemoryPlan, plan_memory
from infsamp.planner.presets import (PRESETS, ModelShape, count_lora_parameters, count_parameters, load_shape,
                                     shape_from_config, with_layers)
from infsamp.planner.sizes import RunSizes, plan_run_sizes

__all__ = [
    "DTYPE_BYTES", "OPTIMIZERS", "PARTS", "PRECISIONS", "PRESETS",
    "MemoryPlan", "ModelShape", "PlanInputs", "PrecisionMode", "RunSizes",
    "count_lora_parameters", "count_parameters", "kv_bytes_per_token", "load_shape",
    "plan_memory", "plan_run_sizes", "shape_from_config", "with_layers",
]
