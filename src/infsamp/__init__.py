"""infsamp: GRPO training whose group size is decoupled from memory (Infinite Sampling)."""

from infsamp.console import quiet_library_noise as _quiet_library_noise

__version__ = "0.1.0"

# Known-harmless lines other libraries print at start-up or in the vLLM engine (torchao's CUDA-only
# kernels on a CPU build, torch's deprecation note about torchao's enums, ...): filtered here,
# once, by message, so the terminal shows infsamp's lines and every real warning (console.py).
_quiet_library_noise()
