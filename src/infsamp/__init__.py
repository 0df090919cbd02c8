"""infsamp: GRPO training whose group size is decoupled from memory (Infinite Sampling)."""

import logging as _logging

__version__ = "0.1.0"

# Known-harmless start-up warnings of two libraries that every command would print: torchao's
# CUDA-only kernels that do not load on a CPU build, and torch's deprecation note about torchao's
# enum registration. Silenced here, once, so the user's terminal shows only infsamp's own lines.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
