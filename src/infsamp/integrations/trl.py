"""infsamp's sampler inside TRL: a `rollout_func` for `trl.GRPOTrainer` (TRL 1.x).

    from infsamp.integrations.trl import infsamp_rollout
    trainer = GRPOTrainer(model=model, reward_funcs=reward, train_dataset=dataset,
                          args=GRPOConfig(num_generations=64, use_vllm=False),
                          rollout_func=infsamp_rollout(kv_budget="2GiB", policy="length_aware"))

TRL calls the function with this process's prompts, each repeated `num_generations` times in a
row, and the trainer. The function turns each run of repeats into one group (a run split across
processes becomes a smaller group), tokenizes each prompt once as TRL does (chat template for
conversational prompts), and samples every group with `GroupSampler` on the trainer's current
policy, unwrapped as TRL's own generation unwraps it: the KV cache stays within `kv_budget`
whatever G, in micro groups of g slots with continuous refill, under any infsamp policy (and the
online length predictor, kept for the whole run), on the engine `engine` names (`slots`, the
default: the trainer's own model; `vllm`: a vLLM copy kept for the run, sent the trainer's weights
before every call and put to sleep after it; see `sampling.engine`).

It returns one row per completion, in the prompts' order: `prompt_ids`, `completion_ids` (EOS
included, as TRL's own path) and `logprobs`, the per-token log-probs of the sampled tokens under
the policy at temperature T (what TRL computes for its own `old_per_token_logps`), in no-grad
micro-batches of at most `kv_budget` tokens, so the whole rollout's memory stays bounded by the
budget whatever G; or None with `logprobs=False` (as TRL's own transformers generation returns:
TRL reads them only for its vLLM corrections). Sampling options default to TRL's
(`max_completion_length`, `temperature`, `top_p`, `top_k`); sampler statistics are added to TRL's
logs as `infsamp/*`.

Tools (`infsamp_rollout(tools=[...])`, `trl_tools.py`): multi-turn episodes run inside the
rollout, and it returns TRL's `env_mask` (the tools' answers out of the loss); TRL's own
`GRPOTrainer(tools=..., environment_factory=...)` is refused in one line (TRL would generate every
turn after the first itself).

Deliberately simple: text prompts (plain or chat) only; no environments or images;
TRL's own `use_vllm` must be off (the rollout is the generation backend); `repetition_penalty`,
`min_p` and `generation_kwargs` are not supported: each is one error line at the first call.
Dynamic sampling (`sampling.dynamic`) does not apply: TRL fixes the group size and scores the
completions after the rollout returns; its options are refused in one line.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from typing import Any

import torch

from infsamp.config import ToolsConfig
from infsamp.config_algorithm import SamplingConfig
from infsamp.console import Notices
from infsamp.errors import InfsampError
from infsamp.integrations.trl_tools import RolloutError, env_mask, load_rollout_tools

# sampling.* options of `infsamp train`'s dynamic sampling, refused here (one line)
DYNAMIC_OPTIONS = ("dynamic", "max_num_generations", "dynamic_chunk", "max_replaced_prompts")
LOGGED_STATS = ("decode_steps", "micro_group", "peak_kv_bytes", "tokens_per_second", "wall_time_s")


def infsamp_rollout(logprobs: bool = True, **sampling: Any) -> InfsampRollout:
    """A `rollout_func`; keywords are `sampling.*` options (kv_budget, policy, micro_group, engine,
    max_turns ...), `max_prompt_tokens` (the longest prompt a vLLM engine must take; default
    256), and `tools` (functions or 'module:function' references, as `tools.functions`) with
    `tool_timeout_s` and `tool_max_workers` (`tools.timeout_s`, `tools.max_workers`)."""
    return InfsampRollout(logprobs=logprobs, **sampling)


def group_runs(prompts: list[Any], group_size: int) -> list[tuple[Any, int]]:
    """[p, p, p, q, q, q] -> [(p, 3), (q, 3)]: runs of repeats, cut into groups <= group_size."""
    runs: list[tuple[Any, int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] == prompt and runs[-1][1] < group_size:
            runs[-1] = (prompt, runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs


def prompt_key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


class InfsampRollout:
    """`(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}` for GRPOTrainer."""

    def __init__(self, logprobs: bool = True, logprob_micro_batch_tokens: int = 0,
                 max_prompt_tokens: int = 256, share_prompt: bool = True, tools=None,
                 tool_timeout_s: float = ToolsConfig.timeout_s,
                 tool_max_workers: int = ToolsConfig.max_workers, **sampling: Any):
        allowed = set(SamplingConfig.__dataclass_fields__) - {"num_generations", *DYNAMIC_OPTIONS}
        unknown = sorted(set(sampling) - allowed)
        if set(sampling) & set(DYNAMIC_OPTIONS):
            raise RolloutError("infsamp_rollout: dynamic sampling does not apply here: TRL fixes "
                               "each group at GRPOConfig.num_generations and scores the "
                               "completions itself (`infsamp train` has sampling.dynamic)")
        if unknown:
            raise RolloutError(f"infsamp_rollout: unknown sampling option(s) {', '.join(unknown)} "
                               "(G is GRPOConfig.num_generations)")
        self.sampling = {"engine": "slots", **sampling}
        given = replace(SamplingConfig(), **self.sampling)
        try:  # bad values are refused now, not at TRL's first step
            given.validate()
        except InfsampError as err:
            raise RolloutError(f"infsamp_rollout: {err}") from None
        self.tools = load_rollout_tools(tools, tool_timeout_s, tool_max_workers, given.max_turns)
        self.want_logprobs, self.max_prompt_tokens = logprobs, max_prompt_tokens
        self.logprob_tokens = logprob_micro_batch_tokens  # 0: the KV budget, in tokens
        self.share_prompt = share_prompt  # each group's prompt forwarded once for the log-probs
        self.cfg: SamplingConfig | None = None
        self.predictor = None
        self.generator: torch.Generator | None = None
        self.engine = None  # built at the first call, kept for the run
        self.sizes = None  # the run's sizes (RunSizes), decided with the engine
        self.notices = Notices()  # a sampler per step; each notice said once per run
        self.last_stats = None  # SamplerStats of the latest call (for callers and tests)

    def __call__(self, prompts: list[Any], trainer) -> dict[str, list | None]:
        if self.cfg is None:
            self._setup(trainer, conversational=not isinstance(prompts[0], str))
        training = trainer.model.training
        group_size = trainer.num_generations if training else trainer.num_generations_eval
        runs = group_runs(prompts, group_size)
        prompt_ids = self._tokenize([p for p, _ in runs], trainer)
        with self._policy(trainer) as model:
            completions = self._sample(model, trainer, runs, prompt_ids)
            rows_prompt = [ids for ids, (_, n) in zip(prompt_ids, runs) for _ in range(n)]
            rows_completion = [c.token_ids for group in completions for c in group]
            masks = env_mask([c for group in completions for c in group]) if self.tools else None
            logprobs = (self._logprobs(model, trainer, rows_prompt, rows_completion, masks)
                        if self.want_logprobs else None)
        self._log_stats(trainer, "train" if training else "eval")
        out = {"prompt_ids": rows_prompt, "completion_ids": rows_completion, "logprobs": logprobs}
        return out if masks is None else {**out, "env_mask": masks}

    # ---- checks and settings, once
    def _setup(self, trainer, conversational: bool) -> None:
        check_trainer(trainer)
        if self.tools is not None:
            self.tools.start(trainer.model, trainer.processing_class, conversational)
        from_trl = {"num_generations": max(2, trainer.num_generations),
                    "temperature": trainer.temperature, "top_p": trainer.top_p,
                    "max_new_tokens": trainer.max_completion_length, "top_k": trainer.top_k or 0}
        self.cfg = replace(SamplingConfig(), **{**from_trl, **self.sampling})
        self.cfg.validate()
        from infsamp.sampling.policies import uses_predictor

        if uses_predictor(self.cfg.policy):  # validate() allowed online or none only
            from infsamp.sampling.predictors import make_predictor

            self.predictor = make_predictor(self.cfg.predictor)
        seed = trainer.args.seed + trainer.accelerator.process_index
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    # ---- the three phases
    def _tokenize(self, prompts: list[Any], trainer) -> list[list[int]]:
        """As TRL tokenizes for its generation: chat template for messages, tokenizer for text;
        with tools, offered (the template's own way, else the fallback instructions)."""
        processor, extra = trainer.processing_class, {}
        if self.tools is not None:
            prompts, extra = self.tools.offered(prompts)
        if isinstance(prompts[0], str):
            return [list(ids) for ids in processor(text=prompts)["input_ids"]]
        tokenized = processor.apply_chat_template(
            conversation=prompts, chat_template=trainer.chat_template, add_generation_prompt=True,
            tokenize=True, return_dict=True, **extra, **trainer.chat_template_kwargs)
        return [list(ids) for ids in tokenized["input_ids"]]

    @contextlib.contextmanager
    def _policy(self, trainer):
        """The trainer's current model, unwrapped (DeepSpeed/FSDP gathered) as TRL's generate."""
        from trl.models import unwrap_model_for_generation

        args, dist = trainer.args, getattr(trainer, "_dist", None)
        full_params = (dist.summon_full_params(trainer.model_wrapped, recurse=False) if dist
                       else contextlib.nullcontext())
        unwrapped = unwrap_model_for_generation(
            trainer.model_wrapped, trainer.accelerator,
            gather_deepspeed3_params=args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        with unwrapped as model, full_params:
            yield model

    def _engine(self, model, num_prompts: int):
        """The run's engine (built once), holding the trainer's current weights."""
        from infsamp.sampling.engines.base import make_engine
        from infsamp.sampling.sizes import sampler_run_sizes

        if self.engine is None:  # built from the model's current weights, sized once
            self.sizes = sampler_run_sizes(self.cfg, model, self.max_prompt_tokens, num_prompts,
                                           optimizer="adamw")  # beside TRL's AdamW states
            self.engine = make_engine(self.cfg.engine, model, self.cfg, self.sizes)
        else:
            self.engine.load_weights(model)
        return self.engine

    def _sample(self, model, trainer, runs: list[tuple[Any, int]], prompt_ids: list[list[int]]):
        """Completions per run, in order; one sampler call per distinct group size (usually 1)."""
        from infsamp.sampling.sampler import GroupSampler

        engine = self._engine(model, len(runs))
        sampler = GroupSampler(model, trainer.processing_class, self.cfg, predictor=self.predictor,
                               engine=engine, sizes=self.sizes, notices=self.notices)
        groups: list[list] = [[] for _ in runs]
        for size in sorted({n for _, n in runs}, reverse=True):
            chosen = [i for i, (_, n) in enumerate(runs) if n == size]
            keys = [prompt_key(runs[i][0]) for i in chosen]
            turns = self.tools.box.episodes() if self.tools is not None else None
            result = sampler.sample([prompt_ids[i] for i in chosen], size, prompt_keys=keys,
                                    prompt_texts=keys, generator=self.generator, turns=turns)
            for i, group in zip(chosen, result.groups):
                groups[i] = group
            self.last_stats = result.stats
        engine.sleep()  # vLLM on CUDA: its pool and weights freed while TRL trains
        return groups

    def close(self) -> None:
        """Free the engine (a vLLM engine's pool and weights)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.tools is not None:
            self.tools.close()

    def _logprobs(self, model, trainer, prompt_ids, completion_ids,
                  masks: list[list[int]] | None = None) -> list[list[float]]:
        """No-grad, in micro-batches of at most the KV budget's tokens (one sequence at least);
        with `share_prompt` (where the model takes the block mask) in the training step's shared
        layout: each group's prompt forwarded once, its completions behind it. `masks` (tools):
        0.0 on the tools' answers."""
        from infsamp.algorithm.logprobs import sequence_logprobs
        from infsamp.algorithm.shared_prompt import LAYOUTS, supports_shared_prompt

        tokens = self.logprob_tokens or self.sizes.kv_budget_tokens
        pad = trainer.processing_class.pad_token_id
        pad = getattr(trainer.processing_class, "eos_token_id", 0) if pad is None else pad
        was_training = model.training
        model.eval()
        try:
            values = sequence_logprobs(model, prompt_ids, completion_ids,
                                       max_tokens=tokens, pad_token_id=pad,
                                       temperature=trainer.temperature or 1.0,
                                       build=LAYOUTS[self.share_prompt and
                                                     supports_shared_prompt(model)].build,
                                       model_masks=None if masks is None else
                                       [torch.tensor(m, dtype=torch.float32) for m in masks])
        finally:
            model.train(was_training)
        return [v.tolist() for v in values]

    def _log_stats(self, trainer, mode: str) -> None:
        metrics = getattr(trainer, "_metrics", None)
        if metrics is None or self.last_stats is None:
            return
        values = self.last_stats.to_metrics(prefix="")
        for name in LOGGED_STATS:
            metrics[mode][f"infsamp/{name}"].append(values[name])
        if self.tools is not None:  # tools/calls, tools/errors, tools/time_s; turns
            for name, value in self.tools.metrics().items():
                metrics[mode][f"infsamp/{name}"].append(value)
            metrics[mode]["infsamp/tool_turns"].append(values["num_tool_turns"])


def check_trainer(trainer) -> None:
    """One line for the first TRL setting the rollout cannot honour."""
    multi_turn = (bool(getattr(trainer, "tools", None))
                  or getattr(trainer, "environment_factories", None) is not None)
    problems = [
        (getattr(trainer, "use_vllm", False), "GRPOConfig use_vllm=True: the infsamp rollout "
         "replaces TRL's generation (engine='vllm' decodes with vLLM); set use_vllm=False"),
        (multi_turn, "GRPOTrainer tools / environment_factory: TRL would generate every turn "
         "after the first itself; give the tools to the rollout, infsamp_rollout(tools=[...]) "
         "(environments are not supported: their dataset rows never reach a rollout_func)"),
        (getattr(trainer, "repetition_penalty", 1.0) != 1.0,
         "GRPOConfig repetition_penalty: not supported (use 1.0)"),
        (getattr(trainer, "min_p", None) is not None,
         "GRPOConfig min_p: not supported (leave it unset)"),
        (bool(getattr(trainer.args, "generation_kwargs", None)),
         "GRPOConfig generation_kwargs: not supported by the infsamp rollout"),
    ]
    for bad, why in problems:
        if bad:
            raise RolloutError(why)
