"""TRL's GRPOTrainer and infsamp side by side on a real model: SmolLM2-135M-Instruct learning
reasoning-gym arithmetic (examples/smollm2_reasoning_gym.yaml), held-out accuracy before and
after, whole-step peak memory and time per step, in one run.

    flock /work/notes/bench.lock nice -n 5 .venv/bin/python benchmarks/vs_trl_real.py \\
        --steps 10 --out /work/runs/i21-trl-real/run1
    .venv/bin/python benchmarks/vs_trl_real.py --steps 2 --eval-problems 20 --out /tmp/quick

What both get, decided once from the infsamp config (the recipe, with `--set key=value`
overrides; `trl_settings` maps it to GRPOConfig and refuses what TRL cannot match):
- the model: infsamp's loader (`smollm2-135m`: the dequantised weights of infsamp's per-machine
  GGUF cache), LoRA applied by infsamp's `apply_lora` after the same seed, so both start from the
  same weights and the same adapters (checked: `initial_checksum`);
- the task rows and their order: infsamp's training rows in the order its `PromptStream` serves
  them; TRL gets exactly those rows, in that order, `shuffle_dataset=False`, as chat messages
  (TRL's chat-template tokenization gives infsamp's prompt ids: checked on the first row);
- the reward: infsamp's own reward functions (`reasoning_gym`: the task's `score_answer` on the
  `last_number` answer) with TRL's signature, fed the same row columns;
- G (num_generations), prompts per step (TRL: per_device_train_batch_size B, gradient
  accumulation = steps_per_generation = prompts x G / B: one optimizer step per step), learning
  rate and schedule, AdamW betas/eps/weight decay, gradient clipping, temperature / top_p / top_k,
  max completion length, beta (KL), epsilon / epsilon_high (clip), scale_rewards, num_iterations,
  loss_type (infsamp's `training.loss_type` = TRL's `loss_type`, the same names: dapo in the
  recipe), gradient checkpointing, seed, torch threads.
- evaluation: one function for every model (`held_out_eval`): the same held-out rows, greedy
  decoding with transformers `generate` (infsamp's `held_out_completions`), scored by the run's
  reward as infsamp's eval does (`eval/accuracy`: score >= eval.accuracy_threshold).

Each side trains in its own subprocess (infsamp first, then TRL; `--parallel`: both at once, so
on a shared machine both see the same load). After step 1 (the warm-up,
excluded from timing and memory) the meter (`peak_meter.py`) takes the baseline; "peak MiB" is
the whole-step peak resident set above it, "generation peak" one generation's growth. Wall and
CPU seconds per step (medians), the load average before and after each side.

What differs by design, reported rather than hidden: generation (TRL: transformers `generate`
over all prompts x G completions at once; infsamp: its slot engine, micro groups of g with
refill), the training micro-batch (TRL: B completions; infsamp: `train_micro_batch_tokens`),
and the sampling random streams (the same seed, different consumers: the completions differ).
So the curves are compared within noise: a Wilson 95% interval on each accuracy and an exact
McNemar test on the paired held-out problems (`compare`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (also when loaded by path)
from vs_trl_frameworks import StepClock, metered_infsamp, timed_steps, trl_trainer

from vs_trl import RESULT_PREFIX, SizeError, run_child

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "smollm2_reasoning_gym.yaml"
FRAMEWORKS = ("infsamp", "trl")
TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo")  # same name, same loss in both
# per-step metrics both log under these names
STEP_KEYS = ("reward", "frac_reward_zero_std", "completions/mean_length",
             "completions/clipped_ratio", "entropy", "clip_ratio/region_mean")


# ---------------------------------------------------------------- shared settings


def recipe_config(args):
    """The infsamp config both sides follow: the recipe, this run's sizes, `--set` overrides."""
    from infsamp.config_io import load_config

    overrides = {"sampling.num_generations": args.groups,
                 "training.prompts_per_step": args.prompts_per_step,
                 "training.max_steps": args.steps, "eval.num_problems": args.eval_problems,
                 "eval.every_steps": 0, "logging.plot": False, "logging.progress_bar": False,
                 "checkpointing.keep_best": "", "checkpointing.save_every": 0,
                 "logging.output_dir": str(Path(args.out) / "infsamp-run")}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = value
    return load_config(args.config, overrides=overrides).validate()


