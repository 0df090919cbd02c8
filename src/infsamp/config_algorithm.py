"""The algorithm's options: how completions are sampled (`SamplingConfig`, `sampling.*`) and how
the GRPO step trains on them (`TrainingConfig`, `training.*`); two sections of the tree in
`config.py`, checked the same way (`options.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from infsamp import choices
from infsamp.options import (
    ConfigError,
    check_choice,
    opt,
    parse_size,
    require,
    require_limits,
)

DYNAMIC_CAP_FACTOR = 4  # sampling.max_num_generations 0: this many times num_generations
VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more (checked with the config)


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
    probe_tokens: int = opt(choices.PROBE_TOKENS, "probe: KV tokens a new sample first "
                            "reserves; at that many tokens it is given its whole reservation, "
                            "or parked (KV dropped)", at_least=1)
    refill: str = opt("auto", "runtime refill order for length_aware: auto (= ljf, measured "
                      "best), sjf, ljf")
    grouping_epsilon: float = opt(0.1, "FPTAS epsilon of the global grouping (smaller: closer to "
                                  "optimal)", above=0)
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
        require_limits("sampling", self)
        require(self.num_generations >= 2, "sampling.num_generations", self.num_generations,
                 "must be >= 2 (GRPO compares samples within a group)")
        require(self.engine != "vllm" or self.temperature <= VLLM_MAX_TEMPERATURE,
                 "sampling.temperature", self.temperature,
                 f"must be <= {VLLM_MAX_TEMPERATURE:g} with sampling.engine vllm (vLLM's limit); "
                 "sampling.engine slots samples at any temperature")
        check_choice("sampling.policy", self.policy, choices.POLICIES)
        require(self.predictor in choices.TRAINING_PREDICTORS, "sampling.predictor",
                 self.predictor, f"must be {' or '.join(choices.TRAINING_PREDICTORS)} (oracle "
                 "and noisy know the true lengths: bench and simulate only)")
        check_choice("sampling.refill", self.refill, ("auto", *choices.REFILL_ORDERS))
        if self.kv_budget != "auto":
            try:
                parse_size(self.kv_budget)
            except ValueError as err:
                raise ConfigError(f"sampling.kv_budget: {err}") from None
        require(not self.dynamic or self.generations_cap >= self.num_generations,
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
    train_micro_batch_tokens: int = opt(0, "tokens per training micro-batch; 0 = auto from the "
                                        "planner", at_least=0)
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
    num_threads: int = opt(0, "torch CPU threads (0: auto, 1 on CPU for models under 50M "
                           "parameters)", at_least=0, at_most=4096)
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
        require_limits("training", self)
        check_choice("training.loss_type", self.loss_type, choices.LOSS_TYPES)
        # epsilon / epsilon_high 0 -> the loss type's defaults, written back (config.yaml)
        self.epsilon, self.epsilon_high = choices.clip_range(self.loss_type, self.epsilon,
                                                             self.epsilon_high)
        check_choice("training.scale_rewards", self.scale_rewards, choices.REWARD_SCALERS)
        check_choice("training.optimizer", self.optimizer, choices.OPTIMIZERS)
        require(0 <= self.seed < 2**32, "training.seed", self.seed, "must be in [0, 2**32)")
        check_choice("training.lr_scheduler", self.lr_scheduler, tuple(choices.LR_SCHEDULERS))
        check_choice("training.precision", self.precision, choices.PRECISION_CHOICES)
