"""Do the weights a precision mode trains follow an fp32 run? Same start, same data, lr 1e-6.

Every mode starts from the embedded checkpoint and takes the same GRPO steps on one fixed rollout
(an embedded-task prompt, its right answer with advantage +1 and a wrong one with -1), through the
project's own path: `load_model_and_tokenizer` in the mode, `build_optimizer`,
`GRPOStep.optimize`.

The measure, `follow_ratio`: with W(t) the weights as the forward pass uses them (bf16 casts in
`mixed` and `bf16`, fp32 in `fp32`) and D = W(T) - W(0) the applied update over T steps,

    follow_ratio = <D_mode, D_fp32> / |D_fp32|^2      (all parameters, float64)

It is 1 when a mode applies the whole fp32 update, the fraction that survives when updates are
rounded away (plain bf16 AdamW), and blind to rounding noise that is independent of the update's
direction (it projects out). It is read after enough steps for the fp32 update to exceed a bf16
rounding step of typical weights (median |w| 0.035: a step of 2.4e-4, i.e. 244 steps of 1e-6),
since compensated updates only reach the bf16 weights once their buffer carries over.

    python benchmarks/precision.py            # modes + both bf16 optimizers, 10/100/300 steps
    python benchmarks/precision.py --steps 10,100 --modes fp32,bf16
    python benchmarks/precision.py --device cuda        # the same on a GPU (wall time per step)
    python benchmarks/precision.py --gemm               # this CPU's matmul speed in fp32 and bf16

Besides the modes, `bf16_kahan` runs torch-optimi's `AdamW(kahan_sum=True)` on bf16 weights: the
alternative to the torchao stochastic rounding that `bf16` uses (how they compare decided it).
Deliberately simple: one process; on the CPU one thread and the process's CPU time per step
(steadier than wall time on a shared machine), on a GPU synchronised wall time; the first step
(torchao compiles there) in wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from infsamp.algorithm.grpo_step import GRPOStep
from infsamp.algorithm.optim import build_optimizer, build_scheduler  # noqa: E402
from infsamp.algorithm.rollout import Rollout
from infsamp.config_io import load_config  # noqa: E402
from infsamp.models.loading import load_model_and_tokenizer  # noqa: E402
from infsamp.models.precision import COMPUTE_DTYPE, resolve_precision  # noqa: E402
from infsamp.planner.precisions import PRECISIONS  # noqa: E402

LEARNING_RATE = 1e-6
PROMPT = "2921+44575=?\n"
RIGHT = "<answer>47496</answer>"
WRONG = "<answer>47396</answer>"
CANDIDATES = {"bf16_kahan": "bf16"}  # extra optimizers compared in a mode's dtypes


def config(mode: str, device: str):
    precision = CANDIDATES.get(mode, mode)
    return load_config(overrides={
        "training.precision": precision, "training.learning_rate": LEARNING_RATE,
        "training.warmup_ratio": 0.0, "training.lr_scheduler": "constant",
        "training.weight_decay": 0.0, "training.max_grad_norm": 1.0, "training.max_steps": 10**6,
        "model.device": device, "eval.num_problems": 0})


def fixed_rollout(tokenizer) -> Rollout:
    prompt = tokenizer(PROMPT, add_special_tokens=False).input_ids
    completions = [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
                   for t in (RIGHT, WRONG)]
    return Rollout(prompt_ids=[prompt, prompt], completion_ids=completions,
                   advantages=torch.tensor([1.0, -1.0]))


def forward_weights(model, mode: str) -> torch.Tensor:
    """All parameters as the forward pass uses them, flattened to float64."""
    cast = torch.float32 if mode == "fp32" else COMPUTE_DTYPE
    return torch.cat([p.detach().to(cast).double().flatten() for p in model.parameters()])


def make_optimizer(model, cfg, precision, mode: str):
    if mode == "bf16_kahan":
        from optimi import AdamW

        params = [p for p in model.parameters() if p.requires_grad]
        betas = (cfg.training.adam_beta1, cfg.training.adam_beta2)
        return AdamW(params, lr=LEARNING_RATE, betas=betas, eps=1e-8, weight_decay=0.0,
                     kahan_sum=True)
    return build_optimizer(model, cfg.training, precision)


def state_bytes(optimizer) -> int:
    tensors = [v for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.numel() > 1]
    return sum(v.numel() * v.element_size() for v in tensors)


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()  # this process's CPU time: steadier than wall time when shared


def train_updates(mode: str, steps: list[int], device: str = "cpu") -> dict:
    """Applied updates D after each count in `steps`, seconds per step, optimizer state bytes."""
    torch.manual_seed(0)
    cfg = config(mode, device)
    where = torch.device(device)
    precision = resolve_precision(cfg, where)
    model, tokenizer = load_model_and_tokenizer(cfg.model, where, precision=precision)
    optimizer = make_optimizer(model, cfg, precision, mode)
    scheduler = build_scheduler(optimizer, cfg.training)
    rollout = fixed_rollout(tokenizer)
    grpo = GRPOStep(model, cfg.training, pad_token_id=tokenizer.pad_token_id, temperature=1.0,
                    max_new_tokens=max(len(c) for c in rollout.completion_ids))
    start, deltas, times, first_wall = forward_weights(model, mode), {}, [], 0.0
    for step in range(1, max(steps) + 1):
        begin, wall = clock(where), time.perf_counter()
        grpo.optimize(rollout, optimizer, scheduler)
        times.append(clock(where) - begin)
        first_wall = time.perf_counter() - wall if step == 1 else first_wall
        if step in steps:
            deltas[step] = forward_weights(model, mode) - start
    steady = times[1:] or times
    return {"deltas": deltas, "first_step_s": first_wall,
            "step_ms": 1000 * sum(steady) / len(steady), "state_bytes": state_bytes(optimizer)}


def follow_ratio(delta: torch.Tensor, reference: torch.Tensor) -> float:
    """<delta, reference> / |reference|^2: the share of the reference update the run applied."""
    return float(delta @ reference / (reference @ reference))


def compare(delta: torch.Tensor, reference: torch.Tensor) -> dict:
    return {"follow_ratio": follow_ratio(delta, reference),
            "relative_error": float((delta - reference).norm() / reference.norm()),
            "changed": float((delta != 0).double().mean())}


def gemm_gflops(dtype: torch.dtype, repeats: int = 3) -> float:
    """Throughput of a 512x1024 @ 1024x1024 matmul on the CPU (one thread), GFLOP/s."""
    a, b = torch.randn(512, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    a @ b
    start = time.process_time()
    for _ in range(repeats):
        a @ b
    return 2 * 512 * 1024 * 1024 * repeats / (time.process_time() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="10,100,300")
    parser.add_argument("--modes", default=",".join([*PRECISIONS, *CANDIDATES]))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--gemm", action="store_true", help="only time fp32 and bf16 matmuls")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.gemm:
        for dtype in (torch.float32, torch.bfloat16):
            print(f"{dtype}: {gemm_gflops(dtype):.2f} GFLOP/s")
        return 0
    steps = [int(s) for s in args.steps.split(",")]
    reference = train_updates("fp32", steps, args.device)
    kind = "GPU" if args.device.startswith("cuda") else "CPU"
    print(f"| mode | steps | follow ratio | relative error | weights changed | {kind} ms/step "
          "| first step wall s | optimizer state MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        result = reference if mode == "fp32" else train_updates(mode, steps, args.device)
        for step in steps:
            row = compare(result["deltas"][step], reference["deltas"][step])
            print(f"| {mode} | {step} | {row['follow_ratio']:.3f} | {row['relative_error']:.3f} | "
                  f"{100 * row['changed']:.1f}% | {result['step_ms']:.0f} | "
                  f"{result['first_step_s']:.1f} | {result['state_bytes'] / 2**20:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
