"""`infsamp plan`: the memory planner on the command line (no torch imported).

    infsamp plan --model llama-3.2-1b --gpu-memory 16GiB --num-generations 16 \
        --max-completion 786 --beta 0.04
    infsamp plan --model qwen3-8b --gpu-memory 24GiB --lora-rank 16 --load-in-4bit --precision bf16
    infsamp plan --model qwen3-8b --gpu-memory 24GiB --num-gpus 8 --strategy fsdp   # per device

The run's sizes come from `planner.sizes.plan_run_sizes`, the function `infsamp train` calls,
on a config built from these flags; every flag's default is the config's (`infsamp train`'s), so
the plan of a command without flags is the plan of `infsamp train` without flags on that GPU.
Flags are read as text and checked here so that every mistake is one error line naming the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from infsamp.choices import OPTIMIZERS, POLICIES, PRECISION_CHOICES, STRATEGIES
from infsamp.config import Config
from infsamp.options import ConfigError, parse_size, size_is_bytes
from infsamp.planner import PRESETS, load_shape
from infsamp.planner.estimate import DEVICES
from infsamp.planner.report import format_plan
from infsamp.planner.sizes import ENGINE_CHOICES, plan_run_sizes

DEFAULTS = Config()
INT_FLAGS = {  # flag -> (default, minimum, help): the defaults of `infsamp train`
    "num-generations": (DEFAULTS.sampling.num_generations, 1, "G: completions per prompt"),
    "prompts-per-step": (DEFAULTS.training.prompts_per_step, 1,
                         "B: prompts per step (split between the GPUs)"),
    "max-prompt": (DEFAULTS.data.max_prompt_length, 1, "longest prompt in tokens"),
    "max-completion": (DEFAULTS.sampling.max_new_tokens, 1, "longest completion in tokens"),
    "lora-rank": (DEFAULTS.model.lora_rank, 0, "LoRA rank (0: full fine-tuning)"),
    "micro-group": (DEFAULTS.sampling.micro_group, 0,
                    "g: samples decoded at once (0: the largest that fits)"),
    "train-micro-batch-tokens": (DEFAULTS.training.train_micro_batch_tokens, 0,
                                 "training micro-batch to check, in tokens (0: the largest "
                                 + "that fits)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"preset ({', '.join(PRESETS)}), checkpoint directory or config.json")
    parser.add_argument("--gpu-memory", default="24GiB",
                        help="memory of the GPU, e.g. 16GiB, 24GB, 80GiB")
    for flag, (default, _, help_text) in INT_FLAGS.items():
        names = [f"--{flag}", "-G"] if flag == "num-generations" else [f"--{flag}"]
        parser.add_argument(*names, default=None, help=f"{help_text} (default {default})")
    parser.add_argument("--kv-budget", default=DEFAULTS.sampling.kv_budget,
                        help="KV-cache budget: tokens (8192), bytes ('2GiB') or auto (default: "
                             "what g needs)")
    parser.add_argument("--policy", default=DEFAULTS.sampling.policy,
                        help=f"sampling policy: {' | '.join(POLICIES)} (default "
                             f"{DEFAULTS.sampling.policy}); it decides what the engine allocates")
    parser.add_argument("--optimizer", default="adamw",
                        help=f"{' | '.join(OPTIMIZERS)} (default adamw)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute activations")
    parser.add_argument("--beta", default="0",
                        help="KL coefficient; > 0 keeps a reference model (default 0)")
    parser.add_argument("--precision", default="auto",
                        help=f"{' | '.join(PRECISION_CHOICES)} (default auto: the trainer's "
                             "default, bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--load-in-4bit", action="store_true",
                        help="QLoRA: NF4 base weights (needs --lora-rank > 0 and cuda)")
    parser.add_argument("--device", default="cuda",
                        help=f"{' | '.join(DEVICES)} (cpu: no CUDA context)")
    parser.add_argument("--engine", default=DEFAULTS.sampling.engine,
                        help="sampling engine: slots | vllm (its weights, pool and graphs count) | "
                             "auto (default, as infsamp train: vllm where it is installed and "
                             "--device is cuda)")
    parser.add_argument("--temperature", default=str(DEFAULTS.sampling.temperature),
                        help="sampling temperature; above vLLM's limit auto decodes on the slot "
                             f"engine (default {DEFAULTS.sampling.temperature})")
    parser.add_argument("--vllm-sleep", default="on",
                        help="on | off: vLLM frees its pool and weights while training")
    parser.add_argument("--num-gpus", default="1", help="GPUs the run spreads over; every figure "
                        "is then one GPU's (default 1)")
    parser.add_argument("--strategy", default=None,
                        help=f"{' | '.join(STRATEGIES[1:])}: what each GPU holds (default: ddp "
                        "with --num-gpus > 1; see docs/distributed.md)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _read_int(args: argparse.Namespace, flag: str) -> int:
    default, minimum, _ = INT_FLAGS[flag]
    text = getattr(args, flag.replace("-", "_"))
    if text is None:
        return default
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"--{flag}: expected an integer, got {text!r}") from None
    if value < minimum:
        raise ConfigError(f"--{flag}: must be >= {minimum} (got {value})")
    return value


def _read_memory(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as err:
        raise ConfigError(f"--gpu-memory: {err}") from None
    if not size_is_bytes(text):
        raise ConfigError(f"--gpu-memory: give a unit, e.g. {text}GiB (got {text!r})")
    return size


def _read_choice(text: str, flag: str, choices) -> str:
    if text not in choices:
        raise ConfigError(f"--{flag}: must be one of {', '.join(choices)} (got {text!r})")
    return text


def _read_non_negative(text: str, flag: str) -> float:
    """A number flag that must be >= 0 (--beta, --temperature)."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--{flag}: expected a number, got {text!r}") from None
    if not value >= 0:
        raise ConfigError(f"--{flag}: must be >= 0 (got {text})")
    return value


