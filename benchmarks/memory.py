"""Measure the real peak memory of sampling and of one training step, and compare it to the planner.

Each (case, phase) runs in a fresh subprocess. On the CPU the peak is the process's peak resident
set (VmHWM, reset through /proc/self/clear_refs after imports) minus the resident set after imports;
on a GPU it is torch.cuda.max_memory_allocated minus what was allocated before. Models are built
from configs with random weights (no download): the embedded tiny Llama and real shapes (some with
fewer layers).

    python benchmarks/memory.py                 # all CPU cases, markdown table on stdout
    python benchmarks/memory.py --quick         # the small CPU cases only (~1 minute)
    python benchmarks/memory.py --device cuda   # GPU: qwen3-0.6b and qwen3-1.7b shapes in bf16
    python benchmarks/memory.py --case embedded --phase train   # one measurement
    python benchmarks/memory.py --quick --precision fp32,mixed,bf16   # each precision mode
    python benchmarks/memory.py --device cuda --precision all         # GPU, with the QLoRA case

Sampling goes through the project's GroupSampler (continuous policy, g slots, shared prompt KV,
every completion forced to max length by disabling EOS). The training step lives in
`measure_training_step`: token-budget micro-batches of infsamp.algorithm.logprobs, the GRPO loss of
infsamp.algorithm.losses, backward, and the optimizer the trainer builds for the precision mode
(`build_optimizer`); the model is built in the mode's dtype with its compute context
(`apply_compute`), as `load_model_and_tokenizer` does.

Deliberately simple: one prompt per step; completions all of maximum length (the worst case the
planner sizes for); random token ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from infsamp.planner import load_shape, plan_memory, with_layers  # noqa: E402
from infsamp.planner.presets import ModelShape, shape_from_config  # noqa: E402

from peak_meter import PeakMeter  # noqa: E402  (benchmarks/)

MIB = 2**20
NO_LIMIT = 2**50
# glibc raises its mmap threshold after large frees and then keeps freed tensors in the heap, so the
# resident set tracks the allocator's history, not the live tensors; a fixed threshold returns them.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@dataclass(frozen=True)
class Case:
    model: str  # preset name or 'embedded'
    layers: int = 0  # 0: the preset's own layer count
    group_size: int = 8  # G
    micro_group: int = 8  # g (sampling)
    max_prompt: int = 64
    max_completion: int = 128
    train_sequences: int = 2  # sequences per training micro-batch
    quick: bool = False
    device: str = "cpu"
    lora_rank: int = 0
    load_in_4bit: bool = False  # QLoRA (CUDA and bitsandbytes only)

    @property
    def train_micro_batch_tokens(self) -> int:
        return self.train_sequences * (self.max_prompt + self.max_completion)



CASES: dict[str, Case] = {
    "embedded": Case("embedded", group_size=32, micro_group=32, max_prompt=32, max_completion=128,
                     train_sequences=8, quick=True),
    "qwen3-0.6b-2l": Case("qwen3-0.6b", layers=2, group_size=8, micro_group=8, max_prompt=64,
                          max_completion=16, train_sequences=4, quick=True),
    "llama-3.2-1b-2l": Case("llama-3.2-1b", layers=2, group_size=8, micro_group=8, max_prompt=128,
                            max_completion=16, train_sequences=4),
    "qwen2.5-0.5b-8l": Case("qwen2.5-0.5b", layers=8, group_size=8, micro_group=8, max_prompt=256,
                            max_completion=16, train_sequences=4),
    "qwen3-0.6b-8l": Case("qwen3-0.6b", layers=8, group_size=8, micro_group=8, max_prompt=256,
                          max_completion=16, train_sequences=4),
    "qwen3-0.6b": Case("qwen3-0.6b", group_size=4, micro_group=4, max_prompt=128, max_completion=16,
                       train_sequences=2),
    # Qwen3's vocabulary on a 9.8M-parameter Llama: the LM head dominates (issue 20)
    "qwen3-vocab-h64": Case("qwen3-vocab-h64", group_size=32, micro_group=16, max_prompt=48,
                            max_completion=256, train_sequences=13, quick=True),
    "gpu-qwen3-0.6b": Case("qwen3-0.6b", group_size=32, micro_group=32, max_prompt=256,
                           max_completion=1024, train_sequences=8, device="cuda"),
    "gpu-qwen3-1.7b": Case("qwen3-1.7b", group_size=32, micro_group=32, max_prompt=256,
                           max_completion=1024, train_sequences=4, device="cuda"),
    "gpu-qwen3-1.7b-qlora": Case("qwen3-1.7b", group_size=32, micro_group=32, max_prompt=256,
                                 max_completion=1024, train_sequences=4, device="cuda",
                                 lora_rank=16, load_in_4bit=True),
}
PRECISION_MODES = ("fp32", "mixed", "bf16")  # --precision all (bf16_lossy has bf16's bytes)
PHASES = ("sample", "train")
MICRO_CASE = Case("micro", group_size=2, micro_group=2, max_prompt=4, max_completion=4,
                  train_sequences=1)
MICRO_SHAPE = ModelShape("micro", 64, 128, 1, 2, 1, 32, 256, True, 2048)
SHAPES = {  # shapes that are no preset: a random model of each is built
    "micro": MICRO_SHAPE,
    "qwen3-vocab-h64": ModelShape("qwen3-vocab-h64", 64, 192, 2, 4, 2, 16, 151936, True, 2048),
}


# --- models (child process only: torch is imported lazily) ----------------------------------------


def case_shape(case: Case) -> ModelShape:
    if case.model in SHAPES:
        return SHAPES[case.model]
    if case.model == "embedded":
        return embedded_shape()
    shape = load_shape(case.model)
    return with_layers(shape, case.layers) if case.layers else shape


def embedded_shape() -> ModelShape:
    checkpoint = ROOT / "src/infsamp/models/embedded"
    if (checkpoint / "config.json").exists():
        return load_shape(str(checkpoint))
    from infsamp.models.tiny import build_tokenizer, model_config

    return shape_from_config(model_config(build_tokenizer()), name="embedded")


def hf_config(shape: ModelShape):
    """A transformers config of the shape's family (Qwen3: qk-norm, Qwen2: q/k/v bias, else
    Llama)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    family = Qwen3Config if shape.qk_norm else Qwen2Config if shape.attention_bias else LlamaConfig
    extra = {} if family is Qwen2Config else {"head_dim": shape.head_dim}
    return family(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                  intermediate_size=shape.intermediate_size,
                  num_hidden_layers=shape.num_hidden_layers,
                  num_attention_heads=shape.num_attention_heads,
                  num_key_value_heads=shape.num_key_value_heads,
                  max_position_embeddings=shape.max_position_embeddings,
                  tie_word_embeddings=shape.tie_word_embeddings, eos_token_id=None,
                  bos_token_id=None, pad_token_id=0, **extra)


