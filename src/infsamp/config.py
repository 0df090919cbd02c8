"""The single source of configuration: a tree of dataclasses.

YAML files and command-line flags (`--training.learning_rate 1e-5`) are both derived from this tree;
each option's help text lives in its field's metadata and nowhere else. `Config.validate` checks
values and raises `ConfigError` with one line that names the offending key; reading YAML files and
flags into the tree is `config_io.py`. Validation looks at the settings alone: a choice is checked
against the names in `infsamp.choices` (the registries' code is never imported here), and what
needs this machine (a CUDA device, an installed library, the model's layer names, the precision a
device computes) is checked by the code that uses it, before anything loads
(`infsamp.run.setup.check_environment`).

Deliberately simple: no interpolation, no includes; lists are given in YAML or as comma-separated
strings on the command line.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infsamp import choices
from infsamp.errors import InfsampError
from infsamp.hub import looks_like_path

EMBEDDED_MODEL = "embedded"
EMBEDDED_TASK = "embedded:arithmetic"
REASONING_GYM_PREFIX = "reasoning_gym:"
DYNAMIC_CAP_FACTOR = 4  # sampling.max_num_generations 0: this many times num_generations


class ConfigError(InfsampError, ValueError):
    """A configuration problem, reported as one line naming the key."""


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its help text (the one place the help lives)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelConfig:
    name_or_path: str = opt(EMBEDDED_MODEL,
                            "HF checkpoint directory, or 'embedded' for the bundled tiny model")
    dtype: str = opt("auto", "weights dtype: auto (training: follows training.precision; sample "
                     "and bench: bf16 on GPU, fp32 on CPU), fp32, bf16 (must agree with "
                     "training.precision)", choices=("auto", "fp32", "bf16"))
    attn_implementation: str = opt("sdpa",
                                   "attention kernel passed to transformers (sdpa, eager, "
                                   "flash_attention_2)")
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
        _require_limits("model", self)
        _require(not self.load_in_4bit or self.lora_rank > 0, "model.load_in_4bit",
                 self.load_in_4bit, "trains LoRA adapters over the 4-bit base: set "
                 "model.lora_rank (e.g. 16)")
        _require(len(self.lora_target_modules) > 0, "model.lora_target_modules",
                 self.lora_target_modules, "needs at least one module name (or all-linear)")
        attn = self.attn_implementation
        _require(attn in ATTN_IMPLEMENTATIONS or ("/" in attn and not looks_like_path(attn)),
                 "model.attn_implementation", attn,
                 f"must be one of {', '.join(ATTN_IMPLEMENTATIONS)} (or a kernels hub id)")
        _require(DEVICE_PATTERN.fullmatch(self.device) is not None, "model.device", self.device,
                 "must be auto, cpu or cuda[:N]")
        if self.name_or_path != EMBEDDED_MODEL and looks_like_path(self.name_or_path):
            _require(Path(self.name_or_path).expanduser().exists(), "model.name_or_path",
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
        _require_limits("data", self)
        reserved = set(self.chat_template_kwargs) & TEMPLATE_ARGUMENTS
        _require(not reserved, "data.chat_template_kwargs", self.chat_template_kwargs,
                 f"{', '.join(sorted(reserved))} is set by infsamp, not by the recipe")
        _require(0 <= self.num_eval_examples <= MAX_GENERATED_EXAMPLES, "data.num_eval_examples",
                 self.num_eval_examples, f"must be between 0 and {MAX_GENERATED_EXAMPLES:,}")
        _require(0 < self.num_train_examples <= MAX_GENERATED_EXAMPLES,
                 "data.num_train_examples", self.num_train_examples,
                 f"must be between 1 and {MAX_GENERATED_EXAMPLES:,}")
        _require(0 <= self.seed < 2**32, "data.seed", self.seed, "must be in [0, 2**32)")
        _check_example_turns(self.example_turns)
        task_source = self.dataset.startswith(("embedded:", REASONING_GYM_PREFIX))
        if not task_source and looks_like_path(self.dataset):
            _require(Path(self.dataset).expanduser().exists(), "data.dataset", self.dataset,
                     "path does not exist")
        if self.dataset.startswith(REASONING_GYM_PREFIX):
            _require(isinstance(self.dataset_config, dict) or not self.dataset_config,
                     "data.dataset_config", self.dataset_config, "reasoning_gym tasks take a "
                     "mapping of the task's options, e.g. {min_terms: 2, max_terms: 2}")
        else:
            _require(not isinstance(self.dataset_config, dict), "data.dataset_config",
                     self.dataset_config, "a mapping is for reasoning_gym:NAME tasks; a datasets "
                     "source takes a config name")


EXAMPLE_ROLES = ("user", "assistant", "tool")


def _check_example_turns(turns: list[dict[str, Any]]) -> None:
    """data.example_turns: role and text in each turn, user first, assistant last, a tool turn
    only after an assistant or tool turn."""
    key = "data.example_turns"
    for index, turn in enumerate(turns):
        _require(set(turn) == {"role", "content"}, f"{key}[{index}]", turn,
                 "a turn is {role: ..., content: ...}")
        _require(turn["role"] in EXAMPLE_ROLES, f"{key}[{index}].role", turn["role"],
                 f"must be one of {', '.join(EXAMPLE_ROLES)}")
        _require(isinstance(turn["content"], str), f"{key}[{index}].content", turn["content"],
                 "must be text")
        after = turns[index - 1]["role"] if index else ""
        _require(turn["role"] != "tool" or after in ("assistant", "tool"), f"{key}[{index}]",
                 turn, "a tool turn answers the assistant turn before it")
    roles = [turn["role"] for turn in turns]
    _require(not roles or (roles[0] == "user" and roles[-1] == "assistant"), key, roles,
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
                                  choices=("forbid", "allow", "require"))
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
        _require_limits("rewards", self)
        _require(len(self.functions) > 0, "rewards.functions", self.functions,
                 "needs at least one function")
        _require(not self.weights or len(self.weights) == len(self.functions), "rewards.weights",
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
        _require_limits("tools", self)
        named = [("tools.functions", spec) for spec in self.functions]
        for key, spec in [*named, ("tools.environment_factory", self.environment_factory)]:
            _require(not spec or ":" in spec.strip(":"), key, spec,
                     "give 'module:name' or 'file.py:name'")


@dataclass
class SamplingConfig:
    num_generations: int = opt(8, "G: completions sampled per prompt (the group size)")
    policy: str = opt("continuous", "full, rounds, continuous, length_aware or probe (more "
                      "samples than g start as short probes inside the same KV budget)")
    micro_group: int = opt(16, "g: samples decoded at once (slots); 0 derives it from kv_budget",
                           at_least=0)
    kv_budget: str = opt("auto", "KV-cache budget: tokens (8192), bytes ('2GiB') or auto")
    max_new_tokens: int = opt(256, "maximum completion length in tokens", above=0)
    temperature: float = opt(0.7, "sampling temperature (0 = greedy)", at_least=0)
    top_p: float = opt(1.0, "nucleus sampling threshold", above=0, at_most=1)
    top_k: int = opt(0, "top-k sampling (0 = off)", at_least=0)
    predictor: str = opt("online", "length predictor for length_aware and probe: online (prompt "
                                   "features and the first tokens), hidden (a probe on the "
                                   "policy's own hidden states; slot engine) or none")
    predictor_prefix_tokens: int = opt(8, "k: a running sample's remaining length is re-predicted "
                                          "every k generated tokens", at_least=0)
    preempt: bool = opt(True, "length_aware: after a sample's first k tokens, park it (tokens "
                              "kept, KV kept or recomputed) when it is predicted much shorter "
                              "than a waiting one, which takes its slot")
    max_turns: int = opt(4, "tool calls (turns that end in one) an episode may make; the "
                         "episode's tokens, the model's and the tools' answers, stay within "
                         "max_new_tokens (TRL's max_tool_calling_iterations)", at_least=0)
    probe_tokens: int = opt(12, "probe: KV tokens a new sample first reserves; at that many "
                            "tokens it is given its whole reservation, or parked (KV dropped)",
                            at_least=1)
    refill: str = opt("auto",
                      "runtime refill order for length_aware: auto (= "
                      "ljf, measured best), sjf, ljf")
    grouping_epsilon: float = opt(0.1,
                                  "FPTAS epsilon of the global grouping "
                                  "(smaller: closer to optimal)", above=0)
    engine: str = opt(
        "auto", "decoding engine: slots (infsamp's slot engine over the transformers model), vllm "
        "(vLLM in the trainer's process), auto (vllm where it is installed and the model is on a "
        "CUDA GPU, else slots)", choices=("auto", *choices.ENGINES))
    vllm_sleep: str = opt(
        "auto", "vllm engine: free GPU memory while training (vLLM sleep mode): off, offload "
        "(weights to CPU, KV pool freed), discard (weights and KV pool freed; the weights are "
        "pushed again after the optimizer step), auto (discard on CUDA, off on CPU)",
        choices=("auto", "off", "offload", "discard"))
    vllm_importance_sampling: str = opt(
        "token_truncate", "vllm engine: correct the loss for vLLM's log-prob mismatch with "
        "capped weights exp(old - vllm): token_truncate, token_mask, sequence_truncate, "
        "sequence_mask (as TRL) or off",
        choices=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "off"))
    vllm_importance_sampling_cap: float = opt(
        3.0, "vllm engine: the cap of those weights (TRL's C_max)", at_least=1,
        hint="a weight of 1: no correction")
    dynamic: bool = opt(False, "dynamic sampling: a prompt whose G rewards all tie gets more "
                        "completions, a chunk per sampler call, up to max_num_generations; one "
                        "still without spread there is dropped from the update and replaced by "
                        "the next prompt of the stream (run/dynamic_sampling.py). The KV budget "
                        "and g do not change")
    max_num_generations: int = opt(0, "dynamic: the most completions one prompt gets (0: "
                                   f"{DYNAMIC_CAP_FACTOR} x num_generations)", at_least=0,
                                   hint=f"0: {DYNAMIC_CAP_FACTOR} x num_generations")
    dynamic_chunk: int = opt(0, "dynamic: completions added to an undecided prompt per round "
                             "(0: num_generations)", at_least=0, hint="0: num_generations")
    max_replaced_prompts: int = opt(-1, "dynamic: prompts dropped without spread that are "
                                    "replaced per step (-1: training.prompts_per_step; 0: none)",
                                    at_least=-1, hint="-1: training.prompts_per_step")

    def validate(self) -> None:
        _require_limits("sampling", self)
        _require(self.num_generations >= 2, "sampling.num_generations", self.num_generations,
                 "must be >= 2 (GRPO compares samples within a group)")
        _require(self.engine != "vllm" or self.temperature <= VLLM_MAX_TEMPERATURE,
                 "sampling.temperature", self.temperature,
                 f"must be <= {VLLM_MAX_TEMPERATURE:g} with sampling.engine vllm (vLLM's limit); "
                 "sampling.engine slots samples at any temperature")
        _check_choice("sampling.policy", self.policy, choices.POLICIES)
        _require(self.predictor in choices.TRAINING_PREDICTORS, "sampling.predictor",
                 self.predictor, f"must be {' or '.join(choices.TRAINING_PREDICTORS)} (oracle "
                 "and noisy know the true lengths: bench and simulate only)")
        _check_choice("sampling.refill", self.refill, ("auto", *choices.REFILL_ORDERS))
        for name in ("engine", "vllm_sleep", "vllm_importance_sampling"):
            allowed = _field(SamplingConfig, name).metadata["choices"]
            _require(getattr(self, name) in allowed, f"sampling.{name}", getattr(self, name),
                     f"must be one of {', '.join(allowed)}")
        if self.kv_budget != "auto":
            try:
                parse_size(self.kv_budget)
            except ValueError as err:
                raise ConfigError(f"sampling.kv_budget: {err}") from None
        self._validate_dynamic()

    def _validate_dynamic(self) -> None:
        _require(not self.dynamic or self.generations_cap >= self.num_generations,
                 "sampling.max_num_generations", self.max_num_generations,
                 f"must be >= sampling.num_generations ({self.num_generations}) with "
                 "sampling.dynamic")

    @property
    def generations_cap(self) -> int:
        """dynamic: the most completions one prompt gets (`max_num_generations`, resolved)."""
        return self.max_num_generations or DYNAMIC_CAP_FACTOR * self.num_generations

    @property
    def chunk_generations(self) -> int:
        """dynamic: completions one round adds to an undecided prompt (resolved)."""
        return self.dynamic_chunk or self.num_generations


@dataclass
class TrainingConfig:
    max_steps: int = opt(90, "optimizer steps to run", above=0)
    prompts_per_step: int = opt(4, "prompts per step; each is sampled G times", above=0)
    learning_rate: float = opt(5e-5, "peak learning rate", at_least=0)
    lr_scheduler: str = opt("constant_with_warmup",
                            "transformers scheduler name (cosine, linear, constant...)")
    warmup_ratio: float = opt(0.05, "fraction of steps spent warming up", at_least=0, below=1)
    weight_decay: float = opt(0.0, "AdamW weight decay", at_least=0)
    adam_beta1: float = opt(0.9, "AdamW beta1", at_least=0, below=1)
    adam_beta2: float = opt(0.99, "AdamW beta2", at_least=0, below=1)
    optimizer: str = opt("adamw", "adamw, adamw8bit (8-bit states: bitsandbytes on CUDA, torchao "
                         "elsewhere and for bf16 weights) or sgd")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (0 = off)", at_least=0)
    loss_type: str = opt("dapo", "loss: grpo, dr_grpo, dapo, bnpo, gspo, cispo "
                                 "(README: when to use which)")
    scale_rewards: str = opt("group", "advantage scaling: group, batch, none")
    beta: float = opt(0.0, "KL coefficient to the reference model (0: no reference)", at_least=0)
    epsilon: float = opt(0.0, "lower clip range of the ratio (0: the loss type's default, "
                              "0.2; gspo 3e-4)", at_least=0)
    epsilon_high: float = opt(0.0, "upper clip range (0: the loss type's default: gspo 4e-4, "
                                   "cispo 5.0 (cispo caps the ratio itself), others = epsilon)",
                               at_least=0)
    mask_truncated_completions: bool = opt(False, "completions cut at sampling.max_new_tokens "
                                                  "carry no loss (DAPO)")
    top_entropy_quantile: float = opt(1.0, "only this top fraction of the step's tokens by "
                                           "entropy carries policy loss (0.2 in 'Beyond the "
                                           "80/20 Rule'; 1.0: all)", above=0, at_most=1,
                                      hint="1.0: every token")
    num_iterations: int = opt(1, "optimisation passes over each sampled batch (mu)", at_least=1)
    train_micro_batch_tokens: int = opt(0,
                                        "tokens per training "
                                        "micro-batch; 0 = auto from the planner", at_least=0)
    chunked_lm_head: bool = opt(True, "log-probs from the final hidden states with the LM head "
                                "applied per chunk (no [tokens x vocabulary] logits); false: the "
                                "model's full logits, as before (more memory; the planner "
                                "assumes true)")
    share_prompt: bool = opt(True, "training forwards each group's prompt once, its completions "
                             "packed behind it with a block attention mask "
                             "(algorithm/shared_prompt.py); same log-probs and gradients. Runs "
                             "unshared where the model's attention takes no custom 4D mask "
                             "(flash_attention_2, kernels hub ids, models without a transformers "
                             "config)")
    seed: int = opt(0, "seed for sampling, shuffling and initialisation")
    num_threads: int = opt(0,
                           "torch CPU threads (0: auto, 1 on CPU for models under 50M parameters)",
                           at_least=0, at_most=4096)
    nonfinite: str = opt("stop", "a NaN/inf loss, gradient norm or reward: stop (one line naming "
                         "step and quantity, nothing applied or saved) or skip the update "
                         "(counted as train/skipped_updates)", choices=("stop", "skip"))
    completions_per_step: int = opt(0, "a fixed sampling budget (needs sampling.dynamic): the "
                                    "step samples at most this many completions, G per prompt "
                                    "first, the rest in chunks to the prompts whose rewards still "
                                    "tie (none to decided ones), so runs compare at equal "
                                    "sampling cost (0: off)", at_least=0, hint="0: off")
    micro_batch_memory: str = opt("total", "memory the planner sizes the training micro-batch "
                                  "for: total (the device's total memory: the same command gives "
                                  "the same weights) or auto (memory free at start: results vary "
                                  "with the machine's load)", choices=("total", "auto"))
    precision: str = opt("auto", "fp32; mixed (fp32 master weights and states, bf16 autocast); "
                         "bf16 (bf16 weights, stochastically rounded updates); bf16_lossy (plain "
                         "AdamW on bf16: loses updates); auto: fp32 on CPU, bf16 on GPU. LoRA "
                         "adapters are fp32 in every mode")

    def validate(self) -> None:
        _require_limits("training", self)
        _check_choice("training.loss_type", self.loss_type, choices.LOSS_TYPES)
        # epsilon / epsilon_high 0 -> the loss type's defaults, written back (config.yaml)
        self.epsilon, self.epsilon_high = choices.clip_range(self.loss_type, self.epsilon,
                                                             self.epsilon_high)
        _check_choice("training.scale_rewards", self.scale_rewards, choices.REWARD_SCALERS)
        _check_choice("training.optimizer", self.optimizer, choices.OPTIMIZERS)
        _require(0 <= self.seed < 2**32, "training.seed", self.seed, "must be in [0, 2**32)")
        _check_choice("training.lr_scheduler", self.lr_scheduler, tuple(choices.LR_SCHEDULERS))
        _check_choice("training.precision", self.precision, choices.PRECISION_CHOICES)


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
        _require_limits("eval", self)


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
        _require_limits("logging", self)
        _check_output_dir(self.output_dir)
        _require(bool(self.project.strip()), "logging.project", self.project,
                 "must name a tracker project")
        problem = choices.tracker_problem(self.report_to)
        _require(problem is None, "logging.report_to", self.report_to, problem or "")


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
        _require_limits("checkpointing", self)
        _require(not self.keep_best or self.keep_best.startswith("eval/"),
                 "checkpointing.keep_best", self.keep_best,
                 "must name an eval.jsonl metric: eval/accuracy, eval/reward or "
                 "eval/rewards/NAME/mean")
        if self.resume not in ("", "latest", "auto"):
            _require(Path(self.resume).is_dir(), "checkpointing.resume", self.resume,
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
        _require_limits("distributed", self)


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
            _require_finite(section.name, getattr(self, section.name))
            _require_bounded(section.name, getattr(self, section.name))
            getattr(self, section.name).validate()
        _require(not self.checkpointing.keep_best or self.eval.num_problems > 0,
                 "checkpointing.keep_best", self.checkpointing.keep_best,
                 "needs evaluations (eval.num_problems > 0)")
        self._validate_sample_budget()
        _require(not (self.distributed.strategy == "fsdp" and self.model.lora_rank > 0),
                 "distributed.strategy", self.distributed.strategy,
                 "fsdp shards full fine-tuning; with LoRA (model.lora_rank > 0) use ddp")
        _require(not (self.sampling.dynamic and self.tools.enabled), "sampling.dynamic",
                 self.sampling.dynamic, "is not yet combined with tools (tools.functions / "
                 "tools.environment_factory): an episode's chunks would need their own "
                 "environments; use one or the other")
        return self

    def _validate_sample_budget(self) -> None:
        budget, first = self.training.completions_per_step, (self.training.prompts_per_step
                                                             * self.sampling.num_generations)
        if not budget:
            return
        _require(self.sampling.dynamic, "training.completions_per_step", budget,
                 "spreads completions by observed spread: set sampling.dynamic true")
        _require(budget >= first, "training.completions_per_step", budget,
                 f"must be >= prompts_per_step x num_generations ({first}): every prompt's "
                 "first chunk")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- helpers


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why} (got {value!r})")


MAX_INTEGER = 2**32 - 1  # every integer option: sizes, counts, steps and seeds fit 32 bits
# problems a task generates per split: 1e5 embedded ones take 1.8 CPU s, 1e4 of reasoning-gym's
# basic_arithmetic 0.9 s (2026-12-02); a million is a minute or two, more never starts
MAX_GENERATED_EXAMPLES = 1_000_000
MAX_DURATION_S = 7 * 24 * 3600.0  # every option in seconds (*_s): the OS's waits take a week


LIMITS = {"at_least": (operator.ge, ">=", "["), "above": (operator.gt, ">", "("),
          "at_most": (operator.le, "<=", "]"), "below": (operator.lt, "<", ")")}


def _require_limits(section_name: str, section: Any) -> None:
    """Each option's own bounds, given beside its help (`opt(..., at_least=0, below=1)`): one
    reads 'must be >= 0', two 'must be in [0, 1)'; `hint` says what a bound value means."""
    for f in dataclasses.fields(section):
        bounds = {name: f.metadata[name] for name in LIMITS if name in f.metadata}
        if not bounds:
            continue
        value, hint = getattr(section, f.name), f.metadata.get("hint")
        if len(bounds) == 2:
            (low_name, low), (high_name, high) = bounds.items()
            why = f"must be in {LIMITS[low_name][2]}{low}, {high}{LIMITS[high_name][2]}"
        else:
            ((name, limit),) = bounds.items()
            why = f"must be {LIMITS[name][1]} {limit}"
        _require(all(LIMITS[name][0](value, limit) for name, limit in bounds.items()),
                 f"{section_name}.{f.name}", value, f"{why} ({hint})" if hint else why)


def _require_bounded(section_name: str, section: Any) -> None:
    """Every integer option within +-MAX_INTEGER, every duration within MAX_DURATION_S: beyond
    them a value is a typo, and the libraries below would overflow or never end."""
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{section_name}.{f.name}"
        if isinstance(value, int) and not isinstance(value, bool):
            _require(abs(value) <= MAX_INTEGER, key, value,
                     f"must be between -{MAX_INTEGER} and {MAX_INTEGER}")
        if f.name.endswith("_s") and isinstance(value, (int, float)):
            _require(value <= MAX_DURATION_S, key, value,
                     f"must be at most {MAX_DURATION_S:.0f} seconds (a week)")


def _require_finite(section_name: str, section: Any) -> None:
    """Every float option (and float list item) is finite: NaN and inf are never settings."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float):
                _require(math.isfinite(item), f"{section_name}.{f.name}", value,
                         "must be a finite number")


VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more (checked with the config)

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(?::\d+)?")


def _check_output_dir(output_dir: str) -> None:
    """The run folder is a folder (or can become one) that we may write."""
    _require(output_dir.strip() != "", "logging.output_dir", output_dir, "must name a folder")
    path = Path(output_dir)
    for link in (p for p in [*reversed(path.parents), path] if p.is_symlink() and not p.exists()):
        raise ConfigError(f"logging.output_dir: {link} is a symbolic link to "
                          f"{os.readlink(link)}, which does not exist (create that folder, or "
                          f"remove the link) (got {output_dir!r})")
    existing = next(p for p in [path, *path.parents] if p.exists())
    _require(existing.is_dir(), "logging.output_dir", output_dir,
             "is a file, not a folder" if existing == path else f"{existing} is a file")
    _require(os.access(existing, os.W_OK | os.X_OK), "logging.output_dir", output_dir,
             f"{existing} is not writable")


def _check_choice(key: str, value: str, names: tuple[str, ...]) -> None:
    _require(value in names, key, value, f"must be one of {', '.join(sorted(names))}")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "t": 1e12, "tb": 1e12, "p": 1e15, "pb": 1e15, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40, "pib": 2**50}


def parse_size(text: str | int) -> int:
    """'2GiB' -> bytes; a bare number stays a number (tokens or bytes, as the caller decides)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read size {text!r} (use e.g. 8192, 512MiB, 2GiB, 24GB)")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"size must be positive (got {text!r})")
    return int(value)


def size_is_bytes(text: str) -> bool:
    """True when a size string carries a unit ('2GiB'), False for a bare token count ('8192')."""
    return bool(re.search(r"[A-Za-z]", str(text)))


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)
