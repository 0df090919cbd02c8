"""One training step: sample, score, normalise, update (`TrainStep.run`).

    TrainStep.run(logger)
      stream.next_batch                the step's prompts
      rollout
        rank_steps.share               this rank's whole groups
        sample_with_retry              sampler.sample (g halved on out of memory: RunSizes.halve)
        score                          rewards.score, as TRL calls the reward functions
        rank_steps.combine             the whole step's rewards and completions
        compute_advantages             [B*G], this rank's rows kept
      grpo.optimize                    micro-batches, backward, optimizer and schedule step
      push_weights                     the engine samples the next step from the new policy
      rank_steps.finish_metrics        the step's metrics, over every rank

With `sampling.dynamic` the rollout is `dynamic_rollout` (`run/dynamic_sampling.py`: groups
sampled until their rewards differ or reach their cap), then the same combine -> advantages
(groups of their own sizes) -> Rollout; the dropped groups are logged too, marked. `TrainStep`
receives everything it reads in its constructor and keeps no state of its own beyond them
(docs/architecture.md, "One training step").

Deliberately simple: one step samples every group of its prompts before any update.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from infsamp.algorithm.advantages import compute_advantages, compute_group_advantages
from infsamp.algorithm.grpo_step import GRPOStep, is_out_of_memory
from infsamp.algorithm.rollout import Rollout
from infsamp.config_algorithm import TrainingConfig
from infsamp.distributed.rank_step import RankSteps
from infsamp.distributed.strategies import Strategy
from infsamp.errors import NonFiniteError, RewardError
from infsamp.planner.sizes import RunSizes
from infsamp.run.dynamic_sampling import DynamicSampler
from infsamp.run.logs import NullLogger, RunLogger, completion_records
from infsamp.run.progress import RunProgress
from infsamp.run.prompt_stream import PromptStream
from infsamp.run.scoring import RunRewards
from infsamp.run.step_metrics import check_finite, rollout_metrics
from infsamp.run.tooling import RunTools
from infsamp.run.train_state import TrainState
from infsamp.sampling.engines.base import Engine
from infsamp.sampling.sampler import GroupSampler, draw_seed
from infsamp.tasks.prompts import EncodedPrompt
from infsamp.timing import StepTimer


class TrainStep:
    """One step of the run, over the parts the trainer built (see the module docstring)."""

    def __init__(self, *, state: TrainState, training: TrainingConfig, num_generations: int,
                 completions_every: int, stream: PromptStream, rank_steps: RankSteps,
                 sampler: GroupSampler, engine: Engine, strategy: Strategy,
                 generator: torch.Generator, sizes: RunSizes, rewards: RunRewards, tokenizer,
                 grpo: GRPOStep, optimizer, scheduler, num_dropped_prompts: int,
                 dynamic: DynamicSampler | None = None, tools: RunTools | None = None):
        self.state, self.training, self.G = state, training, num_generations
        self.completions_every = completions_every
        self.stream, self.rank_steps = stream, rank_steps
        self.sampler, self.engine, self.strategy = sampler, engine, strategy
        self.generator, self.sizes = generator, sizes
        self.rewards, self.tokenizer = rewards, tokenizer
        self.grpo, self.optimizer, self.scheduler = grpo, optimizer, scheduler
        self.num_dropped_prompts = num_dropped_prompts
        self.dynamic = dynamic  # sampling.dynamic: the step's rounds; None: one sampler call
        self.tools = tools  # multi-turn episodes (tools.*); None: single-turn
        self.step_timer = StepTimer()  # time/sampling, time/rewards of each step

    def run(self, logger: RunLogger | None = None) -> dict[str, Any]:
        start = time.perf_counter()
        logger = logger if logger is not None else NullLogger()  # no logs, no progress bars
        progress = logger.progress
        batch = self.stream.next_batch()
        rollout_of = self.rollout if self.dynamic is None else self.dynamic_rollout
        rollout, sample_metrics, groups, records = rollout_of(batch, progress)
        sample_metrics.update(self.step_timer.metrics())  # time/sampling, time/rewards
        logger.log_lengths(self.state.step + 1, groups)
        logger.log_completions(self.state.step + 1, records)
        try:
            check_finite(sample_metrics, rollout.advantages)
            self.engine.sleep()  # vLLM on CUDA: free its KV pool and weights while training
            num_updates = len(rollout.completion_ids) * self.training.num_iterations
            progress.phase("update", num_updates, "sequences")
            self.grpo.on_micro_batch = progress.advance
            loss_metrics = self.grpo.optimize(rollout, self.optimizer, self.scheduler)
        except NonFiniteError as err:
            loss_metrics = self.on_non_finite(err)
        self.push_weights()  # the next step samples from the updated policy
        self.state.step += 1
        learning_rate = float(self.scheduler.get_last_lr()[0])  # torchao keeps it as a tensor
        metrics = {**sample_metrics, **loss_metrics, "learning_rate": learning_rate,
                   "epoch": self.stream.epoch, "step_time": round(time.perf_counter() - start, 3)}
        return self.rank_steps.finish_metrics(metrics)

    def rollout(self, batch: list[tuple[int, EncodedPrompt]], progress: RunProgress):
        """Sample, score and normalise this rank's groups of the step (all of them in one
        process); returns (Rollout, the step's metrics, its trace lines, its completion records:
        rank 0 alone writes them)."""
        G = self.G
        share = self.rank_steps.share(batch)  # indices into batch: this rank's whole groups
        mine = [batch[i][1] for i in share]
        prompt_ids = [p.token_ids for p in mine]
        keys, texts = [str(p.index) for p in mine], [p.text for p in mine]
        progress.phase("sampling", len(mine) * G, "samples")
        turns_for = None
        if self.tools is not None:  # new episodes (environments) at every try
            def turns_for():
                return self.tools.episodes([p.example for p in mine], prompt_ids, G)
        with self.step_timer.phase("sampling"):
            result, prompt_ids = self.sample_with_retry(prompt_ids, G, keys, texts, share,
                                                        progress, turns_for)
        completions = [c for group in result.groups for c in group]  # group-major, N = b*G
        examples = [p.example for p in mine for _ in range(G)]
        progress.phase("scoring", len(completions), "completions")
        with self.step_timer.phase("rewards"):
            rewards = self.score(examples, [c.text for c in completions],
                                 [c.token_ids for c in completions])
        progress.advance(len(completions))
        step = self.rank_steps.combine(batch, share, result.groups, rewards,
                                       result.stats.to_metrics())  # the whole step's values
        adv = compute_advantages(torch.tensor(step.rewards.total, dtype=torch.float32), G,
                                 self.training.scale_rewards)
        advantages = adv.advantages[step.local_rows]  # [b*G]: this rank's rows
        rollout = self.make_rollout(prompt_ids, [G] * len(prompt_ids), completions, advantages,
                                    step)
        metrics = self.sample_metrics(step.rewards, adv, step.completions, step.sampler_metrics)
        if self.tools is not None:
            metrics.update(self.tools.metrics(completions))
        records = []
        if self.logs_completions:
            records = self.rank_steps.gather_records(share, completion_records(
                keys, texts, completions, rewards.per_function, rewards.total, advantages))
        return rollout, metrics, step.groups, records

    @property
    def logs_completions(self) -> bool:
        """This step's completions go to completions.jsonl (`logging.completions_every`)."""
        return bool(self.completions_every) and (self.state.step + 1) % self.completions_every == 0

    def on_non_finite(self, err: NonFiniteError) -> dict[str, Any]:
        """training.nonfinite: stop with one line naming step and quantity, or skip the update."""
        where = f"step {self.state.step + 1}: {err}"
        if self.training.nonfinite == "stop":
            raise NonFiniteError(f"{where}; stopped before applying it (checkpoints untouched; "
                                 "training.nonfinite skip skips such updates instead)") from None
        self.grpo.skip_update(self.optimizer, self.scheduler)
        print(f"{where}: update skipped ({self.grpo.num_skipped_updates} so far)", file=sys.stderr)
        return {"train/skipped_updates": self.grpo.num_skipped_updates}

    def dynamic_rollout(self, batch: list[tuple[int, EncodedPrompt]], progress: RunProgress):
        """`rollout` with dynamic sampling: the step's rounds (each rank samples its own groups,
        every rank takes the same decisions), then the groups with spread, each of its own size,
        normalised over the whole step and laid out as `rollout`'s."""
        found = self.dynamic.run(batch, self.stream, *self.chunk_calls(progress),
                                 len(self.stream.examples), self.rank_steps)
        trained, rank = found.trained, self.rank_steps.rank
        share = [k for k, g in enumerate(trained) if g.owner == rank]  # indices into trained
        mine = [trained[k] for k in share]
        groups = [g.completions for g in mine]
        step = self.rank_steps.combine([(g.index, g.prompt) for g in trained], share, groups,
                                       found.rewards(mine, self.rewards.names),
                                       found.sampler_metrics())  # the whole step's values
        adv = compute_group_advantages(torch.tensor(step.rewards.total, dtype=torch.float32),
                                       [g.size for g in trained], self.training.scale_rewards)
        advantages = adv.advantages[step.local_rows]  # [n]: this rank's rows
        completions = [c for group in groups for c in group]
        rollout = self.make_rollout([g.prompt.token_ids for g in mine], [g.size for g in mine],
                                    completions, advantages, step)
        metrics = self.sample_metrics(step.rewards, adv, step.completions,
                                      {**step.sampler_metrics, **found.metrics()})
        records = []
        if self.logs_completions:
            records = self.dynamic_records(found, dict(zip(
                [g.position for g in mine], advantages.split([g.size for g in mine]))))
        return rollout, metrics, self.dynamic_lines(found, step.groups), records

    def chunk_calls(self, progress: RunProgress):
        """Dynamic sampling's (sample, score) for this step: every chunk draws from one seed
        (keys: place in the step x the cap + index in the group). With a gate (decisions inside
        the call) scoring runs inside sampling: its time counts to time/rewards only."""
        seed, stride = draw_seed(self.generator), self.dynamic.rules.cap
        inside = False  # a gated call is running (its scoring draws no bar)

        def sample(prompts, counts, first_index, positions, gate=None):
            nonlocal inside
            progress.phase("sampling", len(prompts) * self.dynamic.rules.G if gate else
                           sum(counts), "samples")
            rewards_before, start = self.step_timer.seconds.get("rewards", 0.0), time.perf_counter()
            inside = gate is not None
            try:
                return self.sample_with_retry(
                    [p.token_ids for p in prompts], counts, [str(p.index) for p in prompts],
                    [p.text for p in prompts], positions, progress, first_index=first_index,
                    seed=seed, key_stride=stride, gate=gate)[0]
            finally:
                inside = False
                scored = self.step_timer.seconds.get("rewards", 0.0) - rewards_before
                self.step_timer.add("sampling", time.perf_counter() - start - scored)

        def score(examples, texts, ids):
            if not inside:
                progress.phase("scoring", len(texts), "completions")
            with self.step_timer.phase("rewards"):
                rewards = self.score(examples, texts, ids)
            if not inside:
                progress.advance(len(texts))
            return rewards

        return sample, score

    def dynamic_lines(self, found, trained_lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """lengths.jsonl: every group the step sampled, in step order, the dropped ones marked
        `"dropped": true` (their lines gathered apart: one more gather when there are any)."""
        trained = found.trained
        kept = {g.position for g in trained}
        left_out = [g for g in found.dropped if g.position not in kept]
        lines = list(zip(trained, trained_lines))
        if left_out:
            rank = self.rank_steps.rank
            share = [k for k, g in enumerate(left_out) if g.owner == rank]
            lines += zip(left_out, self.rank_steps.lines(
                [(g.index, g.prompt) for g in left_out], share,
                [left_out[k].completions for k in share]))
        return [{**line, "dropped": True} if g.status == "dropped" else line
                for g, line in sorted(lines, key=lambda pair: pair[0].position)]

    def dynamic_records(self, found, advantages: dict[int, torch.Tensor]) -> list[dict[str, Any]]:
        """completions.jsonl: this rank's groups (trained: their `advantages` by position;
        dropped: marked, advantage 0), gathered in step order."""
        rank = self.rank_steps.rank
        mine = [g for g in found.groups if g.owner == rank
                and (g.position in advantages or g.status == "dropped")]
        records = []
        for g in mine:
            rows = completion_records([str(g.prompt.index)], [g.prompt.text], g.completions,
                                      g.per_function, g.total,
                                      advantages.get(g.position, torch.zeros(g.size)))
            records += [{**r, "dropped": True} for r in rows] if g.status == "dropped" else rows
        return self.rank_steps.gather_records([g.position for g in mine], records,
                                              [g.size for g in mine])

    def make_rollout(self, prompt_ids: list[list[int]], sizes: list[int],
                     completions: list, advantages: torch.Tensor, step) -> Rollout:
        """This rank's completions (group-major, `sizes[i]` of prompt i) as the GRPO step's
        input; the loss normaliser counts the whole step's (`step.completions`)."""
        engine_logprobs = ([torch.tensor(c.logprobs, dtype=torch.float32) for c in completions]
                           if all(c.logprobs is not None for c in completions) else None)
        model_masks = ([torch.tensor(c.model_mask(), dtype=torch.float32) for c in completions]
                       if any(c.context_spans for c in completions) else None)  # tool answers
        return Rollout(prompt_ids=[p for p, n in zip(prompt_ids, sizes) for _ in range(n)],
                       completion_ids=[c.token_ids for c in completions],
                       advantages=advantages,
                       truncated=[c.finish_reason == "length" for c in completions],
                       engine_logprobs=engine_logprobs,
                       totals=self.grpo.totals_of(  # the whole step's loss normaliser
                           [c.num_model_tokens for c in step.completions],
                           [c.finish_reason == "length" for c in step.completions]),
                       model_masks=model_masks)

    def sample_with_retry(self, prompt_ids, G, keys: list[str], texts: list[str],
                           share: list[int], progress: RunProgress, turns_for=None, **chunks):
        """On out-of-memory, halve g (`RunSizes.halve`; `full` becomes `continuous`) and sample
        the step again. `turns_for()`: each try's prompts and turn handler (tools); `chunks`:
        dynamic sampling's `first_index`, `seed`, `key_stride`. Returns the result and the
        prompts sampled from."""
        while True:
            state = self.generator.get_state()
            ids, turns = turns_for() if turns_for is not None else (prompt_ids, None)
            try:
                with self.strategy.inference_model():  # FSDP: whole weights while sampling
                    return self.sampler.sample(ids, G, prompt_keys=keys, prompt_texts=texts,
                                               generator=self.generator, global_group_ids=share,
                                               progress=progress.sampling, turns=turns,
                                               **chunks), ids
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not is_out_of_memory(err) or self.sizes.micro_group <= 1:
                    raise
                self.generator.set_state(state)
                g = self.sizes.halve("sampling")
                print(f"out of memory while sampling: retrying with micro_group={g}")

    def score(self, examples: list[dict[str, Any]], texts: list[str],
               completion_ids: list[list[int]], training: bool = True):
        """Every reward function on these completions (one per example), as TRL calls them."""
        try:
            return self.rewards.score(self.tokenizer, examples, texts, completion_ids)
        except RewardError as err:  # nothing of this step is applied
            when = (f"step {self.state.step + 1}: {err}; the step was not applied" if training else
                    f"evaluation at step {self.state.step}: {err}")
            raise RewardError(f"{when} (the checkpoints are as they were)") from None

    def sample_metrics(self, rewards, adv, completions,
                        sampler_metrics: dict[str, Any]) -> dict[str, Any]:
        return {**rollout_metrics(rewards, adv, completions), **sampler_metrics,
                "sampling/oom_retries": self.sizes.oom_retries["sampling"],
                "data/dropped_prompts": self.num_dropped_prompts}

    def push_weights(self) -> None:
        """The engine takes the current weights: the slot engine decodes with the strategy's
        sampling model; an engine with its own copy (vLLM) gets the whole weights pushed (FSDP:
        gathered from the shards, a collective every rank enters)."""
        if not self.engine.copies_weights:
            self.engine.load_weights(self.strategy.sampling_model())
            return
        with self.strategy.inference_model() as model:
            self.engine.load_weights(model)