def _read_devices(args: argparse.Namespace) -> tuple[int, str]:
    """(--num-gpus, --strategy): the strategy is ddp or fsdp; one GPU alone plans as one device."""
    text = str(args.num_gpus).strip()
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"--num-gpus: expected an integer >= 1, got {args.num_gpus!r}")
    num = int(text)
    if args.strategy is None:
        return num, "single" if num == 1 else "ddp"
    return num, _read_choice(args.strategy, "strategy", STRATEGIES[1:])


def _read_4bit(args: argparse.Namespace, lora_rank: int) -> bool:
    if args.load_in_4bit and lora_rank == 0:
        raise ConfigError("--load-in-4bit: trains LoRA adapters over the 4-bit base: "
                          "add --lora-rank 16")
    if args.load_in_4bit and args.device != "cuda":
        raise ConfigError("--load-in-4bit: bitsandbytes 4-bit needs --device cuda")
    return bool(args.load_in_4bit)


def _read_kv_budget(text: str) -> str:
    if text != "auto":
        try:
            parse_size(text)
        except ValueError as err:
            raise ConfigError(f"--kv-budget: {err}") from None
    return text


def run_config(args: argparse.Namespace, ints: dict[str, int]) -> Config:
    """The config `infsamp train` would run with these flags (the others at their defaults)."""
    micro_group = ints["micro_group"]
    num_samples = ints["num_generations"] * ints["prompts_per_step"]
    if args.micro_group is not None and micro_group > num_samples:
        raise ConfigError(f"--micro-group: must be <= --num-generations x --prompts-per-step "
                          f"{num_samples} (got {micro_group})")
    sampling = replace(DEFAULTS.sampling, num_generations=ints["num_generations"],
                       max_new_tokens=ints["max_completion"], micro_group=micro_group,
                       kv_budget=_read_kv_budget(args.kv_budget),
                       policy=_read_choice(args.policy, "policy", POLICIES),
                       engine=_read_choice(args.engine, "engine", ENGINE_CHOICES),
                       temperature=_read_non_negative(args.temperature, "temperature"),
                       vllm_sleep="auto" if args.vllm_sleep == "on" else "off")
    sampling.validate()  # as train refuses it: e.g. --engine vllm past vLLM's temperature limit
    training = replace(DEFAULTS.training, prompts_per_step=ints["prompts_per_step"],
                       train_micro_batch_tokens=ints["train_micro_batch_tokens"],
                       optimizer=_read_choice(args.optimizer, "optimizer", OPTIMIZERS),
                       beta=_read_non_negative(args.beta, "beta"),
                       precision=_read_choice(args.precision, "precision", PRECISION_CHOICES))
    model = replace(DEFAULTS.model, lora_rank=ints["lora_rank"],
                    gradient_checkpointing=args.gradient_checkpointing,
                    load_in_4bit=_read_4bit(args, ints["lora_rank"]))
    return replace(DEFAULTS, sampling=sampling, training=training, model=model,
                   data=replace(DEFAULTS.data, max_prompt_length=ints["max_prompt"]))


def run(args: argparse.Namespace) -> int:
    ints = {flag.replace("-", "_"): _read_int(args, flag) for flag in INT_FLAGS}
    num_devices, strategy = _read_devices(args)
    _read_choice(args.device, "device", DEVICES)
    _read_choice(args.vllm_sleep, "vllm-sleep", ("on", "off"))
    cfg = run_config(args, ints)
    plan, sizes = plan_run_sizes(cfg, load_shape(args.model), _read_memory(args.gpu_memory),
                                 device=args.device, quantized=cfg.model.load_in_4bit,
                                 num_ranks=num_devices, strategy=strategy)
    print(plan.to_json(sizes=sizes) if args.json else format_plan(plan, sizes))
    return 0
