"""The frameworks `vs_trl.py` compares, and the sizes they share, each decided in one place.

`case_sizes` decides, per G, what every framework gets: g (infsamp's micro group), the KV budget
g x (prompt + completion) tokens (infsamp's `sampling.kv_budget`, `trl_cb`'s KV pool, both vLLM
pools), and the training micro-batch: TRL's `per_device_train_batch_size` B and infsamp's
`train_micro_batch_tokens` B x (prompt + completion), one derived from the other (`--trl-batch`
or `--train-micro-batch-tokens`; both given and disagreeing is one error line).

Frameworks (`FRAMEWORKS`: name -> worker(args, G, model_dir, tmp) -> raw result):
- `trl`: TRL 1.16's GRPOTrainer with its own `generate` (all G decoded at once), training in
  micro-batches of B completions (`steps_per_generation` = gradient accumulation = G / B: one
  optimizer step per prompt); `--trl-batch all` is TRL's default layout (B = G);
- `trl_cb`: the same with `use_transformers_continuous_batching` and a KV pool of the budget
  (`continuous_batching_config`);
- `trl_vllm`: the same with TRL's vLLM colocate mode (in-process; its KV pool, which TRL sizes only
  by a memory fraction, set to the budget's bytes by `kv_cache_memory_bytes`; on vLLM's CPU build
  its weight sync through `reload_weights`, `cpu_sync_weights`);
- `trl_infsamp`: the same TRL trainer with `infsamp_rollout` as its `rollout_func`;
- `infsamp`, `infsamp_vllm`: infsamp's trainer, continuous policy, slot or vLLM engine.
Each measures the whole-step peak and the generation peak (`peak_meter.py`) after one warm-up
step, and each measured step's wall and CPU seconds and mean completion length.

Deliberately simple: one prompt per step, beta 0 (no reference model), dapo loss, gradient
checkpointing on or off in all.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

from peak_meter import make_meter

NUM_PROMPTS = 64
MAX_PROMPT_TOKENS = 32  # arithmetic prompts are < 32 characters (one token each)
PAGE_SIZE = 16  # transformers' continuous-batching page (vLLM's GPU block size)


class SizeError(SystemExit):
    """Sizes that cannot run (one line, before any work)."""


@dataclasses.dataclass(frozen=True)
class CaseSizes:
    micro_group: int  # g: samples decoded at once (infsamp, trl_infsamp)
    kv_budget_tokens: int  # g x (prompt + completion): every framework's KV budget
    train_batch: int  # TRL: completions per forward/backward (per_device_train_batch_size)
    train_micro_batch_tokens: int  # infsamp: padded tokens per training micro-batch


def sequence_tokens(args) -> int:
    return MAX_PROMPT_TOKENS + args.max_completion


def kv_budget_tokens(args, G: int) -> int:
    return min(args.micro_group, G) * sequence_tokens(args)


def train_batch(args, G: int) -> int:
    """TRL's training micro-batch (completions) at this G, from whichever option was given."""
    per_sequence = sequence_tokens(args)
    given = G if args.trl_batch == "all" else int(args.trl_batch or 0)
    if args.train_micro_batch_tokens:
        implied = args.train_micro_batch_tokens // per_sequence
        if given and min(given, G) != min(implied, G):
            raise SizeError(
                f"vs_trl.py: --trl-batch {args.trl_batch} and --train-micro-batch-tokens "
                f"{args.train_micro_batch_tokens} disagree: {args.train_micro_batch_tokens} tokens "
                f"hold {implied} sequences of {per_sequence} (prompt {MAX_PROMPT_TOKENS} + "
                f"completion {args.max_completion}); give one of them")
        if implied < 1:
            raise SizeError(f"vs_trl.py: --train-micro-batch-tokens "
                            f"{args.train_micro_batch_tokens}: below "
                            f"one sequence ({per_sequence} tokens)")
        given = given or implied
    batch = min(given or args.micro_group, G)
    if G % batch:
        raise SizeError(f"vs_trl.py: a training micro-batch of {batch} completions "
                        f"({batch * per_sequence} "
                        f"tokens) does not divide G={G} (TRL's gradient accumulation needs it); "
                        "give --trl-batch or --train-micro-batch-tokens for a divisor")
    return batch


