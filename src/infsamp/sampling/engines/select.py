"""Next-token selection whose randomness belongs to the sample, not to the batch.

Greedy (temperature 0) is an argmax. Otherwise tokens are drawn by the Gumbel-max trick:
argmax(logits / T + Gumbel noise), which samples exactly from softmax(logits / T). The noise of
sample s at its n-th token is a counter-based hash of (seed, s, n, vocab index), so a sample draws
the same random numbers whichever slot, round or batch it lands in: the policies differ only in
schedule, not in outcome (up to floating-point differences of the logits).
`DecodeOptions.sample_keys` renames s: a rank that samples part of a step keys each sample by its
place in the whole step, so every process count draws the same completions. top-k / top-p use
transformers' logits warpers.

For a large [S, V] (`IN_PLACE_FROM` entries) the hash runs in int32 in place (`_mix32_int32_`:
wrapping products, masked shifts: the same bits as the int64 formula `_mix32`, half the memory
traffic and no [S, V] temporaries per operation); it is most of a large-vocabulary model's
selection time. Below that the int64 formula's fewer operations cost less.

Deliberately simple: a 32-bit integer hash (lowbias32), 24-bit uniforms; ample for sampling, not
crypto.
"""

from __future__ import annotations

import functools

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from infsamp.sampling.engines.base import DecodeOptions

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finaliser on int64 tensors holding 32-bit values (products wrap, the mask keeps 32
    bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 tensors holding 32-bit values -> int32 with the same bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _shift_xor_(x: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """x ^= x >>> shift (logical shift of the 32 bits), in place."""
    torch.bitwise_right_shift(x, shift, out=scratch)
    x.bitwise_xor_(scratch.bitwise_and_((1 << (32 - shift)) - 1))


def _mix32_int32_(x: torch.Tensor) -> torch.Tensor:
    """`_mix32` on int32 tensors, in place (products wrap mod 2^32 as the mask makes them)."""
    scratch = torch.empty_like(x)
    _shift_xor_(x, 16, scratch)
    x.mul_(0x7FEB352D)
    _shift_xor_(x, 15, scratch)
    x.mul_(0x846CA68B - (1 << 32))
    _shift_xor_(x, 16, scratch)
    return x


IN_PLACE_FROM = 1 << 16  # [S, V] entries from which the int32 in-place hash is the faster


@functools.lru_cache(maxsize=8)
def _vocab_term(vocab_size: int, device: torch.device) -> torch.Tensor:
    """The vocabulary's part of the hash, [V] (the same every step: made once; never written)."""
    return torch.arange(vocab_size, device=device) * 0xC2B2AE3D


def uniform_noise(seed: int, sample_ids: torch.Tensor, num_generated: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
    """U(0,1) noise [S, V] that depends only on (seed, sample id, token index, vocab index)."""
    per_sample = _mix32((sample_ids * 0x9E3779B1 + (seed & _MASK32)) & _MASK32)  # [S]
    per_token = _mix32((per_sample + num_generated * 0x85EBCA77) & _MASK32)  # [S]
    vocab = _vocab_term(vocab_size, sample_ids.device)  # [V]
    if per_token.numel() * vocab_size < IN_PLACE_FROM:
        bits = _mix32((per_token[:, None] + vocab[None, :]) & _MASK32)  # [S, V]
        return ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)
    # [S, V] in int32, the sum wrapping as & MASK does
    bits = _as_int32(per_token)[:, None] + _as_int32(vocab & _MASK32)[None, :]
    _mix32_int32_(bits)
    bits.bitwise_right_shift_(8).bitwise_and_((1 << 24) - 1)  # the top 24 bits
    return bits.to(torch.float32).add_(0.5).div_(float(1 << 24))


def build_warpers(options: DecodeOptions) -> list:
    warpers = []
    if options.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=options.top_k))
    if options.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=options.top_p))
    return warpers


def select_tokens(scores: torch.Tensor, sample_ids: torch.Tensor, num_generated: torch.Tensor,
                  options: DecodeOptions, warpers: list) -> torch.Tensor:
    """Next token per row of `scores` [S, V] (float32 logits after any custom processor) -> [S]."""
    if options.temperature == 0:
        return scores.argmax(dim=-1)
    scores = scores / options.temperature
    for warper in warpers:
        scores = warper(None, scores)
    keys = sample_ids if not options.sample_keys else \
        torch.as_tensor(options.sample_keys, device=sample_ids.device)[sample_ids]  # [S]
    gumbel = uniform_noise(options.seed, keys, num_generated, scores.shape[-1])  # [S, V]
    gumbel = gumbel.log_().neg_().log_().neg_()  # -log(-log(noise)), in place
    return gumbel.add_(scores).argmax(dim=-1)  # scores + Gumbel noise


class ForcedLengths:
    """Logits rule for a controlled workload: EOS banned before a sample's target length, forced
    at it."""

    def __init__(self, targets: list[int] | tuple[int, ...], eos_id: int):
        self.targets = torch.tensor(targets)  # [N], indexed by sample id
        self.eos_id = eos_id

    def __call__(self, sample_ids: torch.Tensor, num_generated: torch.Tensor,
                 scores: torch.Tensor) -> torch.Tensor:  # [S], [S], [S, V] -> [S, V]
        position = num_generated + 1  # length the sample reaches with this token
        target = self.targets.to(sample_ids.device)[sample_ids]  # [S]
        scores = scores.clone()
        scores[position < target, self.eos_id] = -torch.inf
        forced = position >= target
        scores[forced] = -torch.inf
        scores[forced, self.eos_id] = 0.0
        return scores
