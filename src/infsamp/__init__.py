"""infsamp: GRPO training whose group size is decoupled from memory (Infinite Sampling)."""

__version__ = "0.1.0"
