"""One GRPO optimisation step over a sampled batch, with memory that does not grow with G.

    rollout (N = B*G completions, advantages [N])
      -> old log-probs (only when num_iterations > 1) and reference log-probs (only when beta > 0),
         computed without grad in token-budget micro-batches
      -> for each iteration: for each micro-batch: log-probs -> per-token loss -> aggregate with the
         WHOLE step's totals -> backward (gradients accumulate; one micro-batch of activations alive)
      -> clip, optimizer step, scheduler step

Because each micro-batch's loss is normalised by totals of the whole batch, the accumulated gradient
equals the full-batch gradient (tested). An out-of-memory error in a micro-batch splits that
micro-batch in two and retries it; gradients of the micro-batches already done are kept.

Deliberately simple: the LR scheduler advances once per optimizer step; no sequence packing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from infsamp.config import TrainingConfig
from infsamp.rl.importance import MismatchStats, engine_importance_weights
from infsamp.rl.logprobs import build_micro_batches, micro_batch_logprobs, sequence_logprobs
from infsamp.rl.losses import LOSS_TYPES, BatchTotals, LossStats, per_token_loss

DEFAULT_MICRO_BATCH_TOKENS = 8192
MIN_MICRO_BATCH_TOKENS = 64


@dataclass
class Rollout:
    prompt_ids: list[list[int]]  # one per completion (the group's prompt repeated)
    completion_ids: list[list[int]]
    advantages: Tensor  # [N]
    engine_logprobs: list[Tensor] | None = None  # per completion [T_i]: the sampling engine's


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


class GRPOStep:
    def __init__(self, model, cfg: TrainingConfig, *, pad_token_id: int, temperature: float,
                 max_completion_length: int, ref_model=None, micro_batch_tokens: int = 0,
                 importance_sampling: str = "token_truncate",
                 importance_sampling_cap: float = 3.0):
        self.model = model
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.max_completion_length = max_completion_length
        self.ref_model = ref_model
        self.micro_batch_tokens = micro_batch_tokens or cfg.train_micro_batch_tokens or DEFAULT_MICRO_BATCH_TOKENS
        self.num_oom_retries = 0
        self.importance_sampling = importance_sampling  # rl/importance.py: for vLLM's samples
        self.importance_sampling_cap = importance_sampling_cap
        self.mismatch = MismatchStats()
        self._first_pass = True

    # ------------------------------------------------------------------ no-grad passes

    def _logprobs(self, model, rollout: Rollout) -> list[Tensor]:
        return sequence_logprobs(model, rollout.prompt_ids, rollout.completion_ids,
                                 max_tokens=self.micro_batch_tokens, pad_token_id=self.pad_token_id,
                                 temperature=self.temperature, grad=False)

    def reference_logprobs(self, rollout: Rollout) -> list[Tensor] | None:
        if self.cfg.beta == 0:
            return None
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, rollout)
        with self.model.disable_adapter():  # LoRA: the base model is the reference
            return self._logprobs(self.model, rollout)

    # ------------------------------------------------------------------ training

    def optimize(self, rollout: Rollout, optimizer, scheduler) -> dict[str, Any]:
        """num_iterations optimizer steps on one rollout; returns TRL-named metrics."""
        self.model.train()
        old = self._logprobs(self.model, rollout) if self.cfg.num_iterations > 1 else None
        ref = self.reference_logprobs(rollout)
        totals = BatchTotals.from_lengths([len(c) for c in rollout.completion_ids], self.max_completion_length)
        metrics: dict[str, Any] = {}
        self.mismatch = MismatchStats()
        for iteration in range(self.cfg.num_iterations):
            self._first_pass = iteration == 0
            loss, stats = self.accumulate_gradients(rollout, old, ref, totals)
            grad_norm = self._clip()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            metrics = {"loss": loss, "grad_norm": grad_norm, **stats.metrics()}
        metrics.update(self.mismatch.metrics())
        metrics["train/micro_batch_tokens"] = self.micro_batch_tokens
        metrics["train/oom_retries"] = self.num_oom_retries
        return metrics

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.cfg.max_grad_norm or float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def accumulate_gradients(self, rollout: Rollout, old: list[Tensor] | None, ref: list[Tensor] | None,
                             totals: BatchTotals, indices: Sequence[int] | None = None,
                             max_tokens: int | None = None) -> tuple[float, LossStats]:
        """Backward over micro-batches of `indices`; returns (summed loss value, summed stats)."""
        total_loss, total_stats = 0.0, LossStats()
        device = next(self.model.parameters()).device
        batches = build_micro_batches(rollout.prompt_ids, rollout.completion_ids,
                                      max_tokens=max_tokens or self.micro_batch_tokens,
                                      pad_token_id=self.pad_token_id, device=device, indices=indices)
        for mb in batches:
            try:
                loss, stats = self._micro_batch_backward(mb, rollout, old, ref, totals)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not is_out_of_memory(err) or len(mb.indices) == 1:
                    raise
                loss, stats = self._retry_smaller(mb, rollout, old, ref, totals)
            total_loss, total_stats = total_loss + loss, total_stats + stats
        return total_loss, total_stats

    def _retry_smaller(self, mb, rollout, old, ref, totals) -> tuple[float, LossStats]:
        """Split the failed micro-batch in two (halving the token budget for the rest of the run)."""
        self.num_oom_retries += 1
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        padded = mb.input_ids.numel()
        self.micro_batch_tokens = max(MIN_MICRO_BATCH_TOKENS, self.micro_batch_tokens // 2)
        return self.accumulate_gradients(rollout, old, ref, totals, indices=mb.indices,
                                         max_tokens=max(MIN_MICRO_BATCH_TOKENS, padded // 2))

    def _micro_batch_backward(self, mb, rollout, old, ref, totals) -> tuple[float, LossStats]:
        logps = micro_batch_logprobs(self.model, mb, self.temperature)  # [b, T_c]
        per_token, stats = per_token_loss(
            logps, mb.gather(old), mb.gather(ref), mb.rows(rollout.advantages).to(logps.device),
            epsilon_low=self.cfg.epsilon, epsilon_high=self.cfg.epsilon_high or self.cfg.epsilon,
            beta=self.cfg.beta, mask=mb.completion_mask)
        per_token = per_token * self._engine_weights(mb, rollout, logps, old)  # [b, T_c]
        loss = LOSS_TYPES[self.cfg.loss_type](per_token, mb.completion_mask, totals)  # []
        loss.backward()
        return loss.item(), stats

    def _engine_weights(self, mb, rollout: Rollout, logps: Tensor,
                        old: list[Tensor] | None) -> Tensor | float:
        """Truncated importance weights exp(old - engine) when another engine (vLLM) sampled the
        completions (`rl/importance.py`); 1 otherwise. The mismatch is measured on the first
        pass."""
        if rollout.engine_logprobs is None:
            return 1.0
        old_logps = logps.detach() if old is None else mb.gather(old)  # [b, T_c]
        engine_logps = mb.gather(rollout.engine_logprobs)  # [b, T_c]
        weights = engine_importance_weights(old_logps, engine_logps, mb.completion_mask,
                                            self.importance_sampling, self.importance_sampling_cap)
        if self._first_pass:
            self.mismatch.add(old_logps, engine_logps, mb.completion_mask, weights)
        return weights