def trl_settings(cfg, trl_batch: int) -> dict:
    """GRPOConfig keywords equal to infsamp's `cfg`; SizeError (one line) for what TRL lacks."""
    from infsamp.algorithm.optim import EPS, schedule_horizon

    train, sampling = cfg.training, cfg.sampling
    completions = sampling.num_generations * train.prompts_per_step
    batch = trl_batch or sampling.num_generations
    problems = [
        (train.loss_type not in TRL_LOSS_TYPES, f"training.loss_type {train.loss_type}: TRL "
         f"names it differently or lacks it (compared: {', '.join(TRL_LOSS_TYPES)})"),
        (sampling.temperature == 0, "sampling.temperature 0: TRL always samples"),
        (train.optimizer != "adamw", f"training.optimizer {train.optimizer}: compared with "
         "TRL's adamw_torch only"),
        (cfg.model.device not in ("cpu", "auto"), "model.device: this comparison runs on cpu"),
        (completions % batch, f"--trl-batch {batch} does not divide the step's {completions} "
         f"completions ({train.prompts_per_step} prompts x G={sampling.num_generations})")]
    for bad, why in problems:
        if bad:
            raise SizeError(f"vs_trl_real.py: {why}")
    horizon = schedule_horizon(train)
    accumulation = completions // batch
    return dict(
        num_generations=sampling.num_generations, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, steps_per_generation=accumulation,
        num_iterations=train.num_iterations, max_completion_length=sampling.max_new_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        learning_rate=train.learning_rate, lr_scheduler_type=horizon["lr_scheduler"],
        warmup_steps=int(horizon["num_warmup_steps"]), optim="adamw_torch",
        weight_decay=train.weight_decay, adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2, adam_epsilon=EPS, max_grad_norm=train.max_grad_norm,
        beta=train.beta, epsilon=train.epsilon, epsilon_high=train.epsilon_high,
        loss_type=train.loss_type, scale_rewards=train.scale_rewards,
        mask_truncated_completions=train.mask_truncated_completions,
        top_entropy_quantile=train.top_entropy_quantile, max_steps=train.max_steps,
        seed=train.seed, gradient_checkpointing=cfg.model.gradient_checkpointing,
        reward_weights=list(cfg.rewards.weights) or None, shuffle_dataset=False, use_cpu=True,
        bf16=False, fp16=False)


def grpo_config(cfg, trl_batch: int, out_dir: Path):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(out_dir), report_to=[], logging_steps=1,
                      save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                      **trl_settings(cfg, trl_batch))


def training_rows(stream_args, num_steps: int) -> list:
    """The prompts infsamp's trainer takes in its first `num_steps` steps, in order (a fresh
    PromptStream with the trainer's arguments)."""
    from infsamp.run.prompt_stream import PromptStream

    stream = PromptStream(*stream_args)
    return [prompt for _ in range(num_steps) for _, prompt in stream.next_batch()]


# ---------------------------------------------------------------- evaluation (both sides)


def held_out_eval(model, tokenizer, prompts, stop_token_ids, rewards, cfg) -> dict:
    """Greedy completions of the held-out prompts, scored by the run's eval reward as infsamp's
    evaluation scores them; `solved` per problem (for paired tests)."""
    from infsamp.run.evaluation import (
        eval_metrics,
        eval_reward_name,
        held_out_completions,
        problem_records,
        tally,
    )

    start = (time.perf_counter(), time.process_time())
    ids, texts = held_out_completions(
        model, tokenizer, [p.token_ids for p in prompts], stop_token_ids=stop_token_ids,
        temperature=cfg.eval.temperature,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens)
    result = rewards.score(tokenizer, [p.example for p in prompts], texts, ids)
    chosen = eval_reward_name(cfg.eval.reward, rewards.names)
    metrics = eval_metrics(tally(result, rewards.names, chosen, cfg.eval.accuracy_threshold),
                           rewards.names, chosen)
    records = problem_records(prompts, texts, ids, result, chosen, cfg.eval.accuracy_threshold)
    solved = [int(record["solved"]) for record in records]
    return {**metrics, "eval_reward": chosen, "solved": solved,
            "mean_length": statistics.mean(len(i) for i in ids),
            "seconds": round(time.perf_counter() - start[0], 1),
            "cpu_seconds": round(time.process_time() - start[1], 1)}


def initial_checksum(model) -> float:
    """Sum of |w| over the trainable parameters: both sides start from the same adapters."""
    return float(sum(p.detach().abs().sum() for p in model.parameters() if p.requires_grad))


def step_rows(clock: StepClock) -> list[dict]:
    return [{k: round(float(log[k]), 4) for k in STEP_KEYS if k in log} for log in clock.step_logs]