def case_sizes(args, G: int) -> CaseSizes:
    batch = train_batch(args, G)
    tokens = args.train_micro_batch_tokens or batch * sequence_tokens(args)
    return CaseSizes(min(args.micro_group, G), kv_budget_tokens(args, G), batch, tokens)


def continuous_batching_config(sizes: CaseSizes) -> dict:
    """transformers' ContinuousBatchingConfig holding the KV budget: `num_blocks` pages of
    PAGE_SIZE tokens (`page_size` since transformers 5.17, `block_size` before), and at most as
    many tokens per forward as infsamp's engine feeds (g decode tokens beside one prompt's
    prefill)."""
    from transformers.generation import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page = "page_size" if "page_size" in names else "block_size"
    return {page: PAGE_SIZE, "num_blocks": math.ceil(sizes.kv_budget_tokens / PAGE_SIZE),
            "max_batch_tokens": sizes.micro_group + MAX_PROMPT_TOKENS}


# ---------------------------------------------------------------- shared pieces


def reward_functions():
    from infsamp.rewards.builtin import accuracy_reward, format_reward

    return [format_reward, accuracy_reward]


def train_problems(num: int) -> list[dict]:
    from infsamp.tasks.arithmetic import generate_problems

    return [{"prompt": p["prompt"], "answer": p["answer"]}
            for p in generate_problems(num, 1234, "train")]


def is_bf16(args) -> bool:
    return args.device == "cuda" and args.precision.startswith("bf16")


class StepClock:
    """Wall and CPU seconds of each step (`begin`/`end`); the meter starts after the warm-up."""

    def __init__(self, meter):
        self.meter, self.wall, self.cpu, self.lengths = meter, [], [], []
        self.step_logs: list[dict] = []  # each step's metrics (TRL's logs, infsamp's train_step)
        self.micro_batch_tokens: list[int] = []  # padded tokens of each measured training forward

    def counting(self, fn, tokens_of):
        """`fn` wrapped: once the meter started, each call's padded tokens (`tokens_of(args)`)."""
        def counted(*args, **kwargs):
            if self.meter.baseline is not None:
                self.micro_batch_tokens.append(int(tokens_of(args, kwargs)))
            return fn(*args, **kwargs)
        return counted

    def begin(self) -> None:
        self.started = (time.perf_counter(), time.process_time())

    def end(self, step: int) -> None:
        self.wall.append(time.perf_counter() - self.started[0])
        self.cpu.append(time.process_time() - self.started[1])
        if step == 1:
            self.meter.start()

    def result(self) -> dict:
        return {"peak_bytes": self.meter.peak_bytes(),
                "generation_peak_bytes": max(self.meter.phase_peaks, default=0),
                "step_seconds": self.wall[1:], "step_cpu_seconds": self.cpu[1:],
                "mean_lengths": self.lengths[1:],  # step 1: the warm-up
                "max_micro_batch_tokens": max(self.micro_batch_tokens, default=0)}


# ---------------------------------------------------------------- TRL


def trl_config(args, G: int, out_dir: Path, **extra):
    from trl import GRPOConfig

    batch = case_sizes(args, G).train_batch
    return GRPOConfig(
        output_dir=str(out_dir), num_generations=G, per_device_train_batch_size=batch,
        gradient_accumulation_steps=G // batch, steps_per_generation=G // batch,
        max_completion_length=args.max_completion, learning_rate=args.learning_rate,
        temperature=1.0, beta=0.0, bf16=is_bf16(args), fp16=False,
        use_cpu=args.device == "cpu", report_to=[], logging_steps=1, save_strategy="no",
        max_steps=1 + args.steps, lr_scheduler_type="constant", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, loss_type="dapo",
        gradient_checkpointing=args.gradient_checkpointing == "on", **extra)


