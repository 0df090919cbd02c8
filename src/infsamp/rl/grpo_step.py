"""One GRPO optimisation step over a sampled batch, with memory that does not grow with G.

    rollout (N = B*G completions, advantages [N])
      -> old log-probs (only when num_iterations > 1) and reference log-probs (only when beta > 0),
         computed without grad in token-budget micro-batches
      -> for each iteration: for each micro-batch: log-probs -> per-token loss -> aggregate with the
         WHOLE step's totals -> backward (gradients accumulate; one micro-batch of activations alive)
      -> clip, optimizer step, scheduler step

Because each micro-batch's loss is normalised by totals of the whole batch, the accumulated gradient
equals the full-batch gradient (tested). Over several ranks `totals` is the whole step's (every
rank's) and `parallel` (rl/strategies.py) reduces the gradients: each rank's last backward only
(DDP), or every backward with the ranks running equally many micro-batches (FSDP); the logged loss
and token statistics are summed over ranks. An out-of-memory error in a micro-batch splits that
micro-batch in two and retries it; gradients of the micro-batches already done are kept.
A NaN or inf loss or gradient norm is never applied: the gradients are dropped and
`NonFiniteError` raised (`training.nonfinite: stop`), or the update is skipped and counted
(`skip`).

Deliberately simple: the LR scheduler advances once per optimizer step; no sequence packing.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch
from torch import Tensor

from infsamp.config import TrainingConfig
from infsamp.errors import NonFiniteError
from infsamp.rl.distributed import Ranks
from infsamp.rl.logprobs import (build_micro_batches, make_micro_batch, micro_batch_logprobs,
                                 plan_prompt_completion_batches, sequence_logprobs)
from infsamp.rl.losses import LOSS_TYPES, BatchTotals, LossStats, per_token_loss
from infsamp.rl.strategies import Strategy

DEFAULT_MICRO_BATCH_TOKENS = 8192
MIN_MICRO_BATCH_TOKENS = 64


@dataclass
class Rollout:
    prompt_ids: list[list[int]]  # one per completion (the group's prompt repeated)
    completion_ids: list[list[int]]
    advantages: Tensor  # [N]


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def with_last(items: Iterable) -> Iterator[tuple[Any, bool]]:
    """(item, is it the last one) without materialising a generator."""
    iterator = iter(items)
    current = next(iterator, with_last)
    while current is not with_last:
        following = next(iterator, with_last)
        yield current, following is with_last
        current = following


def plan_micro_batches_of(rollout: Rollout, max_tokens: int) -> list[list[int]]:
    return plan_prompt_completion_batches([len(p) for p in rollout.prompt_ids],
                                          [len(c) for c in rollout.completion_ids], max_tokens)


class GRPOStep:
    def __init__(self, model, cfg: TrainingConfig, *, pad_token_id: int, temperature: float,
                 max_completion_length: int, ref_model=None, micro_batch_tokens: int = 0,
                 parallel: Strategy | None = None):
        self.model = model  # what the training forward runs through (a DDP/FSDP module or not)
        if parallel is None:  # one process
            parallel = Strategy(Ranks())
            parallel.wrap(model)
        self.parallel = parallel
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.max_completion_length = max_completion_length
        self.ref_model = ref_model
        self.micro_batch_tokens = micro_batch_tokens or cfg.train_micro_batch_tokens or DEFAULT_MICRO_BATCH_TOKENS
        self.num_oom_retries = 0
        self.num_skipped_updates = 0

    # ------------------------------------------------------------------ no-grad passes

    def _logprobs(self, model, rollout: Rollout) -> list[Tensor]:
        return sequence_logprobs(model, rollout.prompt_ids, rollout.completion_ids,
                                 max_tokens=self.micro_batch_tokens, pad_token_id=self.pad_token_id,
                                 temperature=self.temperature, grad=False)

    def reference_logprobs(self, rollout: Rollout, model=None) -> list[Tensor] | None:
        if self.cfg.beta == 0:
            return None
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, rollout)
        model = model or self.model
        with model.disable_adapter():  # LoRA: the base model is the reference
            return self._logprobs(model, rollout)

    def _no_grad_passes(self, rollout: Rollout) -> tuple[list[Tensor] | None, list[Tensor] | None]:
        """Old log-probs (num_iterations > 1) and reference log-probs (beta > 0), through the
        strategy's whole-weights module (its forward is this rank's alone)."""
        if self.cfg.num_iterations == 1 and self.cfg.beta == 0:
            return None, None
        with self.parallel.inference_model() as model:
            old = self._logprobs(model, rollout) if self.cfg.num_iterations > 1 else None
            return old, self.reference_logprobs(rollout, model)

    # ------------------------------------------------------------------ training

    def optimize(self, rollout: Rollout, optimizer, scheduler,
                 totals: BatchTotals | None = None) -> dict[str, Any]:
        """num_iterations optimizer steps on one rollout; returns TRL-named metrics. `totals`:
        the whole step's sizes when this rollout is one rank's share (default: the rollout's)."""
        self.model.train()
        old, ref = self._no_grad_passes(rollout)
        totals = totals or BatchTotals.from_lengths([len(c) for c in rollout.completion_ids],
                                                    self.max_completion_length)
        metrics: dict[str, Any] = {}
        for _ in range(self.cfg.num_iterations):
            loss, stats = self._summed(*self.accumulate_gradients(rollout, old, ref, totals))
            grad_norm = self._clip()
            metrics = {"loss": loss, "grad_norm": grad_norm, **stats.metrics()}
            checked = (("loss", loss), ("gradient norm", grad_norm))
            bad = next((f"{name} is {value}" for name, value in checked
                        if not math.isfinite(value)), None)
            if bad is not None:
                optimizer.zero_grad(set_to_none=True)
                if self.cfg.nonfinite == "stop":
                    raise NonFiniteError(bad)
                self.skip_update(optimizer, scheduler, num_updates=1)
                continue
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        metrics["train/micro_batch_tokens"] = self.micro_batch_tokens
        metrics["train/oom_retries"] = self.num_oom_retries
        metrics["train/skipped_updates"] = self.num_skipped_updates
        return metrics

    def skip_update(self, optimizer, scheduler, num_updates: int | None = None) -> None:
        """Count `num_updates` (default: a step's) as skipped; the schedule still advances."""
        optimizer.zero_grad(set_to_none=True)
        for _ in range(self.cfg.num_iterations if num_updates is None else num_updates):
            with warnings.catch_warnings():  # torch warns of a schedule step without an update
                warnings.simplefilter("ignore", UserWarning)
                scheduler.step()
            self.num_skipped_updates += 1

    def _summed(self, loss: float, stats: LossStats) -> tuple[float, LossStats]:
        """The loss and its token statistics over every rank (one process: as they are)."""
        values = self.parallel.sum([loss, *(getattr(stats, f.name) for f in fields(stats))])
        return values[0], LossStats(*values[1:])

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.cfg.max_grad_norm or float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def accumulate_gradients(self, rollout: Rollout, old: list[Tensor] | None, ref: list[Tensor] | None,
                             totals: BatchTotals, indices: Sequence[int] | None = None,
                             max_tokens: int | None = None,
                             sync_last: bool = True) -> tuple[float, LossStats]:
        """Backward over micro-batches of `indices`; returns (summed loss value, summed stats)."""
        total_loss, total_stats = 0.0, LossStats()
        device = next(self.model.parameters()).device
        budget = max_tokens or self.micro_batch_tokens
        batches = build_micro_batches(rollout.prompt_ids, rollout.completion_ids,
                                      max_tokens=budget, pad_token_id=self.pad_token_id,
                                      device=device, indices=indices)
        padding = 0 if indices is not None else self.parallel.padding_batches(
            len(plan_micro_batches_of(rollout, budget)))
        for mb, last in with_last(batches):
            sync = last and sync_last and not padding  # DDP: only the rank's last backward reduces
            try:
                with self.parallel.backward_sync(sync):
                    loss, stats = self._micro_batch_backward(mb, rollout, old, ref, totals)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not is_out_of_memory(err) or len(mb.indices) == 1 or \
                        not self.parallel.can_split_micro_batches:
                    raise
                loss, stats = self._retry_smaller(mb, rollout, old, ref, totals, sync)
            total_loss, total_stats = total_loss + loss, total_stats + stats
        for _ in range(padding):  # FSDP: as many forward/backward collectives as the other ranks
            self._padding_backward(rollout, device)
        return total_loss, total_stats

    def _padding_backward(self, rollout: Rollout, device) -> None:
        """A zero-weight micro-batch (one sequence): its collectives run, gradients stay."""
        mb = make_micro_batch(rollout.prompt_ids, rollout.completion_ids, [0], self.pad_token_id,
                              device)
        (micro_batch_logprobs(self.model, mb, self.temperature).sum() * 0.0).backward()

    def _retry_smaller(self, mb, rollout, old, ref, totals,
                       sync_last: bool = True) -> tuple[float, LossStats]:
        """Split the failed micro-batch in two (halving the token budget for the rest of the run)."""
        self.num_oom_retries += 1
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        padded = mb.input_ids.numel()
        self.micro_batch_tokens = max(MIN_MICRO_BATCH_TOKENS, self.micro_batch_tokens // 2)
        return self.accumulate_gradients(rollout, old, ref, totals, indices=mb.indices,
                                         max_tokens=max(MIN_MICRO_BATCH_TOKENS, padded // 2),
                                         sync_last=sync_last)

    def _micro_batch_backward(self, mb, rollout, old, ref, totals) -> tuple[float, LossStats]:
        logps = micro_batch_logprobs(self.model, mb, self.temperature)  # [b, T_c]
        per_token, stats = per_token_loss(
            logps, mb.gather(old), mb.gather(ref), mb.rows(rollout.advantages).to(logps.device),
            epsilon_low=self.cfg.epsilon, epsilon_high=self.cfg.epsilon_high or self.cfg.epsilon,
            beta=self.cfg.beta, mask=mb.completion_mask)
        loss = LOSS_TYPES[self.cfg.loss_type](per_token, mb.completion_mask, totals)  # []
        loss.backward()
        return loss.item(), stats
