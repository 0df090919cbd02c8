"""The chunked LM head: the same log-probs and entropies as the full logits (to fp32 rounding: the
head's matmul rounds by its number of rows), gradients within 1e-5
of them for every loss type (temperature, entropy mask, two iterations, KL reference), LoRA on
and off the head, tied and untied embeddings, the models' own logit transforms, and no
[tokens, vocabulary] tensor alive at once."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infsamp.algorithm import lm_head
from infsamp.algorithm.grpo_step import GRPOStep
from infsamp.algorithm.logprobs import completion_logprobs, make_micro_batch
from infsamp.algorithm.losses import LOSS_TYPES
from infsamp.algorithm.rollout import Rollout
from infsamp.config import ModelConfig
from infsamp.config_algorithm import TrainingConfig

from test_logprobs import PAD, VOCAB, random_batch, tiny_model

PROMPTS, COMPLETIONS = random_batch([4, 4, 4, 7, 7, 7], [12, 2, 6, 9, 1, 4])
ROWS, COLUMNS = 5, 7  # chunk sizes in the tests: several row and vocabulary chunks, a remainder


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(lm_head, "logits_chunk_rows", lambda vocab: ROWS)
    monkeypatch.setattr(lm_head, "logits_chunk_columns", lambda rows: COLUMNS)


def micro_batch(indices=(0, 1, 2, 3, 4, 5)):
    return make_micro_batch(PROMPTS, COMPLETIONS, list(indices), pad_token_id=PAD)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tied", [False, True])
def test_the_same_log_probs_and_entropies_as_the_full_logits(temperature, tied):
    model = tiny_model(tie=tied)
    mb = micro_batch()
    expected, expected_entropy = completion_logprobs(model, mb, temperature, True, chunked=False)
    logps, entropy = completion_logprobs(model, mb, temperature, with_entropy=True)
    real = mb.completion_mask.bool()  # the head's matmul rounds by its row count: fp32's last bit
    torch.testing.assert_close(logps[real], expected[real], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy[real], expected_entropy[real], atol=1e-6, rtol=1e-6)
    assert torch.equal(logps[~real], torch.zeros_like(logps[~real]))


def trained(chunked: bool, temperature: float, **options):
    """Weights and metrics after one optimize() (num_iterations SGD steps) on a fixed rollout;
    `chunked`: training.chunked_lm_head (False: the model's full logits, as before)."""
    model = tiny_model(tie=True)
    cfg = TrainingConfig(**options, max_grad_norm=0.0, chunked_lm_head=chunked)
    cfg.validate()
    ref = tiny_model(seed=1) if cfg.beta else None
    step = GRPOStep(model, cfg, pad_token_id=PAD, temperature=temperature,
                    max_new_tokens=12, micro_batch_tokens=100, ref_model=ref)
    advantages = torch.randn(len(COMPLETIONS), generator=torch.Generator().manual_seed(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics = step.optimize(Rollout(PROMPTS, COMPLETIONS, advantages), optimizer, scheduler)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, metrics


EVERYTHING = {"top_entropy_quantile": 0.4, "num_iterations": 2, "beta": 0.04}  # entropy, KL


@pytest.mark.parametrize("loss_type,temperature,options",
                         [(name, 0.9, EVERYTHING) for name in sorted(LOSS_TYPES)]
                         + [("dapo", 1.0, {})])
def test_training_equals_the_full_logits_for_every_loss_type(loss_type, temperature, options):
    options = dict(options, loss_type=loss_type)
    weights, metrics = trained(True, temperature, **options)
    expected, expected_metrics = trained(False, temperature, **options)
    before = tiny_model(tie=True).state_dict()
    assert all(not torch.equal(weights[n], before[n]) for n in weights)  # every weight trained
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], atol=1e-5, rtol=0, msg=name)
    for key in ("loss", "entropy", "kl", "clip_ratio/region_mean"):
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-5, abs=1e-7), key


