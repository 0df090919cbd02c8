"""Decoding engines behind the sampler: `slots` (transformers model forward, CPU/GPU) and `vllm`
(`base.py` lists them)."""
