"""Summarise `versus_commit.sh`'s two runs: wall and CPU seconds, the median step time and
phase split, the evaluations (accuracy and time) and, for every checkpoint both runs saved, the
largest relative difference (norm of the difference over the norm) of a weight tensor; for a LoRA
checkpoint also of the model's weights, the frozen base plus the adapter's delta (alpha / r) B A."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from infsamp.run.logs import read_jsonl

SIDES = ("base", "head")



def side_summary(out: Path, side: str) -> dict:
    wall, user, system = (float(v) for v in (out / f"{side}.time").read_text().split()[-3:])
    steps = read_jsonl(out / side / "metrics.jsonl")
    evals = read_jsonl(out / side / "eval.jsonl")
    row = {"wall_s": wall, "cpu_s": round(user + system, 1), "steps": len(steps),
           "median_step_s": statistics.median(s["step_time"] for s in steps) if steps else None,
           "evals": [(e["step"], e.get("eval/accuracy"), e.get("time/eval", e.get("eval/time_s")))
                     for e in evals]}  # an older checkout logs eval/time_s
    for name in ("time/sampling", "time/rewards", "time/logprobs", "time/train",
                 "time/optimizer", "train/forwarded_tokens"):
        values = [s[name] for s in steps if name in s]
        row[name] = statistics.median(values) if values else None
    row["rewards"] = [s.get("reward") for s in steps]
    row["grad_norm"] = [s.get("grad_norm") for s in steps]
    return row


def weight_difference(out: Path, checkpoint: str) -> tuple[float, str]:
    """The largest ||a - b|| / ||b|| over the weight tensors both checkpoints hold (the model's
    files, not the optimizer state), and its tensor's name."""
    from safetensors.torch import load_file

    base_dir, head_dir = (out / side / checkpoint / "model" for side in SIDES)
    worst, worst_name = 0.0, ""
    for base_file in sorted(base_dir.rglob("*.safetensors")):
        base = load_file(base_file)
        head = load_file(head_dir / base_file.relative_to(base_dir))
        for name in base.keys() & head.keys():
            a, b = head[name].double(), base[name].double()
            relative = float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())
            worst, worst_name = max((worst, worst_name), (relative, name))
    return worst, worst_name


def merged_weight_difference(out: Path, checkpoint: str) -> tuple[float, str] | None:
    """For LoRA checkpoints: the largest ||W_head - W_base|| / ||W_base|| of the model's weights
    W = W0 + (alpha / r) B A (W0 the frozen base both sides load), and its module's name."""
    from safetensors.torch import load_file

    dirs = [out / side / checkpoint / "model" for side in SIDES]
    if not (dirs[0] / "adapter_config.json").exists():
        return None
    config = json.loads((dirs[0] / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    frozen: dict = {}
    for path in Path(config["base_model_name_or_path"]).glob("*.safetensors"):
        frozen.update(load_file(path))
    base, head = (load_file(d / "adapter_model.safetensors") for d in dirs)
    worst, worst_name = 0.0, ""
    for name_a in (n for n in base if ".lora_A." in n):
        name_b = name_a.replace(".lora_A.", ".lora_B.")
        module = name_a.replace("base_model.model.", "").replace(".lora_A", "")
        delta_base = scale * base[name_b].double() @ base[name_a].double()  # [out, in]
        delta_head = scale * head[name_b].double() @ head[name_a].double()  # [out, in]
        relative = float((delta_head - delta_base).norm() /
                         (frozen[module].double() + delta_base).norm())
        worst, worst_name = max((worst, worst_name), (relative, module))
    return worst, worst_name


def main(out: Path) -> None:
    rows = {side: side_summary(out, side) for side in SIDES}
    for side, row in rows.items():
        print(side, json.dumps(row))
    base, head = rows["base"], rows["head"]
    print(f"wall ratio head/base: {head['wall_s'] / base['wall_s']:.3f}")
    if base["median_step_s"] and head["median_step_s"]:
        print(f"median step ratio head/base: {head['median_step_s'] / base['median_step_s']:.3f}")
    for (step, _, base_s), (_, _, head_s) in zip(base["evals"], head["evals"]):
        if base_s and head_s:
            print(f"evaluation at step {step}: time ratio head/base {head_s / base_s:.3f}")
    shared = {p.name for p in (out / "base").glob("checkpoint-*")} & \
        {p.name for p in (out / "head").glob("checkpoint-*")}
    for checkpoint in sorted(shared):
        worst, name = weight_difference(out, checkpoint)
        print(f"{checkpoint}: weights' largest relative difference {worst:.3g} ({name})")
        merged = merged_weight_difference(out, checkpoint)
        if merged:
            print(f"{checkpoint}: the model's weights (base + LoRA delta): largest relative "
                  f"difference {merged[0]:.3g} ({merged[1]})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
