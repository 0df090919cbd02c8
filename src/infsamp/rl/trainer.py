"""The GRPO trainer: sample G completions per prompt, score them, update the policy.

One step, laid out in time:

    prompts (B) --sampler--> B groups x G completions (memory bounded by the KV budget, not by G)
                --rewards--> rewards [B*G] --advantages--> group-normalised advantages [B*G]
                --grpo_step--> token-budget micro-batches: log-probs -> clipped surrogate (+KL) -> backward
                --optimizer--> one update per iteration (num_iterations >= 1, old log-probs kept)

Everything configurable comes from `infsamp.config.Config`; loss types, advantage scaling and
sampling policies are registries in their own modules. The trainer only wires them together, logs,
evaluates and checkpoints.

Deliberately simple: one process, one device; the reward functions run in the trainer's process.
"""

from __future__ import annotations

import random
import time
from copy import deepcopy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from infsamp.config import Config, save_config
from infsamp.errors import InfsampError
from infsamp.models.loading import load_model_and_tokenizer, resolve_device
from infsamp.rewards import compute_rewards, load_reward_functions
from infsamp.rl import checkpoint as ckpt
from infsamp.rl.advantages import compute_advantages
from infsamp.rl.evaluation import evaluate_accuracy
from infsamp.rl.memory import plan_run
from infsamp.rl.grpo_step import GRPOStep, Rollout, is_out_of_memory
from infsamp.rl.optim import build_optimizer, build_scheduler
from infsamp.rl.prompt_stream import PromptStream
from infsamp.rl.run_log import RunLogger, plot_run
from infsamp.sampling.engines.base import make_engine
from infsamp.sampling.length_predictor import make_predictor
from infsamp.sampling.sampler import GroupSampler, engine_limits
from infsamp.tasks.loading import (completion_for_rewards, load_examples, prompt_for_rewards, render_prompt,
                                    uses_chat_template)


@dataclass
class TrainResult:
    output_dir: Path
    final_step: int
    eval_before: float | None
    eval_after: float | None