def build_model(case: Case, precision: str):
    """Random weights in the mode's dtype, LoRA / 4-bit as the case says, its compute context."""
    import torch
    from transformers import AutoModelForCausalLM

    from infsamp.config import ModelConfig
    from infsamp.models.loading import apply_lora, weight_kwargs
    from infsamp.models.precision import apply_compute
    from infsamp.planner import PRECISIONS

    mode = PRECISIONS[precision]
    model_cfg = ModelConfig(lora_rank=case.lora_rank, load_in_4bit=case.load_in_4bit)
    kwargs = weight_kwargs(model_cfg, torch.device(case.device), mode)
    torch.manual_seed(0)
    config = hf_config(case_shape(case))
    config._attn_implementation = "sdpa"
    if case.load_in_4bit:  # bitsandbytes quantises while loading a checkpoint
        import tempfile

        folder = tempfile.mkdtemp()
        AutoModelForCausalLM.from_config(config, dtype=kwargs["dtype"]).save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=kwargs["dtype"]).to(case.device)
    model.config.eos_token_id = None  # completions run to max length: the worst case
    if case.lora_rank:
        model = apply_lora(model, model_cfg)
    return apply_compute(model, mode)


# --- the two measured phases ----------------------------------------------------------------------


def measure_sampling(model, case: Case) -> None:
    """G completions of one prompt, g at a time, through the project's sampler."""
    import torch

    from infsamp.config_algorithm import SamplingConfig
    from infsamp.sampling.sampler import GroupSampler

    prompt = torch.randint(1, model.config.vocab_size, (case.max_prompt,)).tolist()
    cfg = SamplingConfig(num_generations=case.group_size, policy="continuous",
                         micro_group=case.micro_group,
                         kv_budget=str(10**9), max_new_tokens=case.max_completion)
    GroupSampler(model, None, cfg).sample([prompt], case.group_size)