# ---------------------------------------------------------------- the two workers


def run_infsamp(cfg, args) -> dict:
    from infsamp.run.trainer import GRPOTrainer

    trainer = GRPOTrainer(cfg)
    questions: list[list[str]] = []
    next_batch = trainer.stream.next_batch

    def recorded_batch():
        batch = next_batch()
        questions.append([p.example["question"] for _, p in batch])
        return batch

    trainer.stream.next_batch = recorded_batch
    evaluate = lambda: held_out_eval(trainer.model, trainer.tokenizer,  # noqa: E731
                                     trainer.eval_prompts.prompts, trainer.stop_token_ids,
                                     trainer.rewards, cfg)
    try:
        checksum, before = initial_checksum(trainer.model), evaluate()
        clock = metered_infsamp(trainer, "cpu")
        timed_steps(trainer, clock, cfg.training.max_steps)
        measured = clock.result()  # before the evaluation, whose memory is not the step's
        after = evaluate()
    finally:
        trainer.close()
    return {**measured, "eval_before": before, "eval_after": after, "steps": step_rows(clock),
            "questions": questions, "initial_checksum": checksum}


def trl_reward(name: str, func, rows: list, questions: list[list[str]]):
    """infsamp's reward `func` with TRL's signature, fed the row's own columns (TRL's dataset
    carries the row number only: reasoning-gym metadata is not an Arrow-friendly column)."""
    def reward(prompts, completions, row, completion_ids=None, **_trl):
        examples = [rows[i].example for i in row]
        questions.append(list(dict.fromkeys(e["question"] for e in examples)))
        columns = {k: [e[k] for e in examples] for k in examples[0] if k != "prompt"}
        return func(prompts=prompts, completions=completions, completion_ids=completion_ids,
                    **columns)

    reward.__name__ = name
    return reward


