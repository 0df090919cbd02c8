"""`infsamp plan`: the memory planner on the command line (no torch imported).

    infsamp plan --model llama-3.2-1b --gpu-memory 16GiB --group-size 16 --max-completion 786 --beta 0.04
    infsamp plan --model qwen3-8b --gpu-memory 24GiB --lora-rank 16 --load-in-4bit --precision bf16
    infsamp plan --model qwen3-8b --gpu-memory 24GiB --num-gpus 8 --strategy fsdp   # per device

Flags are read as text and checked here so that every mistake is one error line naming the flag.
"""

from __future__ import annotations

import argparse

from infsamp.config import ConfigError, parse_size, size_is_bytes
from infsamp.choices import OPTIMIZERS, PRECISION_CHOICES, STRATEGIES
from infsamp.planner import PRESETS, load_shape, plan_memory
from infsamp.planner.estimate import DEVICES
from infsamp.planner.report import format_plan

INT_FLAGS = {  # flag -> (default, minimum, help)
    "group-size": ("8", 1, "G: completions per prompt"),
    "max-prompt": ("256", 1, "longest prompt in tokens"),
    "max-completion": ("1024", 1, "longest completion in tokens"),
    "lora-rank": ("0", 0, "LoRA rank (0: full fine-tuning)"),
    "micro-group": ("0", 0, "g to check (0: the largest that fits)"),
    "train-micro-batch-tokens": ("0", 0, "training micro-batch to check, in tokens (0: the largest that fits)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"preset ({', '.join(PRESETS)}), checkpoint directory or config.json")
    parser.add_argument("--gpu-memory", default="24GiB", help="memory of the GPU, e.g. 16GiB, 24GB, 80GiB")
    for flag, (default, _, help_text) in INT_FLAGS.items():
        parser.add_argument(f"--{flag}", default=default, help=f"{help_text} (default {default})")
    parser.add_argument("--optimizer", default="adamw", help=f"{' | '.join(OPTIMIZERS)} (default adamw)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations")
    parser.add_argument("--beta", default="0", help="KL coefficient; > 0 keeps a reference model (default 0)")
    parser.add_argument("--precision", default="auto",
                        help=f"{' | '.join(PRECISION_CHOICES)} (default auto: the trainer's "
                             "default, bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--load-in-4bit", action="store_true",
                        help="QLoRA: NF4 base weights (needs --lora-rank > 0 and cuda)")
    parser.add_argument("--device", default="cuda", help=f"{' | '.join(DEVICES)} (cpu: no CUDA context)")
    parser.add_argument("--engine", default="slots",
                        help="sampling engine: slots | vllm (its weights, pool and graphs count)")
    parser.add_argument("--vllm-sleep", default="on",
                        help="on | off: vLLM frees its pool and weights while training")
    parser.add_argument("--num-gpus", default="1", help="GPUs the run spreads over; every figure "
                        "is then one GPU's (default 1)")
    parser.add_argument("--strategy", default=None,
                        help=f"{' | '.join(STRATEGIES[1:])}: what each GPU holds (default: ddp "
                        "with --num-gpus > 1; see docs/distributed.md)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _read_int(args: argparse.Namespace, flag: str) -> int:
    _, minimum, _ = INT_FLAGS[flag]
    text = getattr(args, flag.replace("-", "_"))
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


def _read_beta(text: str) -> float:
    try:
        beta = float(text)
    except ValueError:
        raise ConfigError(f"--beta: expected a number, got {text!r}") from None
    if not beta >= 0:
        raise ConfigError(f"--beta: must be >= 0 (got {text})")
    return beta


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


def run(args: argparse.Namespace) -> int:
    ints = {flag.replace("-", "_"): _read_int(args, flag) for flag in INT_FLAGS}
    num_devices, strategy = _read_devices(args)
    if ints["micro_group"] > ints["group_size"]:
        raise ConfigError(f"--micro-group: must be <= --group-size {ints['group_size']} (got {ints['micro_group']})")
    plan = plan_memory(
        load_shape(args.model), gpu_memory_bytes=_read_memory(args.gpu_memory),
        optimizer=_read_choice(args.optimizer, "optimizer", OPTIMIZERS),
        precision=_read_choice(args.precision, "precision", PRECISION_CHOICES),
        device=_read_choice(args.device, "device", DEVICES),
        load_in_4bit=_read_4bit(args, ints["lora_rank"]),
        gradient_checkpointing=args.gradient_checkpointing, beta=_read_beta(args.beta),
        engine=_read_choice(args.engine, "engine", ("slots", "vllm")),
        engine_sleep=_read_choice(args.vllm_sleep, "vllm-sleep", ("on", "off")) == "on",
        num_devices=num_devices, strategy=strategy, **ints)
    print(plan.to_json() if args.json else format_plan(plan))
    return 0