def trl_callback(clock: StepClock):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Times each optimizer step (generation + loss + backward + update)."""

        def on_step_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            clock.end(state.global_step)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                clock.lengths.append(float(logs["completions/mean_length"]))
                clock.step_logs.append(dict(logs))

    return StepTimer()


def run_trl(args, G: int, model_dir: Path, tmp: Path, rollout_func=None, **extra) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from infsamp.models.loading import load_tokenizer

    dtype = torch.bfloat16 if is_bf16(args) else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    clock = StepClock(make_meter(args.device))
    trainer = trl_trainer(clock, model=model, reward_funcs=reward_functions(),
                          args=trl_config(args, G, tmp / "trl", **extra),
                          train_dataset=Dataset.from_list(train_problems(NUM_PROMPTS)),
                          processing_class=load_tokenizer(str(model_dir)),
                          rollout_func=rollout_func)
    trainer.train()
    return clock.result()


def trl_trainer(clock: StepClock, **trainer_kwargs):
    """TRL's GRPOTrainer timed by `clock`: each step (callback), each generation (meter phase:
    TRL's `_generate`, or the rollout_func it calls) and each training forward's tokens."""
    from trl import GRPOTrainer

    trainer = GRPOTrainer(**trainer_kwargs, callbacks=[trl_callback(clock)])
    trainer._generate = clock.meter.phase(trainer._generate)
    trainer.compute_loss = clock.counting(trainer.compute_loss, trl_micro_batch_tokens)
    return trainer


def trl_micro_batch_tokens(args, kwargs) -> int:
    """Padded tokens of one TRL training forward: compute_loss(model, inputs, ...)."""
    inputs = args[1] if len(args) > 1 else kwargs["inputs"]
    rows, prompt = inputs["prompt_ids"].shape
    return rows * (prompt + inputs["completion_ids"].shape[1])


def run_trl_cb(args, G: int, model_dir: Path, tmp: Path) -> dict:
    """TRL with transformers' continuous batching, its KV pool at the budget."""
    config = continuous_batching_config(case_sizes(args, G))
    return run_trl(args, G, model_dir, tmp, use_transformers_continuous_batching=True,
                   transformers_continuous_batching_config=config)


def run_trl_vllm(args, G: int, model_dir: Path, tmp: Path) -> dict:
    """TRL's vLLM colocate mode, in this process; vLLM's KV pool at the budget's bytes. On the
    CPU build its weight sync goes through `reload_weights` (`cpu_sync_weights`)."""
    import trl.generation.vllm_generation as trl_vllm

    from infsamp.sampling.engines.vllm_loading import import_vllm

    import_vllm()  # in-process engine core, quiet logs (as infsamp's engine)
    pool = kv_pool_bytes(model_dir, kv_budget_tokens(args, G))
    real_llm, real_sync = trl_vllm.LLM, trl_vllm.VLLMGeneration.sync_weights
    trl_vllm.LLM = lambda **kwargs: real_llm(**kwargs, kv_cache_memory_bytes=pool,
                                            dtype="bfloat16" if is_bf16(args) else "float32")
    if args.device == "cpu":
        trl_vllm.VLLMGeneration.sync_weights = cpu_sync_weights
    try:
        return run_trl(args, G, model_dir, tmp, use_vllm=True, vllm_mode="colocate",
                       vllm_max_model_length=sequence_tokens(args),
                       vllm_gpu_memory_utilization=0.3)
    finally:
        trl_vllm.LLM, trl_vllm.VLLMGeneration.sync_weights = real_llm, real_sync


def cpu_sync_weights(self) -> None:
    """TRL's colocate `sync_weights` for vLLM's CPU build, the one line it cannot run replaced:
    TRL pushes each parameter with `model.load_weights`, which the CPU build cannot take (it
    repacked every linear's weight and dropped its loader); the same parameters go through
    `model_runner.reload_weights` instead (infsamp's engine's `reload_weights`), then TRL's
    prefix-cache reset. Everything else (generation, KV pool, training) is TRL's own."""
    from infsamp.sampling.engines.vllm_loading import reload_weights

    runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
    reload_weights(runner, self._iter_named_params())
    self.llm.reset_prefix_cache()