def gradients(model, chunked: bool, temperature=0.8):
    model.zero_grad()
    mb = micro_batch()
    logps = completion_logprobs(model, mb, temperature, chunked=chunked)[0]
    weights = torch.randn(logps.shape, generator=torch.Generator().manual_seed(5))
    (logps * weights * mb.completion_mask).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]],
                         ids=["lora", "lora-on-lm_head"])
def test_lora_gradients_equal_the_full_logits(targets):
    from infsamp.models.loading import apply_lora

    model = apply_lora(tiny_model(), ModelConfig(lora_rank=4, lora_target_modules=targets,
                                                 lora_dropout=0.0))
    for name, param in model.named_parameters():  # B = 0 at init: make every adapter count
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(7))
    chunked = gradients(model, True)
    expected = gradients(model, False)
    assert sorted(chunked) == sorted(expected) and any("lm_head" in n for n in chunked) == (
        "lm_head" in targets)
    for name in expected:
        torch.testing.assert_close(chunked[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)
    with model.disable_adapter(), torch.no_grad():  # the KL reference: adapters off
        off = completion_logprobs(model, micro_batch())[0]
    with torch.no_grad():
        base = completion_logprobs(tiny_model(), micro_batch())[0]
    torch.testing.assert_close(off, base, atol=1e-6, rtol=0)


def test_mixed_precision_is_as_accurate_as_the_full_logits():
    """Under bf16 autocast the backward recomputes each chunk in the forward's autocast (its
    softmax matches the forward's normaliser); against fp32 gradients the chunked path errs no
    more than the full logits' bf16 backward does."""
    from infsamp.models.precision import apply_compute
    from infsamp.planner import PRECISIONS

    exact = gradients(tiny_model(), False)
    model = apply_compute(tiny_model(), PRECISIONS["mixed"])
    chunked = gradients(model, True)
    full = gradients(model, False)
    for name, truth in exact.items():
        error, full_error = ((g[name] - truth).norm() / truth.norm() for g in (chunked, full))
        assert error <= 1.5 * full_error + 1e-3, (name, float(error), float(full_error))


def tiny_family(family: str):
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
    )

    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "pad_token_id": PAD}
    torch.manual_seed(0)
    if family == "gemma2":  # soft-capped logits
        return Gemma2ForCausalLM(Gemma2Config(**common, final_logit_softcapping=3.0))
    if family == "cohere":  # logits * logit_scale
        return CohereForCausalLM(CohereConfig(**common, logit_scale=0.5))
    return GraniteForCausalLM(GraniteConfig(**common, logits_scaling=4.0))  # logits / scaling


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_the_models_own_logit_transform_is_applied(family):
    model = tiny_family(family).float()
    assert lm_head.logit_transform(model.config) is not None
    mb = micro_batch()
    expected = completion_logprobs(model, mb, 0.7, chunked=False)[0]
    chunked = completion_logprobs(model, mb, 0.7)[0]
    real = mb.completion_mask.bool()
    torch.testing.assert_close(chunked[real], expected[real], atol=1e-6, rtol=0)
    expected_grads = gradients(model, False, 0.7)
    for name, grad in gradients(model, True, 0.7).items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-5, msg=name)


class LargestLogits(TorchDispatchMode):
    """The most elements of any op output with a vocabulary-sized dimension, other than the
    head's weight, its transpose and its gradient ([V, H])."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and VOCAB in t.shape and sorted(t.shape) != [32, VOCAB]:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunked", [True, False])
def test_no_tokens_by_vocabulary_tensor_exists(chunked):
    model = tiny_model(tie=True)
    mb = micro_batch()
    num_tokens = int(mb.completion_mask.sum())  # 34 rows of logits
    with LargestLogits() as meter:
        logps = completion_logprobs(model, mb, 0.7, with_entropy=True, chunked=chunked)[0]
        logps.sum().backward()
    if chunked:  # forward chunks of ROWS rows; backward chunks have COLUMNS < VOCAB columns
        assert meter.largest == ROWS * VOCAB
    else:
        assert meter.largest >= num_tokens * VOCAB
