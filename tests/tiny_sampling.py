"""What the sampler tests share: a tiny random Llama whose EOS is token 1, a logits-processor
factory that makes EOS likely (a random model rarely ends on its own, so lengths would not vary),
a logits rule that records what it sees, and a few decode steps of an engine."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

EOS = 1


def tiny_llama(max_positions: int = 64) -> LlamaForCausalLM:
    """The same random weights every call (seed 0): vocabulary 64, 2 layers, EOS 1, pad 0."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, eos_token_id=EOS, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def eos_boost(eos: int = EOS, boost: float = 3.0):
    """`logits_processor_factory`: every sample's `eos` logit raised by `boost`."""
    def process(sample_ids, num_generated, scores):
        scores = scores.clone()
        scores[:, eos] += boost
        return scores

    return lambda samples: process


class RecordLogits:
    """A logits rule that changes nothing and keeps each (sample id, token index)'s logits."""

    def __init__(self):
        self.seen = {}

    def __call__(self, sample_ids, num_generated, scores):
        for sample_id, index, row in zip(sample_ids.tolist(), num_generated.tolist(), scores):
            self.seen[sample_id, index] = row.clone()
        return scores


def run_steps(engine, samples, steps: int) -> None:
    """Start `samples` in slots 0.. of a begun call and run `steps` decode steps, a sample
    leaving its slot when it ends."""
    for slot, sample in enumerate(samples):
        engine.start(slot, sample)
    active = dict(enumerate(samples))
    for _ in range(steps):
        for ended in engine.decode_step(active):
            active = {slot: s for slot, s in active.items() if s is not ended}
