"""infsamp: GRPO training whose group size is decoupled from memory (Infinite Sampling)."""

from infsamp.console import quiet_library_noise as _quiet_library_noise

__version__ = "0.1.0"

# known-harmless lines of other libraries, filtered once per process by message (console.py)
_quiet_library_noise()
