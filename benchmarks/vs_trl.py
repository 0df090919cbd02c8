"""infsamp vs TRL's GRPOTrainer: peak memory and seconds per optimizer step at G = 8, 32, 64, on the
CPU.

    .venv/bin/python benchmarks/vs_trl.py --groups 8,32,64 --steps 2 --hidden 256 --layers 4 \
        --max-completion 128 --out /tmp/vs_trl.json
    .venv/bin/python benchmarks/vs_trl.py --frameworks trl,trl_infsamp --trl-batch 8  # the plug-in
    .venv/bin/python benchmarks/vs_trl.py --quick          # G=8, 1 measured step: a smoke check

Three frameworks: `trl` (TRL's own generation), `trl_infsamp` (the same TRL trainer with
`infsamp.integrations.trl.infsamp_rollout` as its `rollout_func`: continuous policy, g slots, a
KV budget of g x (prompt + completion) tokens) and `infsamp` (infsamp's own trainer).
`--trl-batch B` trains TRL in micro-batches of B completions (gradient accumulation over G / B,
still one optimizer step per prompt), so what still grows with G in TRL is its generation; 0
keeps TRL's default of all G at once.

Both frameworks train the SAME random-init Llama (built once and saved to a temp dir, or `--model
PATH`) on the same prompts (the embedded arithmetic task), with the same rewards (`format_reward`,
`accuracy_reward`), G, max completion length, temperature 1.0, learning rate, one prompt per step,
beta 0, fp32 on CPU, gradient checkpointing on in both (TRL 1.16's GRPOConfig default; `off` for
neither). TRL runs its default layout: one generation batch of G completions, one forward/
backward over all of them (per_device_train_batch_size=G, steps_per_generation=1). infsamp runs the
continuous policy with a fixed micro group g and token-budget training micro-batches.

Each (framework, G) case runs in a fresh subprocess. After model load and one warm-up step
(optimizer state allocated, lazy imports done) the process's resident set is the baseline and VmHWM
is reset through /proc/self/clear_refs; "peak MiB" is VmHWM at the end minus that baseline.
"generation peak MiB" is the largest VmHWM growth during one step's generation (TRL's `_generate`,
which calls the rollout_func when one is given; infsamp's sampler call) above the resident set at
its start. glibc's malloc is told to give large blocks back (MALLOC_MMAP_THRESHOLD_) in both, so a
freed warm-up peak is not counted as baseline. Seconds per step: median over `--steps` measured
steps.

Deliberately simple: CPU only, one prompt per step, no KL (beta 0, so no reference model on either
side).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import datetime
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/ (also when loaded by file path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_memory import peak_resident_bytes, reset_peak, resident_bytes  # noqa: E402

RESULT_PREFIX = "VS_TRL_RESULT "
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
NUM_PROMPTS = 64
MAX_PROMPT_TOKENS = 32  # arithmetic prompts are < 32 characters (one token each)
PROFILE_FUNCTIONS = {  # label -> (file suffix, function name) whose cumulative time is reported
    "sampling": ("sampling/sampler.py", "sample"),
    "rewards": ("run/trainer.py", "_score"),
    "train: log-prob forward": ("algorithm/logprobs.py", "micro_batch_logprobs"),
    "train: backward": ("torch/_tensor.py", "backward"),
    "train: optimizer": ("torch/optim/optimizer.py", "wrapper"),
    "train: whole grpo step": ("algorithm/grpo_step.py", "optimize"),
}


# ---------------------------------------------------------------- memory


class PeakRss:
    """Peak resident-set growth (bytes) above the resident set at `start()`; `phase` also measures
    one call's own peak above the resident set at its start (the run-wide peak is kept)."""

    def __init__(self):
        self.baseline = 0
        self.earlier_peak = 0  # VmHWM before a phase measurement reset it
        self.phase_peaks: list[int] = []

    def start(self) -> None:
        import gc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.baseline = resident_bytes()
        self.earlier_peak = 0
        reset_peak()

    def peak_bytes(self) -> int:
        return max(self.earlier_peak, peak_resident_bytes()) - self.baseline

    def phase(self, fn):
        """`fn` wrapped: once started, each call's VmHWM growth goes to `phase_peaks`."""
        def measured(*args, **kwargs):
            if not self.baseline:  # the warm-up step
                return fn(*args, **kwargs)
            self.earlier_peak = max(self.earlier_peak, peak_resident_bytes())
            before = resident_bytes()
            reset_peak()
            result = fn(*args, **kwargs)
            self.phase_peaks.append(peak_resident_bytes() - before)
            return result
        return measured


