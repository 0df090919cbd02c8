"""Micro-batch tensors, chunked log-softmax and entropy, completion log-probs and exact
gradient accumulation."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infsamp.algorithm.lm_head import logits_log_softmax
from infsamp.algorithm.logprobs import (
    build_micro_batches,
    make_micro_batch,
    micro_batch_logprobs,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from infsamp.algorithm.losses import LOSS_TYPES, BatchTotals, per_token_loss

PAD = 0
VOCAB = 53


def tiny_model(seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=PAD, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).float()


def random_batch(prompt_lengths, completion_lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in prompt_lengths]
    completions = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in completion_lengths]
    return prompts, completions


# --- tensors and log-probs ------------------------------------------------------------------------


def test_micro_batch_layout_left_prompt_right_completion():
    mb = make_micro_batch([[7, 8], [9]], [[1], [2, 3, 4]], [0, 1], pad_token_id=PAD)
    assert mb.input_ids.tolist() == [[7, 8, 1, 0, 0], [0, 9, 2, 3, 4]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 2, 2], [0, 0, 1, 2, 3]]
    assert mb.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert mb.gather([torch.tensor([0.5]),
                      torch.tensor([1.0, 2.0, 3.0])]).tolist() == [[0.5, 0, 0], [1, 2, 3]]
    assert mb.rows(torch.tensor([10.0, 20.0])).tolist() == [10.0, 20.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_log_softmax_matches_log_softmax_gather(dtype):
    logits = torch.randn(3, 7, 50, dtype=dtype).requires_grad_()
    index = torch.randint(0, 50, (3, 7))
    naive = logits.float().log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)  # [3, 7]
    chunked, _ = logits_log_softmax(logits, index, chunk_rows=4)  # 21 rows: chunks of 4, a rest
    torch.testing.assert_close(chunked, naive)
    (grad_naive,) = torch.autograd.grad(naive.sum(), logits)
    (grad_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    torch.testing.assert_close(grad_chunked, grad_naive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_comes_from_the_same_chunked_pass(dtype):
    logits = torch.randn(3, 7, 50, dtype=dtype).requires_grad_()
    index = torch.randint(0, 50, (3, 7))
    logps, entropy = logits_log_softmax(logits, index, chunk_rows=4, with_entropy=True)
    full = logits.float().log_softmax(-1)  # [3, 7, 50]
    torch.testing.assert_close(logps, logits_log_softmax(logits, index, chunk_rows=4)[0])
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1))
    assert logps.requires_grad and not entropy.requires_grad


def test_entropy_ignores_impossible_tokens():
    logits = torch.tensor([[[0.0, 0.0, -torch.inf, -torch.inf]]])  # two equally likely tokens
    _, entropy = logits_log_softmax(logits, torch.tensor([[0]]), with_entropy=True)
    torch.testing.assert_close(entropy, torch.tensor([[math.log(2)]]))


@pytest.mark.parametrize("budget", [12, 10_000])
def test_sequence_logprobs_and_entropy_match_unpadded_forward(budget):
    model = tiny_model().eval()
    prompts, completions = random_batch([3, 7, 5, 2], [6, 1, 9, 0])
    logps, entropies = sequence_logprobs_and_entropy(model, prompts, completions,
                                                     max_tokens=budget, pad_token_id=PAD,
                                                     temperature=0.7)
    for prompt, completion, lp, ent in zip(prompts, completions, logps, entropies):
        assert lp.shape == ent.shape == (len(completion),)
        if not completion:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits  # [1, P + L, V]
        full = (logits[0, len(prompt) - 1: -1] / 0.7).log_softmax(-1)  # [L, V]
        chosen = full.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)  # [L]
        torch.testing.assert_close(ent, -(full.exp() * full).sum(-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lp, chosen, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [12, 10_000])
def test_sequence_logprobs_match_unpadded_forward(budget):
    model = tiny_model().eval()
    prompts, completions = random_batch([3, 7, 5, 2], [6, 1, 9, 0])
    out = sequence_logprobs(model, prompts, completions, max_tokens=budget, pad_token_id=PAD,
                            temperature=0.7)
    for prompt, completion, logps in zip(prompts, completions, out):
        assert logps.shape == (len(completion),) and not logps.requires_grad
        if not completion:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1] / 0.7
        expected = logits.log_softmax(-1).gather(-1,
                                                 torch.tensor(completion).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(logps, expected, atol=1e-5, rtol=1e-5)


def test_only_completion_logits_are_requested():
    model = tiny_model().eval()
    seen = []
    forward = model.forward
    model.forward = lambda *a, **kw: seen.append(kw.get("logits_to_keep")) or forward(*a, **kw)
    mb = make_micro_batch(*random_batch([4, 6], [3, 5]), [0, 1], pad_token_id=PAD)
    with torch.no_grad():
        logps = micro_batch_logprobs(model, mb)
    assert seen == [5 + 1] and logps.shape == (2, 5)


# --- gradient accumulation ------------------------------------------------------------------------


def accumulated_gradients(model, prompts, completions, budget, loss_type, old, ref, advantages):
    """The trainer's loop: forward -> per-token loss -> aggregate with the step's totals ->
    backward."""
    model.zero_grad()
    totals = BatchTotals.from_lengths([len(c) for c in completions], max_new_tokens=12)
    num_micro_batches = 0
    for mb in build_micro_batches(prompts, completions, max_tokens=budget, pad_token_id=PAD):
        logps = micro_batch_logprobs(model, mb, temperature=0.9)  # [b, T_c]
        loss, _ = per_token_loss(logps, mb.gather(old), mb.gather(ref), mb.rows(advantages),
                                 epsilon_low=0.2, beta=0.04, mask=mb.completion_mask,
                                 epsilon_high=1.2 if loss_type == "cispo" else 0.28,
                                 loss_type=loss_type)
        LOSS_TYPES[loss_type].aggregate(loss, mb.completion_mask, totals).backward()
        num_micro_batches += 1
    return {n: p.grad.clone() for n, p in model.named_parameters()}, num_micro_batches


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_micro_batch_gradients_equal_full_batch(loss_type):
    model = tiny_model()
    prompts, completions = random_batch([4, 4, 4, 7, 7, 7], [12, 2, 6, 9, 1, 4])
    current = sequence_logprobs(model, prompts, completions, max_tokens=64, pad_token_id=PAD,
                                temperature=0.9)
    g = torch.Generator().manual_seed(3)
    # off-policy: ratios get clipped
    old = [c + 0.3 * torch.randn(c.shape, generator=g) for c in current]
    ref = [c + 0.5 * torch.randn(c.shape, generator=g) for c in current]
    advantages = torch.randn(6, generator=g)
    full, n_full = accumulated_gradients(model, prompts, completions, 10_000, loss_type, old, ref,
                                         advantages)
    split, n_split = accumulated_gradients(model, prompts, completions, 30, loss_type, old, ref,
                                           advantages)
    assert n_full == 1 and n_split >= 4
    assert all(grad.abs().sum() > 0 for grad in full.values())
    for name, grad in full.items():
        torch.testing.assert_close(split[name], grad, atol=1e-5, rtol=1e-5, msg=name)
