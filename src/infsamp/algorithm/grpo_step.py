"""One GRPO optimisation step over a sampled batch, with memory that does not grow with G.

    rollout (N = B*G completions, advantages [N])
      -> step inputs, fixed for all iterations (StepInputs):
         which sequences carry loss (mask_truncated_completions drops those cut at the length
         limit); a no-grad pass for old log-probs (num_iterations > 1) and token entropies
         (top_entropy_quantile < 1: high-entropy token masks, thresholded over the WHOLE step);
         reference log-probs (beta > 0); all in token-budget micro-batches
      -> for each iteration: for each micro-batch: log-probs + entropy -> per-token loss of the
         loss type -> aggregate with the WHOLE step's totals -> backward (gradients accumulate;
         one micro-batch of activations alive)
      -> clip, optimizer step, scheduler step

Because each micro-batch's loss is normalised by totals of the whole batch and every mask is fixed
per step, the accumulated gradient equals the full-batch gradient (tested). Over several ranks
`totals`, the high-entropy threshold and the logged loss, token and importance-weight statistics
are every rank's, and `parallel` (distributed/strategies.py) reduces the gradients
(docs/distributed.md, "Same gradient as one process"). An out-of-memory error in a micro-batch
splits that micro-batch in two and retries it; gradients of the micro-batches already done are
kept. A NaN or inf loss or gradient norm is never applied: the gradients are dropped and
`NonFiniteError` raised (`training.nonfinite: stop`), or the update is skipped and counted (`skip`).

Multi-turn completions (`Rollout.model_masks`): a tool's answer inside a completion is context,
not an action; every micro-batch's `completion_mask` holds the model's tokens only
(`logprobs.model_token_rows`), so those tokens get no log-prob and stay out of the loss, the KL,
the entropy statistics, the high-entropy threshold and every normaliser (`totals`: the step's
model tokens).

Deliberately simple: the LR scheduler advances once per optimizer step; no sequence packing; with
num_iterations > 1 the high-entropy masks come from the policy that sampled (TRL recomputes them
each iteration from the current policy).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor

from infsamp.algorithm.importance import MismatchStats, engine_importance_weights
from infsamp.algorithm.logprobs import (
    make_micro_batch,
    micro_batch_logprobs,
    micro_batch_logprobs_and_entropy,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from infsamp.algorithm.losses import (
    LOSS_TYPES,
    BatchTotals,
    LossStats,
    high_entropy_masks,
    per_token_loss,
)
from infsamp.algorithm.rollout import Rollout, StepInputs, model_lengths
from infsamp.algorithm.shared_prompt import LAYOUTS, supports_shared_prompt
from infsamp.choices import clip_range
from infsamp.config_algorithm import TrainingConfig
from infsamp.distributed.ranks import Ranks
from infsamp.distributed.strategies import Strategy
from infsamp.errors import NonFiniteError, first_non_finite
from infsamp.planner.sizes import MIN_TRAIN_MICRO_BATCH_TOKENS, RunSizes, training_sizes
from infsamp.timing import StepTimer

DEFAULT_MICRO_BATCH_TOKENS = 8192


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


class GRPOStep:
    """`sizes`: the run's (`train_micro_batch_tokens`, halved by an out-of-memory retry and
    counted there); without them, a step of its own with `micro_batch_tokens`
    (else `training.train_micro_batch_tokens`, else 8192)."""

    def __init__(self, model, cfg: TrainingConfig, *, pad_token_id: int, temperature: float,
                 max_new_tokens: int, ref_model=None, micro_batch_tokens: int = 0,
                 importance_sampling: str = "token_truncate",
                 importance_sampling_cap: float = 3.0, parallel: Strategy | None = None,
                 sizes: RunSizes | None = None):
        self.model = model  # what the training forward runs through (a DDP/FSDP module or not)
        if parallel is None:  # one process
            parallel = Strategy(Ranks())
            parallel.wrap(model)
        self.parallel = parallel
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.ref_model = ref_model
        if sizes is None:
            tokens = (micro_batch_tokens or cfg.train_micro_batch_tokens
                      or DEFAULT_MICRO_BATCH_TOKENS)
            sizes = training_sizes(tokens, max_new_tokens)
        self.sizes = sizes
        self.epsilon_low, self.epsilon_high = clip_range(cfg.loss_type, cfg.epsilon,
                                                         cfg.epsilon_high)
        self.on_micro_batch: Callable[[int], None] | None = None  # told each micro-batch's size
        self.num_skipped_updates = 0
        # algorithm/importance.py: for vLLM's samples
        self.importance_sampling = importance_sampling
        self.importance_sampling_cap = importance_sampling_cap
        self.mismatch = MismatchStats()
        self._first_pass = True
        self.skipped_sequences = 0  # not forwarded in a training pass (zero gradient), summed
        self.forwarded_tokens = 0  # the training passes' real tokens, summed over the run
        # the prompt once per group where the model's attention takes the block mask
        self.layout = LAYOUTS[cfg.share_prompt and supports_shared_prompt(model)]

    @property
    def micro_batch_tokens(self) -> int:
        return self.sizes.train_micro_batch_tokens

    @property
    def num_oom_retries(self) -> int:
        return self.sizes.oom_retries["training"]

    # ------------------------------------------------------------------ no-grad passes

    def _logprobs(self, model, rollout: Rollout, run: Callable = sequence_logprobs):
        """A no-grad pass over the rollout in the step's layout: `run` is `sequence_logprobs` or
        `sequence_logprobs_and_entropy`."""
        return run(model, rollout.prompt_ids, rollout.completion_ids,
                   max_tokens=self.micro_batch_tokens, pad_token_id=self.pad_token_id,
                   temperature=self.temperature, chunked=self.cfg.chunked_lm_head,
                   build=self.layout.build, model_masks=rollout.model_masks)

    def reference_logprobs(self, rollout: Rollout, model) -> list[Tensor] | None:
        """The KL reference's log-probs: a separate model, or `model` with its adapters off."""
        if self.cfg.beta == 0:
            return None
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, rollout)
        with model.disable_adapter():  # LoRA: the base model is the reference
            return self._logprobs(model, rollout)

    def carries_loss(self, truncated: Sequence[bool] | None, num: int) -> list[bool]:
        """False where a sequence carries no loss (truncated, with mask_truncated_completions)."""
        truncated = truncated or [False] * num
        if len(truncated) != num:
            raise ValueError(f"Rollout.truncated: {len(truncated)} flags for {num} completions")
        return [not (self.cfg.mask_truncated_completions and cut) for cut in truncated]

    def totals_of(self, lengths: Sequence[int], truncated: Sequence[bool] | None) -> BatchTotals:
        """The loss normaliser of a step whose completions have these lengths (every rank's)."""
        keep = self.carries_loss(truncated, len(lengths))
        return BatchTotals.from_lengths([n if k else 0 for n, k in zip(lengths, keep)],
                                        self.max_new_tokens)

    def step_inputs(self, rollout: Rollout) -> StepInputs:
        """Masks, totals and the no-grad passes of one step (each pass only when needed), run
        through the strategy's whole-weights module (its forward is this rank's alone)."""
        keep = self.carries_loss(rollout.truncated, len(rollout.completion_ids))
        totals = rollout.totals or self.totals_of(model_lengths(rollout), rollout.truncated)
        old = token_masks = None
        with self.parallel.inference_model() as model:
            if self.cfg.top_entropy_quantile < 1.0:  # one pass: entropies and old log-probs
                logps, entropies = self._logprobs(model, rollout, sequence_logprobs_and_entropy)
                token_masks = high_entropy_masks(entropies, keep, self.cfg.top_entropy_quantile,
                                                 gather=self.parallel.ranks.gather_values,
                                                 model_masks=rollout.model_masks)
                old = logps if self.cfg.num_iterations > 1 else None
            elif self.cfg.num_iterations > 1:
                old = self._logprobs(model, rollout)
            ref = self.reference_logprobs(rollout, model)
        return StepInputs(torch.tensor(keep, dtype=torch.float32), totals, old, ref, token_masks)

    # ------------------------------------------------------------------ training

    def optimize(self, rollout: Rollout, optimizer, scheduler) -> dict[str, Any]:
        """num_iterations optimizer steps on one rollout; returns TRL-named metrics."""
        self.model.train()
        forwarded_before, skipped_before = self.forwarded_tokens, self.skipped_sequences
        timer = StepTimer("logprobs", "train", "optimizer")
        with timer.phase("logprobs"):
            inputs = self.step_inputs(rollout)
        metrics: dict[str, Any] = {}
        self.mismatch = MismatchStats()
        for iteration in range(self.cfg.num_iterations):
            self._first_pass = iteration == 0
            with timer.phase("train"):
                loss, stats = self._summed(*self.accumulate_gradients(rollout, inputs))
            start = time.perf_counter()  # the optimizer phase ends at zero_grad, if reached
            grad_norm = self._clip()
            metrics = {"loss": loss, "grad_norm": grad_norm, **stats.metrics()}
            checked = {"loss": loss, "gradient norm": grad_norm}
            bad = first_non_finite(checked)
            if bad is not None:
                optimizer.zero_grad(set_to_none=True)
                if self.cfg.nonfinite == "stop":
                    raise NonFiniteError(f"{bad} is {checked[bad]}")
                self.skip_update(optimizer, scheduler, num_updates=1)
                continue
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            timer.add("optimizer", time.perf_counter() - start)
        metrics.update(self._mismatch_metrics())
        metrics.update(timer.metrics())
        metrics["train/micro_batch_tokens"] = self.micro_batch_tokens
        metrics["train/forwarded_tokens"] = self.forwarded_tokens - forwarded_before
        passes = max(len(rollout.completion_ids) * self.cfg.num_iterations, 1)
        metrics["train/skipped_sequences_frac"] = (self.skipped_sequences - skipped_before) / passes
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
        values = self.parallel.ranks.sum([loss, *(getattr(stats, f.name) for f in fields(stats))])
        return values[0], LossStats(*values[1:])

    def _mismatch_metrics(self) -> dict[str, float]:
        """The engine log-prob mismatch over every rank's tokens (sums, and extremes)."""
        m, ranks = self.mismatch, self.parallel.ranks
        if ranks.distributed:
            m.num_tokens, m.abs_diff_sum, m.weight_sum = ranks.sum(
                [m.num_tokens, m.abs_diff_sum, m.weight_sum])
            m.abs_diff_max, m.weight_max, lowest = ranks.max(
                [m.abs_diff_max, m.weight_max, -m.weight_min])
            m.weight_min = -lowest
        return m.metrics()

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.cfg.max_grad_norm or float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def accumulate_gradients(self, rollout: Rollout, inputs: StepInputs,
                             indices: Sequence[int] | None = None, max_tokens: int | None = None,
                             sync_last: bool = True) -> tuple[float, LossStats]:
        """Backward over micro-batches of `indices`; returns (summed loss value, summed stats)."""
        total_loss, total_stats = 0.0, LossStats()
        device = next(self.model.parameters()).device
        whole = indices is None
        if whole:
            indices = self.carrying_gradient(rollout)
            skipped = len(rollout.completion_ids) - len(indices)
            self.skipped_sequences += skipped
            if skipped and self.on_micro_batch is not None:
                self.on_micro_batch(skipped)  # done: they carry no gradient
        plan = self.layout.plan(rollout.prompt_ids, rollout.completion_ids,
                                max_tokens or self.micro_batch_tokens, indices)
        padding = self.parallel.padding_batches(len(plan)) if whole else 0
        if whole and not plan and not padding:
            padding = 1  # every sequence skipped: zero gradients still reach the optimizer
        for k, batch in enumerate(plan):  # each micro-batch's tensors built when it is reached
            mb = self.layout.make(rollout.prompt_ids, rollout.completion_ids, batch,
                                  self.pad_token_id, device, rollout.model_masks)
            self.forwarded_tokens += mb.num_tokens
            last = k == len(plan) - 1
            sync = last and sync_last and not padding  # DDP: only the rank's last backward reduces
            try:
                with self.parallel.backward_sync(sync):
                    loss, stats = self._micro_batch_backward(mb, rollout, inputs)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not is_out_of_memory(err) or len(mb.indices) == 1 or \
                        not self.parallel.can_split_micro_batches:
                    raise
                loss, stats = self._retry_smaller(mb, rollout, inputs, sync)
            total_loss, total_stats = total_loss + loss, total_stats + stats
            if self.on_micro_batch is not None:
                self.on_micro_batch(len(mb.indices))
        for _ in range(padding):  # FSDP: as many forward/backward collectives as the other ranks
            self._padding_backward(rollout, device)
        return total_loss, total_stats

    def skips_zero_advantages(self) -> bool:
        """Whether a sequence of advantage 0 carries exactly no gradient: no KL term (beta 0), no
        high-entropy mask (it thresholds over every token), one iteration (no old log-probs
        kept), and no entropy bonus (losses.py has none)."""
        cfg = self.cfg
        return cfg.beta == 0 and cfg.top_entropy_quantile == 1.0 and cfg.num_iterations == 1

    def carrying_gradient(self, rollout: Rollout) -> list[int]:
        """The sequences the training pass forwards: all, or those of non-zero advantage where
        the others carry exactly no gradient (`skips_zero_advantages`). The loss normaliser is
        the step's totals either way, so the update is unchanged."""
        every = list(range(len(rollout.completion_ids)))
        if not self.skips_zero_advantages():
            return every
        return [i for i in every if float(rollout.advantages[i]) != 0.0]

    def _padding_backward(self, rollout: Rollout, device) -> None:
        """A zero-weight micro-batch (one sequence): its collectives run, gradients stay. A rank
        with nothing to train (dynamic sampling: every group it sampled was dropped) forwards a
        one-token stand-in."""
        one = [[self.pad_token_id]]
        prompts, completions = ((rollout.prompt_ids, rollout.completion_ids)
                                if rollout.completion_ids else (one, one))
        mb = make_micro_batch(prompts, completions, [0], self.pad_token_id, device)
        logps = micro_batch_logprobs(self.model, mb, self.temperature, self.cfg.chunked_lm_head)
        (logps.sum() * 0.0).backward()

    def _retry_smaller(self, mb, rollout: Rollout, inputs: StepInputs,
                       sync_last: bool) -> tuple[float, LossStats]:
        """Split the failed micro-batch in two (halving the token budget for the rest of the run:
        `RunSizes.halve`, which counts the retry)."""
        self.sizes.halve("training")
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        padded = mb.input_ids.numel()
        return self.accumulate_gradients(rollout, inputs, indices=mb.indices,
                                         max_tokens=max(MIN_TRAIN_MICRO_BATCH_TOKENS, padded // 2),
                                         sync_last=sync_last)

    def _micro_batch_backward(self, mb, rollout: Rollout,
                              inputs: StepInputs) -> tuple[float, LossStats]:
        logps, entropy = micro_batch_logprobs_and_entropy(
            self.model, mb, self.temperature, self.cfg.chunked_lm_head)  # [b, T_c] each
        rows = mb.rows(inputs.carries_loss).to(logps.device)  # [b]
        loss_mask = mb.completion_mask * rows.unsqueeze(1)  # [b, T_c]
        measured = MismatchStats()  # this micro-batch's; kept only once its backward succeeded
        per_token, stats = per_token_loss(
            logps, mb.gather(inputs.old), mb.gather(inputs.ref),
            mb.rows(rollout.advantages).to(logps.device), epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high, beta=self.cfg.beta, mask=loss_mask,
            loss_type=self.cfg.loss_type, token_mask=mb.gather(inputs.token_masks),
            importance_weights=self._importance_weights(mb, rollout, logps, inputs.old, measured),
            entropy=entropy)
        loss = LOSS_TYPES[self.cfg.loss_type].aggregate(per_token, loss_mask, inputs.totals)  # []
        loss.backward()
        self.mismatch.merge(measured)  # not before: an out-of-memory retry measures it again
        return loss.item(), stats

    def _importance_weights(self, mb, rollout: Rollout, logps: Tensor, old: list[Tensor] | None,
                            measured: MismatchStats) -> Tensor | None:
        """Per-token weights [b, T_c] on the policy loss: the rollout's own, times the truncated
        importance weights exp(old - engine) when another engine (vLLM) sampled the completions
        (`algorithm/importance.py`; the mismatch is measured into `measured` on the first pass);
        None when there are neither."""
        given = mb.gather(rollout.importance_weights)  # [b, T_c] or None
        if rollout.engine_logprobs is None:
            return given
        old_logps = logps.detach() if old is None else mb.gather(old)  # [b, T_c]
        engine_logps = mb.gather(rollout.engine_logprobs)  # [b, T_c]
        weights = engine_importance_weights(old_logps, engine_logps, mb.completion_mask,
                                            self.importance_sampling, self.importance_sampling_cap)
        if self._first_pass:
            measured.add(old_logps, engine_logps, mb.completion_mask, weights)
        return weights if given is None else weights * given