# ---------------------------------------------------------------- shared setup


def build_random_llama(out_dir: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """A random Llama with the embedded character tokenizer, saved as an HF checkpoint; returns its
    dir."""
    import torch
    from transformers import LlamaForCausalLM

    from infsamp.models.tiny import build_tokenizer, model_config

    tokenizer = build_tokenizer()
    config = model_config(tokenizer)
    head_dim = 32 if hidden <= 128 else 64
    num_heads = max(1, hidden // head_dim)
    config.update({"hidden_size": hidden, "intermediate_size": 3 * hidden,
                   "num_hidden_layers": layers,
                   "num_attention_heads": num_heads, "num_key_value_heads": max(1, num_heads // 2),
                   "head_dim": head_dim})
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def resolve_model(args, tmp: Path) -> Path:
    if args.model:
        from infsamp.models.loading import resolve_path

        return Path(resolve_path(args.model))
    return build_random_llama(tmp / "model", args.hidden, args.layers)


def count_parameters(model_dir: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def reward_functions():
    from infsamp.rewards.builtin import accuracy_reward, format_reward

    return [format_reward, accuracy_reward]


def train_problems(num: int) -> list[dict]:
    from infsamp.tasks.arithmetic import generate_problems

    return [{"prompt": p["prompt"], "answer": p["answer"]}
            for p in generate_problems(num, 1234, "train")]


# ---------------------------------------------------------------- TRL worker


def trl_config(args, G: int, out_dir: Path):
    from trl import GRPOConfig

    batch = args.trl_batch or G
    if G % batch:
        raise SystemExit(f"--trl-batch {batch}: must divide every G (got G={G})")
    return GRPOConfig(
        output_dir=str(out_dir), num_generations=G, per_device_train_batch_size=batch,
        gradient_accumulation_steps=G // batch, steps_per_generation=G // batch,
        max_completion_length=args.max_completion, learning_rate=args.learning_rate,
        temperature=1.0, beta=0.0, use_vllm=False, bf16=False, fp16=False, use_cpu=True,
        report_to=[],
        logging_steps=1, save_strategy="no", max_steps=1 + args.steps, lr_scheduler_type="constant",
        disable_tqdm=True, dataloader_num_workers=0, seed=0, loss_type="dapo",
        gradient_checkpointing=args.gradient_checkpointing == "on")


def make_step_callback(meter: PeakRss, times: list[float], lengths: list[float]):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Times each optimizer step (generation + loss + backward + update); baseline after step
        1."""

        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)
            if state.global_step == 1:
                meter.start()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    return StepTimer()


def run_trl(args, G: int, model_dir: Path, tmp: Path, rollout_func=None) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from infsamp.models.loading import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    meter, times, lengths = PeakRss(), [], []
    trainer = GRPOTrainer(model=model, reward_funcs=reward_functions(),
                          args=trl_config(args, G, tmp / "trl"),
                          train_dataset=Dataset.from_list(train_problems(NUM_PROMPTS)),
                          processing_class=load_tokenizer(str(model_dir)),
                          callbacks=[make_step_callback(meter, times, lengths)],
                          rollout_func=rollout_func)
    trainer._generate = meter.phase(trainer._generate)  # TRL's generation, or the rollout_func
    trainer.train()
    return {"peak_bytes": meter.peak_bytes(), "generation_peak_bytes": max(meter.phase_peaks),
            "step_seconds": times[1:], "mean_lengths": lengths[1:]}


def run_trl_infsamp(args, G: int, model_dir: Path, tmp: Path) -> dict:
    """TRL's trainer with infsamp's sampler as rollout_func (the infsamp worker's settings)."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from infsamp.integrations.trl import infsamp_rollout

    g = min(args.micro_group, G)
    rollout = infsamp_rollout(policy="continuous", micro_group=g,
                              kv_budget=str(g * (MAX_PROMPT_TOKENS + args.max_completion)))
    return run_trl(args, G, model_dir, tmp, rollout_func=rollout)


# ---------------------------------------------------------------- infsamp worker


def infsamp_trainer(args, G: int, model_dir: Path, tmp: Path):
    from infsamp.config_io import load_config
    from infsamp.run.trainer import GRPOTrainer

    g = min(args.micro_group, G)
    cfg = load_config(overrides={
        "model.name_or_path": str(model_dir), "model.device": "cpu", "model.dtype": "fp32",
        "model.gradient_checkpointing": args.gradient_checkpointing == "on",
        "data.num_train_examples": NUM_PROMPTS, "data.max_prompt_length": MAX_PROMPT_TOKENS,
        "sampling.num_generations": G, "sampling.policy": "continuous", "sampling.micro_group": g,
        "sampling.kv_budget": str(g * (MAX_PROMPT_TOKENS + args.max_completion)),
        "sampling.max_new_tokens": args.max_completion, "sampling.temperature": 1.0,
        "training.prompts_per_step": 1, "training.learning_rate": args.learning_rate,
        "training.lr_scheduler": "constant", "training.warmup_ratio": 0.0, "training.beta": 0.0,
        "training.loss_type": "dapo",
        "training.train_micro_batch_tokens": args.train_micro_batch_tokens,
        "training.max_steps": 1 + args.steps, "eval.num_problems": 0,
        "logging.output_dir": str(tmp / "infsamp"),
        "logging.plot": False, "logging.progress_bar": False,
    })
    return GRPOTrainer(cfg, reward_funcs=[(f.__name__, f) for f in reward_functions()])


def timed_step(trainer) -> tuple[float, float]:
    start = time.perf_counter()
    metrics = trainer.train_step()
    return time.perf_counter() - start, float(metrics["completions/mean_length"])


def run_infsamp(args, G: int, model_dir: Path, tmp: Path) -> dict:
    trainer = infsamp_trainer(args, G, model_dir, tmp)
    meter = PeakRss()
    trainer._sample_with_retry = meter.phase(trainer._sample_with_retry)
    timed_step(trainer)  # warm-up: optimizer state, lazy imports
    meter.start()
    measured = [timed_step(trainer) for _ in range(args.steps)]
    return {"peak_bytes": meter.peak_bytes(), "generation_peak_bytes": max(meter.phase_peaks),
            "step_seconds": [t for t, _ in measured], "mean_lengths": [n for _, n in measured]}


def profile_infsamp(args, G: int, model_dir: Path, tmp: Path) -> dict[str, float]:
    """Cumulative seconds per phase of one infsamp step (after a warm-up step), from cProfile."""
    trainer = infsamp_trainer(args, G, model_dir, tmp)
    timed_step(trainer)
    profiler = cProfile.Profile()
    profiler.runcall(trainer.train_step)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    total = sum(tt for _, _, tt, _, _ in stats.values())
    breakdown = {"total": total}
    for label, (suffix, name) in PROFILE_FUNCTIONS.items():
        breakdown[label] = sum(ct for (file, _, fn), (_, _, _, ct, _) in stats.items()
                               if fn == name and file.endswith(suffix))
    return {k: round(v, 2) for k, v in breakdown.items()}


WORKERS = {"trl": run_trl, "trl_infsamp": run_trl_infsamp, "infsamp": run_infsamp,
           "profile": profile_infsamp}
COMPARED = ("infsamp", "trl_infsamp")  # rows that get ratios to the `trl` row of the same G


def run_worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    framework, G = args.worker.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        result = WORKERS[framework](args, int(G), Path(args.model_dir), Path(tmp))
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------- driver


def run_case(args, worker: str, model_dir: Path) -> dict:
    """Runs one case in a fresh interpreter; returns its result dict (raises with the child's
    tail)."""
    argv = [sys.executable, __file__, "--worker", worker, "--model-dir",
            str(model_dir)] + shared_argv(args)
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV})
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"case {worker} failed (exit "
                       f"{proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def shared_argv(args) -> list[str]:
    return ["--steps", str(args.steps), "--max-completion", str(args.max_completion),
            "--learning-rate", str(args.learning_rate), "--micro-group", str(args.micro_group),
            "--train-micro-batch-tokens", str(args.train_micro_batch_tokens), "--threads",
            str(args.threads), "--gradient-checkpointing", args.gradient_checkpointing,
            "--trl-batch", str(args.trl_batch)]


def summarise(framework: str, G: int, raw: dict) -> dict:
    return {"framework": framework, "G": G, "peak_mib": round(raw["peak_bytes"] / 2**20, 1),
            "generation_peak_mib": round(raw["generation_peak_bytes"] / 2**20, 1),
            "seconds_per_step": round(statistics.median(raw["step_seconds"]), 2),
            "mean_completion_length": round(statistics.mean(raw["mean_lengths"]), 1),
            "step_seconds": [round(s, 2) for s in raw["step_seconds"]]}


def add_ratios(rows: list[dict]) -> None:
    """x/TRL ratios of peak memory and step time on infsamp / trl_infsamp rows with a TRL row."""
    trl = {r["G"]: r for r in rows if r["framework"] == "trl"}
    for row in rows:
        base = trl.get(row["G"])
        if row["framework"] in COMPARED and base:
            row["peak_ratio"] = round(row["peak_mib"] / max(base["peak_mib"], 1e-9), 2)
            row["generation_peak_ratio"] = round(
                row["generation_peak_mib"] / max(base["generation_peak_mib"], 1e-9), 2)
            row["time_ratio"] = round(row["seconds_per_step"] / base["seconds_per_step"], 2)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| framework | G | peak MiB | generation peak MiB | s/step | mean completion len | "
             "peak/TRL | generation peak/TRL | time/TRL |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['framework']} | {r['G']} | {r['peak_mib']:.0f} | "
                     f"{r['generation_peak_mib']:.0f} | {r['seconds_per_step']:.2f} | "
                     f"{r['mean_completion_length']:.1f} | {r.get('peak_ratio', '')} | "
                     f"{r.get('generation_peak_ratio', '')} | {r.get('time_ratio', '')} |")
    return "\n".join(lines)


def run_benchmark(args) -> dict:
    from importlib.metadata import version

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = resolve_model(args, Path(tmp))
        rows = []
        for G in args.groups:
            for framework in args.frameworks:
                print(f"running {framework} G={G} ...", file=sys.stderr, flush=True)
                rows.append(summarise(framework, G, run_case(args, f"{framework}:{G}", model_dir)))
        add_ratios(rows)
        profile = run_case(args, f"profile:{args.profile}", model_dir) if args.profile else None
        num_params = count_parameters(model_dir)
    return {"date": datetime.date.today().isoformat(), "trl_version": version("trl"),
            "command": " ".join(sys.argv), "rows": rows,
            "num_parameters": num_params, "model": args.model
            or f"random llama hidden={args.hidden} "
            f"layers={args.layers}", "settings": vars(args) | {"groups": args.groups},
            "infsamp_profile": profile}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", default="8,32,64", help="comma-separated G values")
    p.add_argument("--frameworks", default="trl,infsamp",
                   help="comma-separated: trl, trl_infsamp, infsamp")
    p.add_argument("--steps", type=int, default=2,
                   help="measured optimizer steps (after 1 warm-up)")
    p.add_argument("--model", default="",
                   help="HF checkpoint dir or 'embedded' (default: build a random Llama)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the random Llama")
    p.add_argument("--layers", type=int, default=4, help="layers of the random Llama")
    p.add_argument("--max-completion", type=int, default=128, help="max completion length (tokens)")
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--micro-group", type=int, default=8,
                   help="infsamp, trl_infsamp: samples decoded at once (g)")
    p.add_argument("--trl-batch", type=int, default=0,
                   help="trl, trl_infsamp: completions per forward/backward (0: all G, as TRL)")
    p.add_argument("--train-micro-batch-tokens", type=int, default=4096,
                   help="infsamp: tokens per micro-batch")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in each case (1: on a shared CPU, 2 threads spin-wait and "
                        "run ~10x slower)")
    p.add_argument("--gradient-checkpointing", choices=("on", "off"), default="on",
                   help="both frameworks (on: TRL 1.16's GRPOConfig default)")
    p.add_argument("--profile", type=int, default=0,
                   help="also cProfile one infsamp step at this G")
    p.add_argument("--quick", action="store_true", help="smoke check: G=8, 1 measured step")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.steps = "8", 1
    args.groups = [int(g) for g in str(args.groups).split(",")]
    args.frameworks = args.frameworks.split(",")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    result = run_benchmark(args)
    print(f"TRL {result['trl_version']}, model: {result['model']} "
          f"({result['num_parameters'] / 1e6:.1f}M params)")
    print(markdown_table(result["rows"]))
    if result["infsamp_profile"]:
        print("infsamp step profile (cumulative s):", json.dumps(result["infsamp_profile"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