def kv_pool_bytes(model_dir: Path, tokens: int) -> int:
    from transformers import AutoConfig

    from infsamp.planner import kv_bytes_per_token, shape_from_config

    shape = shape_from_config(AutoConfig.from_pretrained(model_dir))
    return tokens * kv_bytes_per_token(shape, 4)  # fp32 K and V


def run_trl_infsamp(args, G: int, model_dir: Path, tmp: Path) -> dict:
    """TRL's trainer with infsamp's sampler as rollout_func (the infsamp worker's settings)."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from infsamp.integrations.trl import infsamp_rollout

    sizes = case_sizes(args, G)
    rollout = infsamp_rollout(policy="continuous", micro_group=sizes.micro_group,
                              kv_budget=str(sizes.kv_budget_tokens))
    return run_trl(args, G, model_dir, tmp, rollout_func=rollout)


# ---------------------------------------------------------------- infsamp


def infsamp_trainer(args, G: int, model_dir: Path, tmp: Path, engine: str = "slots"):
    from infsamp.config_io import load_config
    from infsamp.run.trainer import GRPOTrainer

    sizes = case_sizes(args, G)
    cfg = load_config(overrides={
        "model.name_or_path": str(model_dir), "model.device": args.device,
        "model.gradient_checkpointing": args.gradient_checkpointing == "on",
        "training.precision": args.precision,
        "data.num_train_examples": NUM_PROMPTS, "data.max_prompt_length": MAX_PROMPT_TOKENS,
        "sampling.num_generations": G, "sampling.policy": "continuous",
        "sampling.micro_group": sizes.micro_group,
        "sampling.kv_budget": str(sizes.kv_budget_tokens),
        "sampling.max_new_tokens": args.max_completion, "sampling.temperature": 1.0,
        "sampling.engine": engine, "training.prompts_per_step": 1,
        "training.learning_rate": args.learning_rate, "training.lr_scheduler": "constant",
        "training.warmup_ratio": 0.0, "training.beta": 0.0, "training.loss_type": "dapo",
        "training.train_micro_batch_tokens": sizes.train_micro_batch_tokens,
        "training.max_steps": 1 + args.steps, "eval.num_problems": 0,
        "logging.output_dir": str(tmp / "infsamp"), "logging.plot": False,
        "logging.progress_bar": False,
    })
    return GRPOTrainer(cfg, reward_funcs=[(f.__name__, f) for f in reward_functions()])


def timed_step(trainer, clock: StepClock, step: int) -> None:
    clock.begin()
    metrics = trainer.train_step()
    clock.end(step)
    clock.lengths.append(float(metrics["completions/mean_length"]))
    clock.step_logs.append(metrics)


def metered_infsamp(trainer, device: str) -> StepClock:
    """A clock for infsamp's trainer, its meter's phase around the step's generation, and each
    training micro-batch's padded tokens."""
    clock = StepClock(make_meter(device))
    trainer.sampler.sample = clock.meter.phase(trainer.sampler.sample)
    trainer.grpo._micro_batch_backward = clock.counting(  # (mb, rollout, inputs)
        trainer.grpo._micro_batch_backward, lambda args, kwargs: args[0].input_ids.numel())
    return clock


def timed_steps(trainer, clock: StepClock, num_steps: int) -> None:
    """`num_steps` infsamp steps; step 1 is the warm-up (optimizer state, lazy imports)."""
    for step in range(1, 1 + num_steps):
        timed_step(trainer, clock, step)


def run_infsamp(args, G: int, model_dir: Path, tmp: Path, engine: str = "slots") -> dict:
    trainer = infsamp_trainer(args, G, model_dir, tmp, engine)
    clock = metered_infsamp(trainer, args.device)
    try:
        timed_steps(trainer, clock, 1 + args.steps)
    finally:
        trainer.close()
    return clock.result()


def run_infsamp_vllm(args, G: int, model_dir: Path, tmp: Path) -> dict:
    return run_infsamp(args, G, model_dir, tmp, engine="vllm")


FRAMEWORKS = {"trl": run_trl, "trl_cb": run_trl_cb, "trl_vllm": run_trl_vllm,
              "trl_infsamp": run_trl_infsamp, "infsamp": run_infsamp,
              "infsamp_vllm": run_infsamp_vllm}