def trl_dataset(rows: list, tokenizer, data_cfg):
    """TRL's training rows: the chat messages infsamp renders, and the row number; checks that
    TRL's chat-template tokenization gives infsamp's prompt ids."""
    from datasets import Dataset

    from infsamp.tasks.prompts import prompt_for_rewards

    prompts = [prompt_for_rewards(p.example, tokenizer, data_cfg) for p in rows]
    first = tokenizer.apply_chat_template(conversation=[prompts[0]], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"][0]
    if list(first) != list(rows[0].token_ids):
        raise RuntimeError("TRL's chat-template ids differ from infsamp's prompt ids")
    return Dataset.from_list([{"prompt": p, "row": i} for i, p in enumerate(prompts)])


def run_trl(cfg, args) -> dict:
    import torch

    from infsamp.models.loading import load_model_and_tokenizer, load_tokenizer, require_stop_tokens
    from infsamp.run.scoring import RunRewards
    from infsamp.run.setup import check_environment, load_prompts, seed_everything, set_num_threads

    from peak_meter import make_meter

    device = torch.device("cpu")
    precision = check_environment(cfg, device)
    rewards = RunRewards(cfg)
    tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
    train, held_out = load_prompts(cfg, tokenizer)
    rows = training_rows((train.prompts, cfg.training.prompts_per_step, cfg.training.seed),
                         cfg.training.max_steps)
    seed_everything(cfg.training.seed)  # as infsamp's trainer, before its weights load
    model, _ = load_model_and_tokenizer(cfg.model, device, tokenizer, precision=precision)
    stops = require_stop_tokens(model, tokenizer, cfg.model.name_or_path)
    set_num_threads(cfg.training.num_threads, model, device)
    questions: list[list[str]] = []
    funcs = [trl_reward(name, func, rows, questions) for name, func in rewards.funcs]
    clock = StepClock(make_meter("cpu"))
    trainer = trl_trainer(clock, model=model, reward_funcs=funcs,
                          args=grpo_config(cfg, args.trl_batch, Path(args.out) / "trl-run"),
                          train_dataset=trl_dataset(rows, tokenizer, cfg.data),
                          processing_class=tokenizer)
    checksum = initial_checksum(model)
    try:
        trainer.train()
        measured = clock.result()
        after = held_out_eval(trainer.model, tokenizer, held_out.prompts, stops, rewards, cfg)
    finally:
        rewards.close()
    return {**measured, "eval_after": after, "steps": step_rows(clock), "questions": questions,
            "initial_checksum": checksum}


WORKERS = {"infsamp": run_infsamp, "trl": run_trl}


# ---------------------------------------------------------------- noise: intervals and tests


def wilson_interval(solved: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial share solved / n."""
    if n == 0:
        return (math.nan, math.nan)
    share = solved / n
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (round(centre - half, 4), round(centre + half, 4))


def mcnemar(first: list[int], second: list[int]) -> dict:
    """Exact McNemar test of two 0/1 results on the same problems: gained (0 -> 1), lost
    (1 -> 0) and the two-sided binomial p-value of the discordant pairs."""
    gained = sum(1 for a, b in zip(first, second) if not a and b)
    lost = sum(1 for a, b in zip(first, second) if a and not b)
    n, k = gained + lost, min(gained, lost)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"gained": gained, "lost": lost, "p_value": round(p, 4)}


def accuracy_row(name: str, evaluation: dict) -> dict:
    solved = evaluation["solved"]
    return {"model": name, "accuracy": round(sum(solved) / len(solved), 4),
            "interval_95": wilson_interval(sum(solved), len(solved)),
            "reward": round(evaluation["eval/reward"], 4), "problems": len(solved),
            "mean_length": round(evaluation["mean_length"], 1),
            "eval_seconds": evaluation["seconds"], "eval_cpu_seconds": evaluation["cpu_seconds"]}


def compare(results: dict) -> dict:
    """Accuracies with intervals and the paired tests: each side before -> after, and infsamp's
    after against TRL's after (same problems, same scoring)."""
    before = results["infsamp"]["eval_before"]["solved"]
    rows = [accuracy_row("base (both start here)", results["infsamp"]["eval_before"])]
    tests = {}
    for name in FRAMEWORKS:
        if name in results:
            rows.append(accuracy_row(f"{name} after", results[name]["eval_after"]))
            tests[f"{name}: before -> after"] = mcnemar(before, results[name]["eval_after"]
                                                        ["solved"])
    if all(name in results for name in FRAMEWORKS):
        tests["trl after -> infsamp after"] = mcnemar(results["trl"]["eval_after"]["solved"],
                                                      results["infsamp"]["eval_after"]["solved"])
    return {"accuracy": rows, "paired_tests": tests}


def timing_row(name: str, result: dict) -> dict:
    wall, cpu = result["step_seconds"], result["step_cpu_seconds"]
    return {"framework": name, "peak_mib": round(result["peak_bytes"] / 2**20, 1),
            "generation_peak_mib": round(result["generation_peak_bytes"] / 2**20, 1),
            "seconds_per_step": round(statistics.median(wall), 1),
            "cpu_seconds_per_step": round(statistics.median(cpu), 1),
            "step_seconds": [round(s, 1) for s in wall],
            "step_cpu_seconds": [round(s, 1) for s in cpu],
            "load_before_after": result["load_before_after"],
            "worker_wall_s": result["worker_wall_s"]}


# ---------------------------------------------------------------- report


def markdown(report: dict) -> str:
    lines = ["| model | held-out accuracy | 95% interval | mean reward | completion len |",
             "|---|---:|---|---:|---:|"]
    for r in report["accuracy"]:
        low, high = r["interval_95"]
        lines.append(f"| {r['model']} | {r['accuracy']:.3f} | {low:.3f}-{high:.3f} | "
                     f"{r['reward']:.3f} | {r['mean_length']:.1f} |")
    lines += ["", "| paired test (same problems) | gained | lost | McNemar p |",
              "|---|---:|---:|---:|"]
    lines += [f"| {k} | {t['gained']} | {t['lost']} | {t['p_value']} |"
              for k, t in report["paired_tests"].items()]
    lines += ["", "| framework | peak MiB | generation peak MiB | s/step | CPU s/step | load |",
              "|---|---:|---:|---:|---:|---|"]
    for r in report["timing"]:
        load = " -> ".join(f"{x:.1f}" for x in r["load_before_after"])
        lines.append(f"| {r['framework']} | {r['peak_mib']:.0f} | {r['generation_peak_mib']:.0f} "
                     f"| {r['seconds_per_step']} | {r['cpu_seconds_per_step']} | {load} |")
    lines += ["", "| step | " + " | ".join(f"{f} reward / zero-spread / len" for f in
                                          report["curves"]) + " |",
              "|---:|" + "---|" * len(report["curves"])]
    for step in range(max(len(c) for c in report["curves"].values())):
        cells = []
        for curve in report["curves"].values():
            s = curve[step] if step < len(curve) else {}
            cells.append(" / ".join(f"{s[k]:.2f}" if k in s else "-" for k in STEP_KEYS[:3]))
        lines.append(f"| {step + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_report(args, cfg, results: dict) -> dict:
    from importlib.metadata import version

    checksums = {n: results[n]["initial_checksum"] for n in results}
    questions = {n: results[n]["questions"] for n in results}
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "trl_version": version("trl"),
            "transformers_version": version("transformers"), "config": str(args.config),
            "settings": {"G": cfg.sampling.num_generations,
                         "prompts_per_step": cfg.training.prompts_per_step,
                         "steps": cfg.training.max_steps, "eval_problems": args.eval_problems,
                         "trl": {k: v for k, v in trl_settings(cfg, args.trl_batch).items()},
                         "infsamp_train_micro_batch_tokens":
                             cfg.training.train_micro_batch_tokens},
            "parallel": args.parallel,
            "same_start": len(set(checksums.values())) == 1, "initial_checksums": checksums,
            "same_prompt_order": len({json.dumps(q) for q in questions.values()}) == 1,
            **compare(results), "timing": [timing_row(n, results[n]) for n in results],
            "curves": {n: results[n]["steps"] for n in results}}


# ---------------------------------------------------------------- driver


def run_worker(args) -> None:
    import torch

    torch.manual_seed(0)
    cfg = recipe_config(args)
    load, start = os.getloadavg()[0], time.perf_counter()
    result = WORKERS[args.worker](cfg, args)
    result["load_before_after"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    result["worker_wall_s"] = round(time.perf_counter() - start, 1)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def worker_argv(args, name: str) -> list[str]:
    argv = [__file__, "--worker", name, "--config", str(args.config), "--steps", str(args.steps),
            "--groups", str(args.groups), "--prompts-per-step", str(args.prompts_per_step),
            "--eval-problems", str(args.eval_problems), "--trl-batch", str(args.trl_batch),
            "--out", args.out]
    return argv + [f"--set={item}" for item in args.set]


def run_benchmark(args) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    cfg = recipe_config(args)
    out = Path(args.out)

    def run(name: str) -> dict:
        print(f"{time.strftime('%H:%M:%S')} running {name} (log: {out / name}.log) ...",
              file=sys.stderr, flush=True)
        result = run_child(worker_argv(args, name), name, log=out / f"{name}.log")
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        return result

    with ThreadPoolExecutor(len(args.frameworks) if args.parallel else 1) as pool:
        results = dict(zip(args.frameworks, pool.map(run, args.frameworks)))
    report = build_report(args, cfg, results)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report) + "\n")
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(RECIPE), help="infsamp config both sides follow")
    p.add_argument("--groups", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (step 1: warm-up, "
                   "not timed)")
    p.add_argument("--eval-problems", type=int, default=200, help="held-out problems (greedy)")
    p.add_argument("--trl-batch", type=int, default=0, help="TRL's per_device_train_batch_size "
                   "(completions per forward/backward; default G)")
    p.add_argument("--frameworks", default="infsamp,trl", help="comma-separated, in run order")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an infsamp config override both sides follow (repeatable)")
    p.add_argument("--parallel", action="store_true", help="run the sides at the same time, "
                   "each in its own process (on a shared machine both then see the same load)")
    p.add_argument("--out", required=True, help="a new folder for logs, runs and the report")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.frameworks = args.frameworks.split(",")
    unknown = sorted(set(args.frameworks) - set(FRAMEWORKS))
    if unknown or not args.frameworks or "infsamp" not in args.frameworks:
        raise SizeError(f"vs_trl_real.py: --frameworks {','.join(args.frameworks)}: choose from "
                        f"{', '.join(FRAMEWORKS)}, infsamp included (its evaluation of the base "
                        "model is the 'before' of both)")
    if min(args.groups, args.prompts_per_step, args.steps, args.eval_problems) < 1 or \
            args.groups < 2 or args.steps < 2:
        raise SizeError("vs_trl_real.py: needs G >= 2, >= 1 prompt per step, >= 2 steps (step "
                        "1 is the warm-up) and >= 1 held-out problem")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SizeError(f"vs_trl_real.py: --out {out} is not empty (a run never shares its "
                        "folder)")
    out.mkdir(parents=True, exist_ok=True)
    trl_settings(recipe_config(args), args.trl_batch)  # what TRL cannot match: before any work
    report = run_benchmark(args)
    print(f"TRL {report['trl_version']}; same start: {report['same_start']}; same prompt "
          f"order: {report['same_prompt_order']}; load {os.getloadavg()[0]:.1f}")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