def quiet_transformers() -> None:
    """No per-save progress bars or advisory warnings between our own log lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


SMALL_MODEL_PARAMETERS = 50_000_000


def set_num_threads(num_threads: int, model, device: torch.device) -> None:
    """0 = auto: one thread for a small model on CPU (its ops are too small to split; measured faster)."""
    if num_threads == 0 and device.type == "cpu":
        small = sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMETERS
        num_threads = 1 if small else 0
    if num_threads:
        torch.set_num_threads(num_threads)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class GRPOTrainer:
    """`GRPOTrainer(cfg).train()`; pass `reward_funcs` to use Python callables instead of names."""

    def __init__(self, cfg: Config, reward_funcs: list[tuple[str, Callable]] | None = None,
                 step_callback: Callable[[int, dict[str, Any]], None] | None = None):
        self.cfg = cfg
        self.output_dir = Path(cfg.logging.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        seed_everything(cfg.training.seed)
        quiet_transformers()
        self.device = resolve_device(cfg.model.device)
        self.model, self.tokenizer = load_model_and_tokenizer(cfg.model, self.device)
        set_num_threads(cfg.training.num_threads, self.model, self.device)
        self.reward_funcs = reward_funcs or load_reward_functions(cfg.rewards.functions)
        self.reward_weights = cfg.rewards.weights or [1.0] * len(self.reward_funcs)
        self.train_examples = load_examples(cfg.data, cfg.data.train_split)
        self.eval_examples = load_examples(cfg.data, cfg.data.eval_split)[: cfg.eval.num_problems] \
            if cfg.eval.num_problems else []
        self.stream = PromptStream(self.train_examples, cfg.training.prompts_per_step, cfg.training.seed)
        self.sizes = plan_run(cfg, self.model, self.device)
        sampling_cfg = replace(cfg.sampling, kv_budget=str(self.sizes.kv_budget_tokens)) \
            if self.sizes.kv_budget_tokens else replace(cfg.sampling)
        limits = engine_limits(sampling_cfg, self.model, cfg.data.max_prompt_length,
                               cfg.training.prompts_per_step)
        self.engine = make_engine(cfg.sampling.engine, self.model, sampling_cfg, limits)  # kept
        self.sampler = GroupSampler(self.model, self.tokenizer, sampling_cfg,
                                    predictor=self._length_predictor(), engine=self.engine)
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.training.seed)
        self.ref_model = self._reference_model()
        self.grpo = GRPOStep(self.model, cfg.training, pad_token_id=self.tokenizer.pad_token_id,
                             temperature=cfg.sampling.temperature or 1.0, ref_model=self.ref_model,
                             max_completion_length=cfg.sampling.max_new_tokens,
                             micro_batch_tokens=self.sizes.train_micro_batch_tokens,
                             importance_sampling=cfg.sampling.vllm_importance_sampling,
                             importance_sampling_cap=cfg.sampling.vllm_importance_sampling_cap)
        self.optimizer = build_optimizer(self.model, cfg.training)
        self.scheduler = build_scheduler(self.optimizer, cfg.training)
        self.step_callback = step_callback
        self.num_sampling_oom_retries = 0
        self.step = 0
        self.eval_before: float | None = None
        self._resume()
        save_config(cfg, self.output_dir / "config.yaml")
        print(self.sizes.note)

    # ------------------------------------------------------------------ setup

    def _length_predictor(self):
        """The length_aware policy's predictor, kept for the whole run so it learns across epochs."""
        if self.cfg.sampling.policy != "length_aware":
            return None
        if self.cfg.sampling.predictor not in ("online", "none"):
            raise InfsampError(f"sampling.predictor {self.cfg.sampling.predictor!r}: training needs online or "
                               "none (oracle and noisy know the true lengths: bench and simulate only)")
        return make_predictor(self.cfg.sampling.predictor)

    def _reference_model(self):
        """None with beta 0; with LoRA the base with adapters disabled; else a frozen copy."""
        if self.cfg.training.beta == 0 or self.cfg.model.lora_rank > 0:
            return None
        ref = deepcopy(self.model).eval()
        ref.requires_grad_(False)
        return ref

    def _resume(self) -> None:
        path = ckpt.resolve_resume(self.cfg.checkpointing.resume, self.output_dir)
        if path is None:
            return
        state, blob = ckpt.load_training_state(path)
        self._load_weights(path / "model")
        self.engine.load_weights(self.model)
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
        ckpt.set_rng_state(blob["rng"])
        self.generator.set_state(blob["generator"])
        self.stream.load_state_dict(state["data"])
        self.step, self.eval_before = state["step"], state.get("eval_before")
        if blob.get("predictor") is not None:
            self.sampler.predictor = blob["predictor"]
        print(f"resumed from {path} at step {self.step}")

    def _load_weights(self, model_dir: Path) -> None:
        from safetensors.torch import load_file

        if self.cfg.model.lora_rank > 0:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_file(str(model_dir / "adapter_model.safetensors")))
        else:
            state = load_file(str(model_dir / "model.safetensors"))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or any("lm_head" not in m for m in missing):
                raise InfsampError(f"checkpoint {model_dir}: weights do not match the model")
            self.model.tie_weights()

    # ------------------------------------------------------------------ loop

    def train(self) -> TrainResult:
        cfg = self.cfg
        logger = RunLogger(self.output_dir, cfg.training.max_steps, self.step, cfg.logging.log_every,
                           cfg.logging.progress_bar)
        try:
            if self.step == 0:
                self.eval_before = self._evaluate(logger)
            while self.step < cfg.training.max_steps:
                metrics = self.train_step(logger)
                logger.log_step(self.step, metrics)
                self._after_step(logger, metrics)
            eval_after = self._evaluate(logger) if not self._evaluated_at(self.step) else self._last_eval
            self._save()
        finally:
            logger.close()
            self.close()
        if cfg.logging.plot:
            plot_run(self.output_dir)
        return TrainResult(self.output_dir, self.step, self.eval_before, eval_after)

    def _after_step(self, logger: RunLogger, metrics: dict[str, Any]) -> None:
        every = self.cfg.eval.every_steps
        if every and self.step % every == 0 and self.step < self.cfg.training.max_steps:
            self._evaluate(logger)
        save_every = self.cfg.checkpointing.save_every
        if save_every and self.step % save_every == 0 and self.step < self.cfg.training.max_steps:
            self._save()
        if self.step_callback:
            self.step_callback(self.step, metrics)

    _last_eval: float | None = None
    _last_eval_step: int = -1

    def _evaluated_at(self, step: int) -> bool:
        return self._last_eval_step == step

    def _evaluate(self, logger: RunLogger) -> float | None:
        if not self.eval_examples:
            return None
        start = time.perf_counter()
        max_new = self.cfg.eval.max_new_tokens or self.cfg.sampling.max_new_tokens
        accuracy = evaluate_accuracy(self.model, self.tokenizer, self._eval_problems(), max_new_tokens=max_new,
                                     temperature=self.cfg.eval.temperature)
        logger.log_eval(self.step, {"eval/accuracy": accuracy, "eval/num_problems": len(self.eval_examples),
                                    "eval/time_s": round(time.perf_counter() - start, 2)})
        self._last_eval, self._last_eval_step = accuracy, self.step
        return accuracy

    def _eval_problems(self) -> list[dict[str, Any]]:
        return [{"prompt": render_prompt(ex, self.tokenizer, self.cfg.data), "answer": ex["answer"]}
                for ex in self.eval_examples]

    def _save(self) -> None:
        ckpt.save_checkpoint(
            self.output_dir, self.step, model=self.model, tokenizer=self.tokenizer, optimizer=self.optimizer,
            scheduler=self.scheduler, keep_last=self.cfg.checkpointing.keep_last,
            extra={"generator": self.generator.get_state(), "predictor": self.sampler.predictor},
            trainer_state={"data": self.stream.state_dict(), "eval_before": self.eval_before})

    def close(self) -> None:
        """Free the sampling engine (vLLM's pool and weights); no sampling afterwards."""
        self.engine.close()

    # ------------------------------------------------------------------ one step

    def train_step(self, logger: RunLogger | None = None) -> dict[str, Any]:
        start = time.perf_counter()
        batch = self.stream.next_batch()
        rollout, sample_metrics, groups = self._rollout(batch)
        if logger is not None:
            logger.log_lengths(self.step + 1, groups)
        self.engine.sleep()  # vLLM on CUDA: free its KV pool and weights while training
        loss_metrics = self.grpo.optimize(rollout, self.optimizer, self.scheduler)
        self.engine.load_weights(self.model)  # the next step samples from the updated policy
        self.step += 1
        return {**sample_metrics, **loss_metrics, "learning_rate": self.scheduler.get_last_lr()[0],
                "epoch": self.stream.epoch, "step_time": round(time.perf_counter() - start, 3)}

    def _rollout(self, batch: list[tuple[int, dict[str, Any]]]):
        """Sample, score and normalise one step's groups; returns (Rollout, metrics, trace lines)."""
        G = self.cfg.sampling.num_generations
        texts = [render_prompt(ex, self.tokenizer, self.cfg.data) for _, ex in batch]
        prompt_ids = [self._encode_prompt(t) for t in texts]
        result = self._sample_with_retry(prompt_ids, G, [str(i) for i, _ in batch], texts)
        completions = [c for group in result.groups for c in group]  # group-major, N = B*G
        examples = [ex for _, ex in batch for _ in range(G)]
        rewards = self._score(examples, completions)
        adv = compute_advantages(torch.tensor(rewards.total, dtype=torch.float32), G,
                                 self.cfg.training.scale_rewards)
        engine_logprobs = ([torch.tensor(c.logprobs, dtype=torch.float32) for c in completions]
                           if all(c.logprobs is not None for c in completions) else None)
        rollout = Rollout(prompt_ids=[p for p in prompt_ids for _ in range(G)],
                          completion_ids=[c.token_ids for c in completions],
                          advantages=adv.advantages, engine_logprobs=engine_logprobs)
        metrics = self._sample_metrics(rewards, adv, completions, result.stats.to_metrics())
        groups = [{"prompt_id": str(i), "prompt_tokens": len(p), "lengths": [c.length for c in grp]}
                  for (i, _), p, grp in zip(batch, prompt_ids, result.groups)]
        return rollout, metrics, groups

    def _sample_with_retry(self, prompt_ids, G: int, keys: list[str], texts: list[str]):
        """On out-of-memory, halve g (leaving `full` for `continuous`) and sample the step again."""
        sampling = self.sampler.cfg
        while True:
            state = self.generator.get_state()
            try:
                return self.sampler.sample(prompt_ids, G, prompt_keys=keys, prompt_texts=texts,
                                           generator=self.generator)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                g = sampling.micro_group or self.sampler.last_num_slots or G * len(prompt_ids)
                if not is_out_of_memory(err) or g <= 1:
                    raise
                self.generator.set_state(state)
                sampling.micro_group = g // 2
                sampling.policy = "continuous" if sampling.policy == "full" else sampling.policy
                self.num_sampling_oom_retries += 1
                print(f"out of memory while sampling: retrying with micro_group={g // 2}")

    def _encode_prompt(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return ids[-self.cfg.data.max_prompt_length:]

    def _score(self, examples: list[dict[str, Any]], completions):
        chat = uses_chat_template(self.tokenizer, self.cfg.data)
        prompts = [prompt_for_rewards(ex, self.tokenizer, self.cfg.data) for ex in examples]
        texts = [completion_for_rewards(c.text, chat) for c in completions]
        columns = {k: [ex[k] for ex in examples] for k in examples[0] if k != "prompt"}
        return compute_rewards(self.reward_funcs, self.reward_weights, prompts, texts, columns,
                               completion_ids=[c.token_ids for c in completions])

    def _sample_metrics(self, rewards, adv, completions, sampler_metrics: dict[str, Any]) -> dict[str, Any]:
        lengths = torch.tensor([c.length for c in completions], dtype=torch.float32)  # [N]
        total = torch.tensor(rewards.total, dtype=torch.float32)  # [N]
        metrics: dict[str, Any] = {
            "reward": total.mean().item(), "reward_std": adv.reward_std,
            "frac_reward_zero_std": adv.zero_std_fraction,
            "completions/mean_length": lengths.mean().item(), "completions/max_length": lengths.max().item(),
            "completions/min_length": lengths.min().item(),
            "completions/clipped_ratio": sum(c.finish_reason == "length" for c in completions) / len(completions),
        }
        metrics.update(rewards.metrics())
        if "accuracy" in rewards.per_function:
            values = rewards.per_function["accuracy"]
            metrics["accuracy"] = sum(1 for v in values if v and v > 0) / len(values)
        metrics.update(sampler_metrics)
        metrics["sampling/oom_retries"] = self.num_sampling_oom_retries
        return metrics
