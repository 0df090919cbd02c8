"""The GRPO trainer: sample G completions per prompt, score them, update the policy.

One step, laid out in time:

    prompts (B) --sampler--> B groups x G completions (memory bounded by the KV budget, not by G)
                --rewards--> rewards [B*G] --advantages--> group-normalised advantages [B*G]
                --grpo_step--> token-budget micro-batches: log-probs -> surrogate (+KL) -> backward
                --optimizer--> one update per iteration (num_iterations >= 1, old log-probs kept)

Everything configurable comes from `infsamp.config.Config`; loss types, advantage scaling and
sampling policies are registries in their own modules. The trainer only wires them together, logs,
evaluates and checkpoints (one step's work: `TrainStep` in `train_step.py`, built once with the
parts it reads). Start-up is `__init__`, one named step a line, the run folder and the data
checked before the weights load; the resumable state (`run/train_state.py`) is what the one save
path (`run/rank_checkpoint.py`, several ranks or one) writes and a resume reads. While it runs,
SIGTERM/SIGINT end the step and save (`signals.py`), and a non-finite loss, gradient norm or
reward stops the run before it is applied (or skips it: `training.nonfinite`).

Several processes (torchrun / accelerate launch): `distributed/strategies.py` wraps the model (DDP
or FSDP2), `distributed/rank_step.py` divides each step's prompts between the ranks and gathers what
the step's statistics need. Rank 0 alone decides the run folder and writes the logs and plots.

Deliberately simple: the reward functions run in each rank's own process, on its own groups.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infsamp.algorithm.grpo_step import GRPOStep
from infsamp.algorithm.optim import build_optimizer, build_scheduler, schedule_horizon
from infsamp.config import Config
from infsamp.config_io import save_config
from infsamp.distributed.rank_step import RankSteps
from infsamp.distributed.ranks import Ranks, init_ranks, reshard_after_forward
from infsamp.distributed.strategies import make_strategy
from infsamp.errors import RunFolderError, RunStopped
from infsamp.models.loading import (
    load_model_and_tokenizer,
    load_tokenizer,
    quiet_transformers,
    require_stop_tokens,
)
from infsamp.run import checkpoint as ckpt
from infsamp.run import ownership
from infsamp.run.checkpoint import Checkpoint
from infsamp.run.dynamic_sampling import DynamicSampler, plan_note
from infsamp.run.evaluation import (
    BestEvaluation,
    check_best_metric,
    eval_metrics,
    eval_reward_name,
    held_out_completions,
    tally,
)
from infsamp.run.folder import rewind_run_logs
from infsamp.run.identity import check_data, data_fingerprint
from infsamp.run.logs import NullLogger, RunLogger, problem_records
from infsamp.run.prompt_stream import PromptStream
from infsamp.run.rank_checkpoint import prepare_run_folder_on_ranks, save_checkpoint
from infsamp.run.scoring import RunRewards
from infsamp.run.setup import (
    check_environment,
    length_predictor,
    load_prompts,
    reference_model,
    seed_everything,
    set_num_threads,
    warn_about_settings,
)
from infsamp.run.signals import StopSignals
from infsamp.run.tooling import RunTools
from infsamp.run.train_state import TrainState
from infsamp.run.train_step import TrainStep
from infsamp.sampling.engines.base import make_engine
from infsamp.sampling.sampler import GroupSampler
from infsamp.sampling.sizes import check_fits_before_loading, plan_run


@dataclass
class TrainResult:
    output_dir: Path
    final_step: int
    eval_before: float | None
    eval_after: float | None
    eval_reward: str = ""  # the reward function eval/accuracy counts with (eval.reward)


class GRPOTrainer:
    """`GRPOTrainer(cfg).train()`; pass `reward_funcs` to use Python callables instead of names,
    `tools` (callables or references) and `environment_factory` instead of `tools.*`."""

    @ownership.released_on_failure
    def __init__(self, cfg: Config, reward_funcs: list[tuple[str, Callable]] | None = None,
                 step_callback: Callable[[int, dict[str, Any]], None] | None = None,
                 ranks: Ranks | None = None, tools: list[str | Callable] | None = None,
                 environment_factory: str | Callable | None = None):
        self.cfg = cfg.validate()
        self.ranks = ranks or init_ranks(cfg)  # one process, or this rank of a launch
        self.device = self.ranks.device(cfg.model.device)
        self.precision = check_environment(cfg, self.device)  # before anything loads or is written
        self.output_dir = Path(cfg.logging.output_dir)
        self.step_callback = step_callback
        self._load_rewards(reward_funcs, tools, environment_factory)
        found = prepare_run_folder_on_ranks(cfg, self.ranks)  # before anything loads
        warn_about_settings(cfg)
        seed_everything(cfg.training.seed)
        self._load_data(found)
        check_fits_before_loading(cfg, self.device, self.ranks.world_size, self.ranks.strategy,
                                  max(len(p.token_ids) for p in self.train_prompts.prompts))
        self._load_model()
        planned = plan_run(cfg, self.model, self.device, self.ranks.world_size, self.ranks.strategy)
        self.sizes = planned.sizes  # decided once; read by the engine, the sampler, the GRPO step
        self.ref_model = reference_model(cfg, self.model)  # before FSDP shards the model
        self._build_sampler()
        self.sampler.check_budget([p.token_ids for p in self.train_prompts.prompts])  # refused now
        self._build_update()
        self.train_state = self._build_state(found)
        self.steps = self._build_step()  # one training step: `TrainStep.run`
        self._resume(found)
        self._write_config()
        print(planned.note + plan_note(cfg.sampling, cfg.training))

    # ------------------------------------------------------------------ start-up steps

    def _load_rewards(self, reward_funcs: list[tuple[str, Callable]] | None, tools=None,
                      environment_factory=None) -> None:
        """The tools and the reward functions (an environment's reward among them), checked
        before anything loads, and the held-out evaluation's reward and best-checkpoint
        metric."""
        self.tools = RunTools(self.cfg, tools, environment_factory)
        self.rewards = RunRewards(self.cfg, reward_funcs, self.tools.reward_functions())
        self.eval_reward = eval_reward_name(self.cfg.eval.reward, self.rewards.names)
        check_best_metric(self.cfg.checkpointing.keep_best, self.rewards.names)
        self.best = BestEvaluation(self.cfg.checkpointing.keep_best)

    def _load_data(self, found: Checkpoint | None) -> None:
        """The tokenizer and the prompts (rank 0 fills the datasets cache first), checked against
        the resumed checkpoint's rows before the weights load."""
        quiet_transformers()
        self.tokenizer = load_tokenizer(self.cfg.model.name_or_path,
                                        self.cfg.model.trust_remote_code)
        with self.ranks.main_first():
            self.train_prompts, self.eval_prompts = load_prompts(self.cfg, self.tokenizer,
                                                                 self.tools.schemas)
        self.data_fingerprint = data_fingerprint(self.train_prompts, self.eval_prompts)
        check_data(found, self.cfg, self.data_fingerprint)

    def _load_model(self) -> None:
        cfg = self.cfg
        self.model, _ = load_model_and_tokenizer(cfg.model, self.device, tokenizer=self.tokenizer,
                                                 precision=self.precision)
        self.stop_token_ids = require_stop_tokens(self.model, self.tokenizer,
                                                  cfg.model.name_or_path)
        if self.tools.enabled:
            self.tools.start(self.tokenizer, self.stop_token_ids)
        set_num_threads(cfg.training.num_threads, self.model, self.device)
        self.stream = PromptStream(self.train_prompts.prompts, cfg.training.prompts_per_step,
                                   cfg.training.seed)

    def _build_sampler(self) -> None:
        """The strategy (the model wrapped or sharded in place), the engine it samples with and
        the sampler that schedules the engine."""
        cfg = self.cfg
        self.strategy = make_strategy(self.ranks, reshard_after_forward(cfg))
        self.train_model = self.strategy.wrap(self.model)  # DDP wrapper, or the model sharded
        with self.strategy.inference_model() as model:  # FSDP: whole weights to start from
            self.engine = make_engine(cfg.sampling.engine, model, cfg.sampling, self.sizes)  # kept
        self.sampler = GroupSampler(self.strategy.sampling_model(), self.tokenizer, cfg.sampling,
                                    predictor=length_predictor(cfg), engine=self.engine,
                                    sizes=self.sizes)
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.training.seed)

    def _build_update(self) -> None:
        """The GRPO step, the division of each step between the ranks and the optimizer."""
        cfg = self.cfg
        self.grpo = GRPOStep(self.train_model, cfg.training,
                             pad_token_id=self.tokenizer.pad_token_id,
                             temperature=cfg.sampling.temperature or 1.0, ref_model=self.ref_model,
                             max_new_tokens=cfg.sampling.max_new_tokens, sizes=self.sizes,
                             importance_sampling=cfg.sampling.vllm_importance_sampling,
                             importance_sampling_cap=cfg.sampling.vllm_importance_sampling_cap,
                             parallel=self.strategy)
        self.rank_steps = RankSteps(self.ranks, cfg.sampling.num_generations,
                                    cfg.sampling.max_new_tokens, cfg.distributed.assignment,
                                    cfg.sampling.predictor_prefix_tokens)
        self.optimizer = build_optimizer(self.model, cfg.training, self.precision)

    def _build_state(self, found: Checkpoint | None) -> TrainState:
        """The learning-rate schedule (a resumed run keeps the length it started with) and the
        one object that holds everything a checkpoint saves."""
        horizon = found.state["schedule"] if found else schedule_horizon(self.cfg.training)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.training, horizon)
        return TrainState(
            cfg=self.cfg, data_fingerprint=self.data_fingerprint, horizon=horizon,
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            generator=self.generator, stream=self.stream, best=self.best, sizes=self.sizes,
            grpo=self.grpo, predictor=self.sampler.predictor, rank_steps=self.rank_steps,
            rank=self.ranks.rank, world_size=self.ranks.world_size)

    def _build_step(self) -> TrainStep:
        """The step object: every part one step reads, handed over by name."""
        cfg = self.cfg
        return TrainStep(
            state=self.train_state, training=cfg.training,
            num_generations=cfg.sampling.num_generations,
            completions_every=cfg.logging.completions_every, stream=self.stream,
            rank_steps=self.rank_steps, sampler=self.sampler, engine=self.engine,
            strategy=self.strategy, generator=self.generator, sizes=self.sizes,
            rewards=self.rewards, tokenizer=self.tokenizer, grpo=self.grpo,
            optimizer=self.optimizer, scheduler=self.scheduler,
            num_dropped_prompts=self.train_prompts.num_dropped,
            dynamic=DynamicSampler(cfg.sampling, cfg.training) if cfg.sampling.dynamic else None,
            tools=self.tools if self.tools.enabled else None)

    def _resume(self, found: Checkpoint | None) -> None:
        """Restore the checkpoint found at start-up (its tensors are copied in; not kept)."""
        self.resumed = found is not None
        if found is not None:
            if self.ranks.is_main:
                rewind_run_logs(self.output_dir, found.step)  # this run's rows after it go
            self.train_state.load_state_dict(found)
            self.steps.push_weights()  # the engine samples from the restored policy

    def _write_config(self) -> None:
        try:
            if self.ranks.is_main:
                save_config(self.cfg, self.output_dir / "config.yaml")
        except OSError as err:
            raise RunFolderError(f"cannot write {self.output_dir / 'config.yaml'}: "
                                 f"{err.strerror or err}") from None

    @property
    def step(self) -> int:
        """The optimizer steps taken (the run's state holds it)."""
        return self.train_state.step

    def train_step(self, logger: RunLogger | None = None) -> dict[str, Any]:
        """One step: `TrainStep.run` (run/train_step.py)."""
        return self.steps.run(logger)

    # ------------------------------------------------------------------ loop

    def train(self) -> TrainResult:
        cfg = self.cfg
        if self.resumed and self.step >= cfg.training.max_steps and self._closed():
            print(f"the run finished at step {self.step} (training.max_steps "
                  f"{cfg.training.max_steps}): nothing to do")
            self.ranks.finish()
            self.close()
            eval_after = self.train_state.last_eval if self._evaluated_at(self.step) else None
            return TrainResult(self.output_dir, self.step, self.train_state.eval_before,
                               eval_after, self.eval_reward)
        logger = RunLogger(self.output_dir, cfg.training.max_steps, self.step,
                           cfg.logging.log_every,
                           cfg.logging.progress_bar) if self.ranks.is_main else NullLogger()
        ok = False
        try:
            log = cfg.logging
            logger.open_trackers(log.report_to, log.project, log.run_name, cfg.to_dict())
            with StopSignals() as stop:
                if self.step == 0 and cfg.eval.on_start and not self._evaluated_at(0):
                    self.train_state.eval_before = self._evaluate(logger)
                while self.step < cfg.training.max_steps:
                    self._stop_if_asked(stop)
                    metrics = self.train_step(logger)
                    logger.log_step(self.step, metrics)
                    self._after_step(logger, metrics)
                done = self._evaluated_at(self.step)
                eval_after = self.train_state.last_eval if done else self._evaluate(logger)
                self._save()
                self._stop_if_asked(stop)
            if cfg.logging.plot:
                logger.log_plot(self.step)  # rank 0's logger; a no-op on the others
            self.ranks.finish()
            ok = True
        finally:
            logger.close(ok)
            self.close()
        return TrainResult(self.output_dir, self.step, self.train_state.eval_before, eval_after,
                           self.eval_reward)

    def _stop_if_asked(self, stop: StopSignals) -> None:
        """After a signal: save (checkpointing.save_on_signal) and stop, exit code 128 + signal.
        Several ranks stop together when any of them received one."""
        received = int(self.ranks.max([stop.received or 0])[0])
        if not received:
            return
        stop.received = stop.received or received
        if self.cfg.checkpointing.save_on_signal:
            what = f"saved {self._save().name} in {self.output_dir} (continue with --resume)"
        else:
            newest = ckpt.list_checkpoints(self.output_dir)
            what = "nothing saved (checkpointing.save_on_signal false; newest checkpoint: " \
                   f"{newest[-1].name if newest else 'none'})"
        done = "the run is complete" if self.step >= self.cfg.training.max_steps else \
            f"after step {self.step}"
        raise RunStopped(f"stopped by {stop.name} {done}: {what}", 128 + stop.received)

    def _after_step(self, logger: RunLogger, metrics: dict[str, Any]) -> None:
        every, last = self.cfg.eval.every_steps, self.cfg.training.max_steps
        new_best = False
        if every and self.step % every == 0 and self.step < last:
            self._evaluate(logger)
            new_best = self.best.step == self.step  # checkpointing.keep_best: keep it
        save_every = self.cfg.checkpointing.save_every
        if new_best or (save_every and self.step % save_every == 0 and self.step < last):
            self._save()
        if self.step_callback:
            self.step_callback(self.step, metrics)

    def _evaluated_at(self, step: int) -> bool:
        return self.train_state.last_eval_step == step

    def _closed(self) -> bool:
        """The closing evaluation is done (or there is none): a resumed run past its last step
        that lacks it (resumed from a periodic checkpoint with max_steps lowered to its step)
        runs it and saves it, then stops."""
        return self._evaluated_at(self.step) or not self.eval_prompts.prompts

    def _evaluate(self, logger: RunLogger) -> float | None:
        prompts = self.eval_prompts.prompts
        if not prompts:
            return None
        start = time.perf_counter()
        logger.progress.phase("evaluating", len(prompts), "problems")
        cfg = self.cfg.eval
        mine = prompts[self.ranks.rank::self.ranks.world_size]  # each rank a share, then summed
        prompt_ids, turns = [p.token_ids for p in mine], None
        if self.tools.enabled and mine:
            prompt_ids, turns = self.tools.episodes([p.example for p in mine], prompt_ids, 1)
        with self.strategy.inference_model() as model:
            ids, texts = held_out_completions(
                model, self.tokenizer, prompt_ids,
                stop_token_ids=self.stop_token_ids, temperature=cfg.temperature,
                max_new_tokens=cfg.max_new_tokens or self.cfg.sampling.max_new_tokens,
                sampler=self.sampler, turns=turns)
        tool_metrics = self.tools.eval_metrics(len(mine)) if self.tools.enabled else {}
        scores = (self.steps.score([p.example for p in mine], texts, ids, training=False)
                  if mine else None)
        sums = self.ranks.sum(tally(scores, self.rewards.names, self.eval_reward,
                                    cfg.accuracy_threshold))
        metrics = eval_metrics(sums, self.rewards.names, self.eval_reward)
        if cfg.log_completions:  # every rank's rows, written by rank 0's logger
            rows = problem_records(mine, texts, ids, scores, self.eval_reward,
                                   cfg.accuracy_threshold) if mine else []
            rows = [row for part in self.ranks.gather_json(rows) for row in part]
            logger.log_completions(self.step, rows, "eval_completions.jsonl")
        logger.progress.advance(len(prompts))
        logger.log_eval(self.step, {**metrics, **tool_metrics, "eval/num_problems": len(prompts),
                                    "eval/dropped_prompts": self.eval_prompts.num_dropped,
                                    "time/eval": round(time.perf_counter() - start, 2)})
        self.best.offer(self.step, metrics)
        state = self.train_state
        state.last_eval, state.last_eval_step = metrics["eval/accuracy"], self.step
        state.saved_step = -1  # the state changed since its checkpoint: the next save writes it
        return state.last_eval

    def _save(self) -> Path:
        """checkpoint-<step>, once per step: `rank_checkpoint.save_checkpoint`."""
        return save_checkpoint(self.train_state, self.ranks, self.strategy, self.tokenizer)

    def close(self) -> None:
        """Free the sampling engine (vLLM's pool and weights), the reward workers and the run
        folder; no sampling afterwards."""
        self.engine.close()
        self.rewards.close()
        self.tools.close()
        ownership.release_run_folder(self.output_dir)
