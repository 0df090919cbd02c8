"""The single source of configuration: a tree of dataclasses.

YAML files and command-line flags (`--training.learning_rate 1e-5`) are both derived from this tree;
each option's help text and bounds live in its field's metadata and nowhere else (`opt`,
`options.py`, which also checks them). `Config.validate` checks values and raises `ConfigError`
with one line that names the offending key. The sampling and training sections are
`config_algorithm.py`; reading YAML files and flags into the tree is `config_io.py`.
Validation looks at the settings alone: a choice is checked against the names in
`infsamp.choices` (the registries' code is never imported here), and what needs this machine (a
CUDA device, an installed library, the model's layer names, the precision a device computes) is
checked by the code that uses it, before anything loads (`infsamp.run.setup.check_environment`).

Deliberately simple: no interpolation, no includes; lists are given in YAML or as comma-separated
strings on the command line.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infsamp import choices
from infsamp.config_algorithm import SamplingConfig, TrainingConfig
from infsamp.hub import looks_like_path
from infsamp.options import (
    MAX_GENERATED_EXAMPLES,
    ConfigError,
    opt,
    require,
    require_bounded,
    require_finite,
    require_limits,
)

EMBEDDED_MODEL = "embedded"
EMBEDDED_TASK = "embedded:arithmetic"
REASONING_GYM_PREFIX = "reasoning_gym:"


@dataclass
class ModelConfig:
    name_or_path: str = opt(EMBEDDED_MODEL,
                            "HF checkpoint directory, or 'embedded' for the bundled tiny model")
    dtype: str = opt("auto", "weights dtype: auto (training: follows training.precision; sample "
                     "and bench: bf16 on GPU, fp32 on CPU), fp32, bf16 (must agree with "
                     "training.precision)", choices=("auto", "fp32", "bf16"))
    attn_implementation: str = opt("sdpa", "attention kernel passed to transformers (sdpa, "
                                   "eager, flash_attention_2)")
    lora_rank: int = opt(0, "LoRA rank through peft; 0 trains all weights", at_least=0)
    lora_alpha: int = opt(32, "LoRA alpha", above=0)
    lora_dropout: float = opt(0.0, "LoRA dropout", at_least=0, below=1)
    lora_target_modules: list[str] = opt(["all-linear"], "modules LoRA adapts (peft names)")
    gradient_checkpointing: bool = opt(False,
                                       "recompute activations in the backward pass to save memory")
    device: str = opt("auto", "auto, cpu or cuda[:N]")
    load_in_4bit: bool = opt(False, "QLoRA: base weights in 4-bit NF4 (bitsandbytes, CUDA only), "
                             "fp32 LoRA adapters on top; needs model.lora_rank > 0")
    trust_remote_code: bool = opt(False, "run Python code that a model folder ships (custom "
                                  "classes named by auto_map in its config.json) when loading the "
                                  "policy, its tokenizer and reward-model folders: that code runs "
                                  "with your permissions; only for folders whose code you have "
                                  "read (false: such a folder is refused in one line)")

    def validate(self) -> None:
        require_limits("model", self)
        require(not self.load_in_4bit or self.lora_rank > 0, "model.load_in_4bit",
                 self.load_in_4bit, "trains LoRA adapters over the 4-bit base: set "
                 "model.lora_rank (e.g. 16)")
        require(len(self.lora_target_modules) > 0, "model.lora_target_modules",
                 self.lora_target_modules, "needs at least one module name (or all-linear)")
        attn = self.attn_implementation
        require(attn in ATTN_IMPLEMENTATIONS or ("/" in attn and not looks_like_path(attn)),
                 "model.attn_implementation", attn,
                 f"must be one of {', '.join(ATTN_IMPLEMENTATIONS)} (or a kernels hub id)")
        require(DEVICE_PATTERN.fullmatch(self.device) is not None, "model.device", self.device,
                 "must be auto, cpu or cuda[:N]")
        if self.name_or_path != EMBEDDED_MODEL and looks_like_path(self.name_or_path):
            require(Path(self.name_or_path).expanduser().exists(), "model.name_or_path",
                     self.name_or_path, "path does not exist")


@dataclass
class DataConfig:
    dataset: str = opt(EMBEDDED_TASK, "embedded:arithmetic, reasoning_gym:NAME (a reasoning-gym "
                       "task), a local .jsonl/.json path, or a datasets hub id")
    dataset_config: str | dict[str, Any] = opt(
        "", "datasets config name (e.g. 'main' for openai/gsm8k); for reasoning_gym:NAME a "
        "mapping of the task's options, e.g. {min_terms: 2, max_terms: 2, seed: 7, size: 2000}")
    train_split: str = opt("train", "split used for training")
    eval_split: str = opt("test", "split used for held-out evaluation")
    prompt_column: str = opt("prompt", "column with the question / prompt text")
    answer_column: str = opt("answer", "column with the reference answer")
    answer_parser: str = opt("none", "how to read the reference: none, or gsm8k ('#### 42')",
                             choices=("none", "gsm8k"))
    system_prompt: str = opt("", "system prompt for chat models (empty: none)")
    answer_instruction: str = opt("", "text appended to every question (after a blank line): the "
                                      "answer format the model is asked for, e.g. 'Give the final "
                                      "answer as <answer>N</answer>.' (rewards.answer_extraction "
                                      "reads it back)")
    example_turns: list[dict[str, Any]] = opt(
        [], "a worked example as earlier turns between the system prompt and the question "
            "(few-shot): {role: user|assistant|tool, content: TEXT} mappings, from a user turn "
            "to an assistant turn; an assistant turn calls a tool by writing <tool_call>{\"name\""
            ": ..., \"arguments\": {...}}</tool_call>, a tool turn is its answer (rendered as the "
            "chat template renders a tool's answer; docs/usage.md)")
    use_chat_template: str = opt("auto", "auto (if the tokenizer has one), always, never",
                                 choices=("auto", "always", "never"))
    num_train_examples: int = opt(4000, "embedded and reasoning_gym tasks: number of generated "
                                        "training problems (reasoning_gym: unless its 'size')")
    num_eval_examples: int = opt(200, "embedded and reasoning_gym tasks: number of held-out "
                                      "problems (reasoning_gym: seeds disjoint from training's)")
    max_prompt_length: int = opt(256, "prompts over this many tokens (chat template included) are "
                                      "skipped, never cut, and counted: data/dropped_prompts",
                                 above=0)
    seed: int = opt(1234, "seed of the embedded and reasoning_gym task generators "
                          "(reasoning_gym: unless its 'seed')")
    chat_template_kwargs: dict[str, Any] = opt({}, "extra chat template variables, e.g. "
                                                   "{enable_thinking: false} for Qwen3 (as TRL's)")
    eval_fraction: float = opt(0.0, "hold out this fraction of the training split (shuffled "
                                    "with data.seed) for evaluation instead of reading eval_split; "
                                    "needed when both would be the same rows (one .jsonl file)",
                               at_least=0, below=1)

    def validate(self) -> None:
        require_limits("data", self)
        reserved = set(self.chat_template_kwargs) & TEMPLATE_ARGUMENTS
        require(not reserved, "data.chat_template_kwargs", self.chat_template_kwargs,
                 f"{', '.join(sorted(reserved))} is set by infsamp, not by the recipe")
        require(0 <= self.num_eval_examples <= MAX_GENERATED_EXAMPLES, "data.num_eval_examples",
                 self.num_eval_examples, f"must be between 0 and {MAX_GENERATED_EXAMPLES:,}")
        require(0 < self.num_train_examples <= MAX_GENERATED_EXAMPLES,
                 "data.num_train_examples", self.num_train_examples,
                 f"must be between 1 and {MAX_GENERATED_EXAMPLES:,}")
        require(0 <= self.seed < 2**32, "data.seed", self.seed, "must be in [0, 2**32)")
        _check_example_turns(self.example_turns)
        task_source = self.dataset.startswith(("embedded:", REASONING_GYM_PREFIX))
        if not task_source and looks_like_path(self.dataset):
            require(Path(self.dataset).expanduser().exists(), "data.dataset", self.dataset,
                     "path does not exist")
        if self.dataset.startswith(REASONING_GYM_PREFIX):
            require(isinstance(self.dataset_config, dict) or not self.dataset_config,
                     "data.dataset_config", self.dataset_config, "reasoning_gym tasks take a "
                     "mapping of the task's options, e.g. {min_terms: 2, max_terms: 2}")
        else:
            require(not isinstance(self.dataset_config, dict), "data.dataset_config",
                     self.dataset_config, "a mapping is for reasoning_gym:NAME tasks; a datasets "
                     "source takes a config name")


EXAMPLE_ROLES = ("user", "assistant", "tool")


def _check_example_turns(turns: list[dict[str, Any]]) -> None:
    """data.example_turns: role and text in each turn, user first, assistant last, a tool turn
    only after an assistant or tool turn."""
    key = "data.example_turns"
    for index, turn in enumerate(turns):
        require(set(turn) == {"role", "content"}, f"{key}[{index}]", turn,
                 "a turn is {role: ..., content: ...}")
        require(turn["role"] in EXAMPLE_ROLES, f"{key}[{index}].role", turn["role"],
                 f"must be one of {', '.join(EXAMPLE_ROLES)}")
        require(isinstance(turn["content"], str), f"{key}[{index}].content", turn["content"],
                 "must be text")
        after = turns[index - 1]["role"] if index else ""
        require(turn["role"] != "tool" or after in ("assistant", "tool"), f"{key}[{index}]",
                 turn, "a tool turn answers the assistant turn before it")
    roles = [turn["role"] for turn in turns]
    require(not roles or (roles[0] == "user" and roles[-1] == "assistant"), key, roles,
             "starts with a user turn and ends with an assistant turn (the question follows)")


TEMPLATE_ARGUMENTS = {"messages", "conversation", "add_generation_prompt", "tokenize",
                      "return_dict", "continue_final_message", "chat_template", "tools",
                      "documents"}


@dataclass
class RewardsConfig:
    functions: list[str] = opt(["format", "accuracy"],
                               "reward functions: built-in names (format, accuracy, math_verify, "
                               "reasoning_gym), 'module:function', 'file.py:function', or a local "
                               "sequence-classification model directory")
    weights: list[float] = opt([], "one weight per function (default: all 1.0)")
    format_think_block: str = opt("forbid", "the format reward and a leading <think>...</think> "
                                            "block: forbid (the completion opens with <reasoning>, "
                                            "as the seed), allow (skipped when present), require",
                                  choices=choices.THINK_BLOCK_RULES)
    timeout_s: float = opt(0.0, "seconds one reward function may take per step; past it the call "
                                "is stopped (each function then runs in a worker process of its "
                                "own), its rows get None, counted in rewards/<name>/timeouts, and "
                                "the step goes on (0: no limit, functions run in the trainer)",
                           at_least=0, hint="0: no limit")
    allow_async: bool = opt(True, "run 'async def' reward functions concurrently; false refuses "
                                  "them at start-up (rewards strictly one after another)")
    answer_extraction: str = opt("answer_tag", "how the reasoning_gym reward reads the answer out "
                                 "of a completion: answer_tag (inside the last <answer></answer>), "
                                 "boxed (the last \\boxed{}), last_number, last_line, whole",
                                 choices=choices.ANSWER_EXTRACTIONS)

    def validate(self) -> None:
        require_limits("rewards", self)
        require(len(self.functions) > 0, "rewards.functions", self.functions,
                 "needs at least one function")
        require(not self.weights or len(self.weights) == len(self.functions), "rewards.weights",
                 self.weights, f"needs {len(self.functions)} values, one per function")


@dataclass
class ToolsConfig:
    functions: list[str] = opt([], "tools the model may call (TRL's `tools`): 'module:function' "
                               "or 'file.py:function', plain functions with type hints and a "
                               "docstring (their JSON schema); offered through the chat template")
    environment_factory: str = opt("", "TRL's environment_factory: 'module:Class' or "
                                   "'file.py:Class', instantiated per episode; reset(**row) may "
                                   "return the first observation, its public methods are tools, "
                                   "its get_reward() an extra reward (empty: none)")
    timeout_s: float = opt(10.0, "seconds one tool call may take; past it the call is stopped "
                                 "(functions run in worker processes) and the model gets a tool "
                                 "error; 0: no limit, functions run in the trainer's process",
                           at_least=0, hint="0: no limit")
    max_workers: int = opt(8, "tool calls running at once, per function (worker processes)",
                           at_least=1)

    @property
    def enabled(self) -> bool:
        return bool(self.functions or self.environment_factory)

    def validate(self) -> None:
        require_limits("tools", self)
        named = [("tools.functions", spec) for spec in self.functions]
        for key, spec in [*named, ("tools.environment_factory", self.environment_factory)]:
            require(not spec or ":" in spec.strip(":"), key, spec,
                     "give 'module:name' or 'file.py:name'")


@dataclass
class EvalConfig:
    every_steps: int = opt(30, "also evaluate every N steps (0: only before and after training)",
                           at_least=0)
    on_start: bool = opt(True, "evaluate before the first step (TRL's eval_on_start); false "
                               "saves one evaluation when the start is known, e.g. seeds of one "
                               "base model")
    num_problems: int = opt(200, "held-out problems evaluated (0 disables evaluation)", at_least=0)
    temperature: float = opt(0.0, "decoding temperature for evaluation (0 = greedy)", at_least=0)
    max_new_tokens: int = opt(0, "completion limit for evaluation (0: same as sampling)",
                              at_least=0)
    reward: str = opt("auto", "the run's reward function that scores held-out answers "
                              "(eval/accuracy, 'held-out accuracy'); auto: the first of accuracy, "
                              "math_verify, reasoning_gym in rewards.functions, else the first "
                              "function. Every function's mean is logged (eval/rewards/NAME/mean)")
    accuracy_threshold: float = opt(1.0, "a held-out problem counts as solved when eval.reward "
                                         "scores it at least this (1.0: math_verify's and "
                                         "reasoning_gym's full score; accuracy gives 2.0)")
    log_completions: bool = opt(True, "write eval_completions.jsonl: one line per held-out problem "
                                      "and evaluation (completion, each function's score, "
                                      "solved), for per-problem comparisons between steps")

    def validate(self) -> None:
        require_limits("eval", self)


@dataclass
class LoggingConfig:
    output_dir: str = opt("runs/demo",
                          "run folder: metrics.jsonl, plots, checkpoints, lengths.jsonl")
    log_every: int = opt(1, "print a metrics line every N steps", at_least=1)
    progress_bar: bool = opt(True, "progress bars per phase on a terminal (never in pipes or CI)")
    plot: bool = opt(True, "write reward/accuracy plots (PNG) at the end")
    report_to: list[str] = opt(["none"], "experiment trackers: tensorboard, wandb, trackio, "
                               "mlflow, or none (pip install 'infsamp[tracking]')")
    project: str = opt("infsamp", "tracker project / experiment name")
    run_name: str = opt("", "tracker run name (empty: the output_dir's folder name)")
    completions_every: int = opt(0, "every N steps write the step's prompts, completions, "
                                    "rewards and advantages to completions.jsonl (0: never)",
                                 at_least=0, hint="0: never")

    def validate(self) -> None:
        require_limits("logging", self)
        _check_output_dir(self.output_dir)
        require(bool(self.project.strip()), "logging.project", self.project,
                 "must name a tracker project")
        problem = choices.tracker_problem(self.report_to)
        require(problem is None, "logging.report_to", self.report_to, problem or "")


@dataclass
class CheckpointConfig:
    save_every: int = opt(30, "save a checkpoint every N steps (0: at the end and on a signal)",
                          at_least=0)
    keep_last: int = opt(2, "number of step checkpoints kept", at_least=1)
    resume: str = opt("", "checkpoint directory to resume from; 'latest' (the newest in "
                      "output_dir that verifies; none is an error); 'auto' (the same, or a new "
                      "run when there is none)")
    save_on_signal: bool = opt(True, "on SIGTERM/SIGINT finish the step, save a checkpoint and "
                               "exit non-zero")
    keep_best: str = opt("", "an eval.jsonl metric (eval/accuracy, eval/reward or "
                         "eval/rewards/NAME/mean; higher is better): every evaluation that sets a "
                         "new best saves a checkpoint, which pruning keeps beside the keep_last "
                         "newest, and `infsamp export RUN --best` exports (TRL's "
                         "metric_for_best_model); empty: off")

    def validate(self) -> None:
        require_limits("checkpointing", self)
        require(not self.keep_best or self.keep_best.startswith("eval/"),
                 "checkpointing.keep_best", self.keep_best,
                 "must name an eval.jsonl metric: eval/accuracy, eval/reward or "
                 "eval/rewards/NAME/mean")
        if self.resume not in ("", "latest", "auto"):
            require(Path(self.resume).is_dir(), "checkpointing.resume", self.resume,
                     "must be latest, auto or a checkpoint folder that exists")


@dataclass
class DistributedConfig:
    strategy: str = opt("auto", "under torchrun or accelerate launch: ddp (every process holds "
                        "the model; gradients all-reduced), fsdp (FSDP2: weights, gradients and "
                        "optimizer states sharded; full weights gathered only to sample and "
                        "evaluate) or auto (accelerate launch's FSDP config: fsdp; else ddp)",
                        choices=("auto", "ddp", "fsdp"))
    assignment: str = opt("lpt", "how a step's prompts are divided between processes: lpt (by "
                          "predicted sampling cost, so they finish sampling together) or "
                          "round_robin", choices=("lpt", "round_robin"))
    failure_timeout_s: float = opt(30.0, "a process on another machine that sends no heartbeat "
                                   "for this long counts as failed and the others stop (processes "
                                   "on the same machine are checked directly)", at_least=1,
                                   hint="seconds")
    reshard_after_forward: str = opt("auto", "fsdp: free each layer's gathered weights after its "
                                     "forward (true: ZeRO-3 memory) or keep them for the backward "
                                     "(false: ZeRO-2, less communication); auto: accelerate's "
                                     "config, else true", choices=("auto", "true", "false"))

    def validate(self) -> None:
        require_limits("distributed", self)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def validate(self) -> Config:
        for section in dataclasses.fields(self):
            require_finite(section.name, getattr(self, section.name))
            require_bounded(section.name, getattr(self, section.name))
            getattr(self, section.name).validate()
        require(not self.checkpointing.keep_best or self.eval.num_problems > 0,
                 "checkpointing.keep_best", self.checkpointing.keep_best,
                 "needs evaluations (eval.num_problems > 0)")
        self._validate_sample_budget()
        require(not (self.distributed.strategy == "fsdp" and self.model.lora_rank > 0),
                 "distributed.strategy", self.distributed.strategy,
                 "fsdp shards full fine-tuning; with LoRA (model.lora_rank > 0) use ddp")
        require(not (self.sampling.dynamic and self.tools.enabled), "sampling.dynamic",
                 self.sampling.dynamic, "is not yet combined with tools (tools.functions / "
                 "tools.environment_factory): an episode's chunks would need their own "
                 "environments; use one or the other")
        return self

    def _validate_sample_budget(self) -> None:
        budget, first = self.training.completions_per_step, (self.training.prompts_per_step
                                                             * self.sampling.num_generations)
        if not budget:
            return
        require(self.sampling.dynamic, "training.completions_per_step", budget,
                 "spreads completions by observed spread: set sampling.dynamic true")
        require(budget >= first, "training.completions_per_step", budget,
                 f"must be >= prompts_per_step x num_generations ({first}): every prompt's "
                 "first chunk")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- helpers

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(?::\d+)?")


def _check_output_dir(output_dir: str) -> None:
    """The run folder is a folder (or can become one) that we may write."""
    require(output_dir.strip() != "", "logging.output_dir", output_dir, "must name a folder")
    path = Path(output_dir)
    for link in (p for p in [*reversed(path.parents), path] if p.is_symlink() and not p.exists()):
        raise ConfigError(f"logging.output_dir: {link} is a symbolic link to "
                          f"{os.readlink(link)}, which does not exist (create that folder, or "
                          f"remove the link) (got {output_dir!r})")
    existing = next(p for p in [path, *path.parents] if p.exists())
    require(existing.is_dir(), "logging.output_dir", output_dir,
             "is a file, not a folder" if existing == path else f"{existing} is a file")
    require(os.access(existing, os.W_OK | os.X_OK), "logging.output_dir", output_dir,
             f"{existing} is not writable")
