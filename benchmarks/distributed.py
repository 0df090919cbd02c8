"""1 vs 2 CPU processes on the embedded task; round-robin vs LPT assignment of prompts to ranks.

    .venv/bin/python benchmarks/distributed.py [--steps 12] [--prompts 8] [--micro-group 16]
                                 [--train-examples 4000] [--oracle-steps 6] [--out DIR]

`--train-examples 32` makes every prompt come back every 4 steps (several epochs), so the cost
predictor has each prompt's earlier lengths to go on.

Part 1 runs `infsamp train` on the embedded model and task three times, side by side in one
invocation: one process; two processes (`torchrun --nproc-per-node 2`, gloo) with round-robin
assignment; two processes with LPT (the online cost predictor). From each run's metrics.jsonl it
reports the mean step time, the share of the step a rank spends waiting in the step's gathers
(`distributed/wait_fraction`), and the straggler ratios (`sampling/rank_imbalance`: sampling
time; `sampling/rank_imbalance_steps`: decode steps), all over the steps after the first (warm-up).

Part 2 ("oracle") measures what the assignment can buy at best: for `--oracle-steps` batches it
samples the step whole (the true lengths), then each rank's share alone with round-robin and with
LPT on the true lengths, in this process (the same sampler code a rank runs), and reports both
straggler ratios. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(out: Path, nproc: int, steps: int, prompts: int, extra: list[str]) -> float:
    shutil.rmtree(out, ignore_errors=True)
    args = ["-m", "infsamp", "train", "--logging.output_dir", str(out), "--training.max_steps",
            str(steps), "--training.prompts_per_step", str(prompts), "--eval.num_problems", "0",
            "--checkpointing.save_every", "0", "--logging.progress_bar", "false",
            "--logging.plot", "false", *extra]
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    path = f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "PYTHONPATH": path}
    start = time.monotonic()
    subprocess.run(launcher + args, env=env, check=True, capture_output=True)
    return time.monotonic() - start


def summary(out: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)  # noqa: E731
    return {"step_time_s": round(mean("step_time"), 3),
            "sampling_time_s": round(mean("sampling/wall_time_s"), 3),
            "wait_fraction": round(mean("distributed/wait_fraction"), 4),
            "rank_imbalance": round(mean("sampling/rank_imbalance"), 4) if rows[0].get(
                "sampling/rank_imbalance") else 1.0,
            "rank_imbalance_steps": round(mean("sampling/rank_imbalance_steps"), 4) if rows[0].get(
                "sampling/rank_imbalance_steps") else 1.0,
            "predicted_imbalance": round(mean("sampling/predicted_imbalance"), 4) if rows[0].get(
                "sampling/predicted_imbalance") else 1.0,
            "mean_length": round(mean("completions/mean_length"), 1)}


def oracle(out: Path, num_steps: int, prompts: int,
           micro_group: int) -> dict[str, dict[str, float]]:
    import torch

    from infsamp.config_io import load_config
    from infsamp.distributed.rank_assignment import assign, imbalance
    from infsamp.run.trainer import GRPOTrainer

    shutil.rmtree(out, ignore_errors=True)
    torch.set_num_threads(1)
    cfg = load_config(overrides={"logging.output_dir": str(out), "eval.num_problems": "0",
                                 "training.prompts_per_step": str(prompts),
                                 "sampling.micro_group": str(micro_group),
                                 "logging.progress_bar": "false"})
    trainer, G = GRPOTrainer(cfg), cfg.sampling.num_generations
    found: dict[str, dict[str, list[float]]] = {m: {"steps": [], "time": []}
                                               for m in ("round_robin", "lpt")}
    for step in range(num_steps):
        ids = [p.token_ids for _, p in trainer.stream.next_batch()]

        # called only within this iteration, so the loop variables it reads are this step's
        def sample(share):
            return trainer.sampler.sample([ids[i] for i in share], G, global_group_ids=share,  # noqa: B023
                                          generator=torch.Generator().manual_seed(step))  # noqa: B023

        lengths = [sum(c.length for c in g) for g in sample(list(range(len(ids)))).groups]
        for method, values in found.items():
            results = [sample(share) for share in assign(lengths, 2, method)]
            values["steps"].append(imbalance([r.stats.decode_steps for r in results]))
            values["time"].append(imbalance([r.stats.wall_time_s for r in results]))
    return {m: {k: round(sum(v) / len(v), 4) for k, v in values.items()}
            for m, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--oracle-steps", type=int, default=6)
    parser.add_argument("--micro-group", type=int, default=16, help="g: sampling slots per rank")
    parser.add_argument("--train-examples", type=int, default=4000, help="training prompts")
    parser.add_argument("--out", default="runs/bench_distributed")
    args = parser.parse_args()
    out = Path(args.out)
    runs = {"1 process": (1, []),
            "2 processes, round_robin": (2, ["--distributed.assignment", "round_robin"]),
            "2 processes, lpt": (2, ["--distributed.assignment", "lpt"])}
    report: dict[str, object] = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:],
                                 "load_before": os.getloadavg()}
    for name, (nproc, extra) in runs.items():
        folder = out / name.replace(" ", "_").replace(",", "")
        seconds = train(folder, nproc, args.steps, args.prompts,
                        extra + ["--sampling.micro_group", str(args.micro_group),
                                 "--data.num_train_examples", str(args.train_examples)])
        report[name] = {"wall_s": round(seconds, 1), **summary(folder)}
    if args.oracle_steps:
        report["oracle (sampler only, 2 ranks)"] = oracle(out / "oracle", args.oracle_steps,
                                                           args.prompts, args.micro_group)
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