def random_sequences(vocab_size: int, num: int, prompt_len: int, completion_len: int):
    import torch

    prompts = torch.randint(1, vocab_size, (num, prompt_len)).tolist()
    completions = torch.randint(1, vocab_size, (num, completion_len)).tolist()
    return prompts, completions


def measure_training_step(model, optimizer, prompts, completions, *, max_tokens: int,
                          max_completion: int) -> None:
    """One GRPO optimizer step over token-budget micro-batches (the lead may swap in the trainer's
    step)."""
    import torch

    from infsamp.algorithm.logprobs import build_micro_batches, micro_batch_logprobs
    from infsamp.algorithm.losses import LOSS_TYPES, BatchTotals, per_token_loss

    device = next(model.parameters()).device
    advantages = torch.randn(len(completions), device=device)  # [N]
    totals = BatchTotals.from_lengths([len(c) for c in completions], max_completion)
    for mb in build_micro_batches(prompts, completions, max_tokens=max_tokens, pad_token_id=0,
                                  device=device):
        logps = micro_batch_logprobs(model, mb)  # [b, T_c]
        loss, _ = per_token_loss(logps, None, None, mb.rows(advantages), epsilon_low=0.2,
                                 epsilon_high=0.2, beta=0.0, mask=mb.completion_mask)
        LOSS_TYPES["dapo"].aggregate(loss, mb.completion_mask, totals).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_child(name: str, phase: str, precision: str) -> dict:
    case = CASES[name]
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    import transformers  # noqa: F401

    import infsamp.algorithm.logprobs  # noqa: F401  (imports before the baseline)
    import infsamp.sampling.sampler  # noqa: F401

    micro = dataclasses.replace(MICRO_CASE, device=case.device)
    run_phase(micro, phase, PeakMeter(case.device), precision)  # lazy imports before the baseline
    gc.collect()
    meter = PeakMeter(case.device)
    start = time.perf_counter()
    run_phase(case, phase, meter, precision)
    # the whole process: the runtime in use before the model (no tensors alive) and the peak
    runtime = meter.baseline if case.device == "cpu" else None
    return {"measured_bytes": meter.peak(), "seconds": round(time.perf_counter() - start, 1),
            "runtime_bytes": runtime,
            "whole_bytes": meter.peak() + meter.baseline if runtime is not None else None}


def run_phase(case: Case, phase: str, meter: PeakMeter, precision: str) -> None:
    model = build_model(case, precision)
    # random init briefly holds a second copy of some weights: not part of either phase
    meter.reset()
    if phase == "sample":
        measure_sampling(model, case)
    else:
        train_phase(model, case, meter, precision)


def train_phase(model, case: Case, meter: PeakMeter, precision: str) -> None:
    """A warm-up step on one short sequence creates the optimizer states (and compiles torchao's
    step); then the measured step."""
    from infsamp.algorithm.optim import build_optimizer
    from infsamp.config_algorithm import TrainingConfig
    from infsamp.planner import PRECISIONS

    model.train()
    optimizer = build_optimizer(model, TrainingConfig(learning_rate=1e-5), PRECISIONS[precision])
    vocab = model.config.vocab_size
    measure_training_step(model, optimizer, *random_sequences(vocab, 1, 4, 4), max_tokens=8,
                          max_completion=4)
    meter.reset()
    prompts, completions = random_sequences(vocab, case.group_size, case.max_prompt,
                                            case.max_completion)
    measure_training_step(model, optimizer, prompts, completions,
                          max_tokens=case.train_micro_batch_tokens,
                          max_completion=case.max_completion)


# --- planner side and the table -------------------------------------------------------------------


