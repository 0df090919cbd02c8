"""Training memory and time on a real vocabulary, before and after the chunked LM head, side by
side.

The model: a random Llama with Qwen3's 151,936-token vocabulary (hidden 64, 2 layers, tied
embeddings, 9.8M parameters) and the embedded character tokenizer, written to `--workdir`. Each
variant runs in its own process, one at a time (the old code needs ~5.5 GB):

- `train`: `python -m infsamp train`, one GRPO step (G = 8 x 4 prompts, completions up to 256
  tokens, 4096-token training micro-batches, no evaluation): whole-process peak RSS (what
  `/usr/bin/time -v` reports as "Maximum resident set size", from `wait4`), the process's CPU
  seconds, the step's wall time, and the start-up `memory plan:` line;
- `step`: the GRPO step alone (`GRPOStep.optimize`, dapo, AdamW) on a fixed rollout of 32
  completions of 48 + 256 tokens in 4096-token micro-batches: its CPU and wall seconds (the first
  step, which creates the optimizer states, is not timed) and the process's peak RSS.

`before` is the code of `--before` (a git revision: the commit before the chunked head, taken with
`git archive`), `after` is this checkout's `src/`. CPU seconds are the fairer time on a shared
machine; the load average is printed beside them.

    python benchmarks/logits_memory.py                       # train and step, before and after
    python benchmarks/logits_memory.py --what step --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "aac43e1"  # main before the chunked LM head (issue 20)
VOCAB, HIDDEN, LAYERS = 151936, 64, 2
TRAIN_FLAGS = {"training.max_steps": 1, "training.train_micro_batch_tokens": 4096,
               "sampling.num_generations": 8, "training.prompts_per_step": 4,
               "sampling.max_new_tokens": 256, "eval.num_problems": 0, "logging.plot": "false",
               "logging.progress_bar": "false", "checkpointing.save_every": 0}


def build_model_dir(path: Path) -> Path:
    """The random Qwen3-vocabulary Llama with the embedded tokenizer (built once)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    embedded = ROOT / "src/infsamp/models/embedded"
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=3 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded / name, path / name)
    return path


def source_tree(variant: str, before: str, workdir: Path) -> Path:
    """The `src/` folder a variant imports infsamp from."""
    if variant == "after":
        return ROOT / "src"
    target = workdir / f"src-{before}"
    if not target.exists():
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", before, "src"],
                                 check=True, capture_output=True).stdout
        target.mkdir(parents=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target / "src"


def run_measured(command: list[str], src: Path) -> tuple[dict, str]:
    """Run `command` with infsamp from `src`: (peak RSS, CPU and wall seconds, output)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])}... failed:\n{output[-3000:]}")
    return {"peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,
            "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "process_wall_s": round(time.perf_counter() - start, 1)}, output


def measure_train(model_dir: Path, src: Path, out: Path) -> dict:
    flags = [f"--{k}={v}" for k, v in {**TRAIN_FLAGS, "model.name_or_path": model_dir,
                                       "logging.output_dir": out}.items()]
    result, output = run_measured([sys.executable, "-m", "infsamp", "train", *flags], src)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    plan = next((line.strip() for line in output.splitlines() if "memory plan:" in line), "")
    return {**result, "step_time_s": rows[-1].get("step_time"), "plan": plan}


def measure_step(model_dir: Path, src: Path) -> dict:
    result, output = run_measured([sys.executable, __file__, "--child-step", str(model_dir)], src)
    return {**result, **json.loads(output.strip().splitlines()[-1])}


def child_step(model_dir: str) -> None:
    """One timed GRPO step (after an untimed one) on a fixed rollout; prints JSON."""
    import torch
    from transformers import AutoModelForCausalLM

    from infsamp.algorithm.grpo_step import GRPOStep
    from infsamp.algorithm.rollout import Rollout
    from infsamp.config_algorithm import TrainingConfig

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 100, (32, 48), generator=g).tolist()
    completions = torch.randint(3, 100, (32, 256), generator=g).tolist()
    rollout = Rollout(prompts, completions, torch.randn(32, generator=g))
    cfg = TrainingConfig(loss_type="dapo", learning_rate=1e-5)
    step = GRPOStep(model, cfg, pad_token_id=0, temperature=0.7, max_new_tokens=256,
                    micro_batch_tokens=4096)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    step.optimize(rollout, optimizer, scheduler)  # creates AdamW's states
    cpu, wall = time.process_time(), time.perf_counter()
    metrics = step.optimize(rollout, optimizer, scheduler)
    print(json.dumps({"step_cpu_s": round(time.process_time() - cpu, 2),
                      "step_wall_s": round(time.perf_counter() - wall, 2),
                      "loss": metrics["loss"]}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("train", "step", "both"), default="both")
    parser.add_argument("--before", default=BEFORE, help="git revision of the 'before' code")
    parser.add_argument("--variants", default="before,after")
    parser.add_argument("--repeat", type=int, default=1, help="measurements per variant")
    parser.add_argument("--workdir", type=Path,
                        default=Path(tempfile.gettempdir()) / "logits_memory")
    parser.add_argument("--child-step", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_step:
        child_step(args.child_step)
        return 0
    model_dir = build_model_dir(args.workdir / "qwen3-vocab-llama")
    whats = ["train", "step"] if args.what == "both" else [args.what]
    for what in whats:
        for repeat in range(args.repeat):
            for variant in args.variants.split(","):
                src = source_tree(variant, args.before, args.workdir)
                load = os.getloadavg()[0]
                if what == "train":
                    out = Path(tempfile.mkdtemp(dir=args.workdir, prefix=f"run-{variant}-"))
                    shutil.rmtree(out)
                    result = measure_train(model_dir, src, out)
                else:
                    result = measure_step(model_dir, src)
                print(json.dumps({"what": what, "variant": variant, "repeat": repeat,
                                  "load_1min": round(load, 1), **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
