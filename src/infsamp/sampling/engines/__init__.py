"""Decoding engines behind the sampler: `slots` (transformers model forward, CPU/GPU) and, later,
vLLM."""