def planned_bytes(case: Case, phase: str, precision: str, runtime_bytes: int | None = None) -> int:
    """The planner's peak for what the child runs (no optimizer state while sampling alone):
    its tensors (measured above the post-import baseline), or with `runtime_bytes` (that
    baseline) the whole process."""
    plan = plan_memory(case_shape(case), gpu_memory_bytes=NO_LIMIT, num_generations=case.group_size,
                       max_prompt_tokens=case.max_prompt, max_new_tokens=case.max_completion,
                       micro_group=case.micro_group,
                       train_micro_batch_tokens=case.train_micro_batch_tokens,
                       optimizer="adamw", precision=precision, device=case.device,
                       lora_rank=case.lora_rank, load_in_4bit=case.load_in_4bit,
                       runtime_bytes=runtime_bytes or 0)
    parts = plan.generation if phase == "sample" else plan.training
    absent = parts["optimizer"] if phase == "sample" else 0  # sampling alone builds no optimizer
    # torch.cuda.max_memory_allocated excludes the CUDA context and the allocator's slack
    return parts["peak"] - absent - (parts["overhead"] if case.device == "cuda" else 0)


def default_precision(case: Case) -> str:
    return "bf16" if case.device == "cuda" else "fp32"


def measure(name: str, phase: str, precision: str, default_malloc: bool = False) -> dict:
    """Run one measurement in a fresh interpreter."""
    command = [sys.executable, __file__, "--child", "--case", name, "--phase", phase,
               "--precision", precision]
    env = {**os.environ, **({} if default_malloc else FIXED_MMAP_THRESHOLD)}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe(case: Case, phase: str) -> str:
    if phase == "sample":
        return (f"G={case.group_size}, g={case.micro_group}, P={case.max_prompt}, "
                f"C={case.max_completion}")
    return (f"{case.group_size} seqs of {case.max_prompt}+{case.max_completion}, "
            f"micro-batch {case.train_micro_batch_tokens} tok")


def table_row(name: str, phase: str, precision: str, result: dict) -> str:
    case = CASES[name]
    shape = case_shape(case)
    from infsamp.planner.presets import count_parameters

    params = f"{count_parameters(shape) / 1e6:.1f}M"
    planned = planned_bytes(case, phase, precision)
    start = f"| {name} | {params} | {precision} | {phase} | {describe(case, phase)} |"
    if "error" in result:
        return f"{start} error: {result['error']} | | | |"
    measured = result["measured_bytes"]
    error = 100.0 * (planned - measured) / measured
    whole = ""
    if result.get("whole_bytes"):
        planned_whole = planned_bytes(case, phase, precision, result["runtime_bytes"])
        whole_error = 100.0 * (planned_whole - result["whole_bytes"]) / result["whole_bytes"]
        whole = (f" {result['whole_bytes'] / MIB:,.0f} | {planned_whole / MIB:,.0f} | "
                 f"{whole_error:+.1f}% |")
    return (f"{start} {measured / MIB:,.0f} | {planned / MIB:,.0f} | {error:+.1f}% |{whole} "
            f"{result['seconds']} |")


def precisions_for(case: Case, choice: str) -> list[str]:
    """'' -> the device's default; 'all' -> every mode (QLoRA cases: the bf16-compute ones)."""
    if not choice:
        return [default_precision(case)]
    modes = list(PRECISION_MODES) if choice == "all" else choice.split(",")
    return [m for m in modes if not (case.load_in_4bit and m == "fp32")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small CPU cases only")
    parser.add_argument("--case", choices=sorted(CASES), help="one case")
    parser.add_argument("--phase", choices=PHASES, help="one phase")
    parser.add_argument("--precision", default="",
                        help="comma-separated modes (fp32, mixed, bf16, bf16_lossy) or all; "
                             "default: the device's default (cpu fp32, cuda bf16)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's adaptive mmap threshold (resident "
                             "set then includes freed heap)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.case, args.phase, args.precision)))
        return 0
    names = [args.case] if args.case else [n for n, c in CASES.items()
                                           if c.device == args.device
                                           and (c.quick or not args.quick)]
    whole = " whole process MiB | planned MiB | error |" if args.device == "cpu" else ""
    print("| case | params | precision | phase | setting | measured MiB | planned MiB | error |"
          f"{whole} s |")
    print("|---|---|---|---|---|---|---|---|" + ("---|---|---|" if whole else "") + "---|")
    for name in names:
        for precision in precisions_for(CASES[name], args.precision):
            for phase in [args.phase] if args.phase else PHASES:
                result = measure(name, phase, precision, args.default_malloc)
                print(table_row(name, phase, precision, result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
