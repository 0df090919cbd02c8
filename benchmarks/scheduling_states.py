"""Scheduling figures on a model too slow to run every policy on (SmolLM2-135M on 2 CPU cores):
sample each call once, then replay every policy through the scheduler.

    python benchmarks/scheduling_states.py collect --config examples/smollm2_reasoning_gym.yaml \
        --max-new-tokens 96 -B 1 -G 32 --micro-group 8 --prompts 1 --seeds 0 --out DIR
    python benchmarks/scheduling_states.py replay DIR --seeds 0,1,2 -B 1 --micro-group 8 \
        --max-new-tokens 96 [--unseen] [--prefix-tokens 8] [--park-ratio 1.0]

`collect` runs `infsamp bench scheduling`'s calls (its prompts, seeds and call order) with
`continuous` only, on the slot engine, and keeps per call every token of every completion (the
trace's `first_tokens` hold all of them) and the last-layer hidden state the engine computed at
every step (float16, `hidden_seed<S>.npz`), saving after each call.

`replay` runs `continuous`, `length_aware` + `online` / `hidden` / `oracle` on them through
`SlotScheduler`, the loop every engine runs, with a stand-in engine that emits the recorded tokens
and hands the recorded hidden states (`Sample.hidden_state`). This is faithful: the sampler draws
each sample's noise from its own key, so a completion does not depend on the schedule, and a
sample's hidden state at a token depends only on its tokens (up to float rounding of the batch
it ran in). `continuous`'s replayed decode steps are checked against the engine's. Default: per
seed epoch 1 warms the predictors up and epoch 2 (the same prompts again) is measured, as in the
bench; `--unseen`: the other seeds' calls warm up and this seed's epoch 1 is measured (prompts the
predictor never saw, as in a training run, where each prompt comes once per epoch).

Besides the registry's predictors, `replay` knows two measurement-only ones (`--variants`):
`length_aware:ceiling` knows nothing before a sample starts and its true length from its first
point (k tokens) on, the best any decision after k tokens can do; `length_aware:ceiling:SIGMA`
sees that length times exp(N(0, SIGMA)), fixed per sample (what a predictor of that error would
buy). Each seed's prompts get their own keys (`<seed>:<prompt>`), so with `--unseen` no other
seed's prompt passes for this one in the predictors' per-prompt memories. Several folders may be
given; a seed is read from the first that has it.

Deliberately simple: one engine (slots), one thread, no timing beyond the replay's CPU time per
decode step (scheduler + policy + predictor).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np

VARIANTS = "continuous,length_aware:online,length_aware:hidden,length_aware:oracle"


def collect(args: argparse.Namespace) -> None:
    import torch

    from infsamp.commands import bench_scheduling as bench
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer
    from infsamp.sampling.engines.slots import SlotEngine

    recorded: dict[int, list[np.ndarray]] = {}

    class RecordingEngine(SlotEngine):
        """The slot engine, keeping each running sample's last hidden state at every step."""

        def _forward(self, inputs, positions, mask, packed=()):
            self.options.hidden_states = True
            logits, hidden = super()._forward(inputs, positions, mask, packed)
            states = hidden.float().numpy()  # [S, H]
            for row, sample in enumerate(self.slot_sample):
                if sample is not None and sample.finish_reason is None:
                    recorded.setdefault(sample.sample_id, []).append(states[row].astype(np.float16))
            return logits, hidden

        def _hand_hidden_states(self, slots, hidden):
            pass  # continuous: no predictor asks for them

    bench_args = argparse.Namespace(
        config=args.config, dataset="", prompt_column="prompt", model=args.model,
        prompts=args.prompts, prompts_per_step=args.B, epochs=args.epochs, num_generations=args.G,
        micro_group=args.micro_group, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, prefix_tokens=args.max_new_tokens, kv_slack=0, seed=0)
    data_cfg, model_name = bench.bench_sources(bench_args)
    torch.set_num_threads(1)
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=model_name))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed in parse_seeds(args.seeds):
        prompts = bench.bench_prompts(tokenizer, args.prompts, seed, data_cfg)
        runner = bench.Runner(model, tokenizer, bench_args, RecordingEngine(model))
        rows, states = [], {}
        for epoch in range(1, args.epochs + 1):
            for first in range(0, len(prompts), args.B):
                chunk = prompts[first:first + args.B]
                keys = [str(first + i) for i in range(len(chunk))]
                recorded.clear()
                start = time.process_time()
                row = runner.call(bench.Variant("continuous"), chunk, keys,
                                  seed + 1000 * epoch + first)
                row.update(epoch=epoch, seed=seed, measured=epoch == args.epochs,
                           cpu_time_s=time.process_time() - start)
                rows.append(row)
                states.update(call_states(row, keys, epoch, recorded))
                print(f"seed {seed} epoch {epoch} prompts {','.join(keys)} steps "
                      f"{row['decode_steps']} bound {row['lower_bound']} tokens "
                      f"{row['generated_tokens']} cpu {row['cpu_time_s']:.0f} s", flush=True)
                bench.write_traces(rows, out)  # after every call: a stopped run keeps its calls
                (out / f"rows_seed{seed}.json").write_text(json.dumps(rows))
                np.savez(out / f"hidden_seed{seed}.npz", **states)


def call_states(row: dict, keys: list[str], epoch: int, recorded: dict) -> dict:
    """`e<epoch>_p<key>_<index>` -> [length, H] states, one per generated token."""
    states, sample_id = {}, 0
    for key, lengths in zip(keys, row["lengths"]):
        for index, length in enumerate(lengths):
            stacked = np.stack(recorded[sample_id])
            if len(stacked) != length:
                raise RuntimeError(f"sample {sample_id}: {len(stacked)} states, {length} tokens")
            states[f"e{epoch}_p{key}_{index}"] = stacked
            sample_id += 1
    return states


def parse_seeds(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


# ---------------------------------------------------------------- replay


def load_calls(folders: list[Path], seed: int, prompts_per_step: int) -> list[dict]:
    from infsamp.sampling.traces import read_trace

    folder = next((f for f in folders if (f / f"rows_seed{seed}.json").exists()), None)
    if folder is None:
        raise SystemExit(f"no rows_seed{seed}.json in {', '.join(map(str, folders))}")
    rows = json.loads((folder / f"rows_seed{seed}.json").read_text())
    trace = read_trace(folder / f"trace_slots_seed{seed}.jsonl")
    states_file = folder / f"hidden_seed{seed}.npz"  # kept beside the traces, not committed
    hidden = np.load(states_file) if states_file.exists() else None
    calls = []
    for row, start in zip(rows, range(0, len(trace), prompts_per_step)):
        groups = trace[start:start + prompts_per_step]
        if row["lengths"] != [g.lengths for g in groups]:
            raise RuntimeError(f"{folder}: seed {seed}'s trace and rows disagree")
        states = None if hidden is None else [hidden[f"e{row['epoch']}_p{g.prompt_id}_{j}"]
                                              for g in groups for j in range(len(g.lengths))]
        for group in groups:  # another seed's prompt 0 is another prompt
            group.prompt_id = f"{seed}:{group.prompt_id}"
        calls.append(dict(groups=groups, epoch=row["epoch"], states=states,
                          decode_steps=row["decode_steps"]))
    return calls


def replay_call(call: dict, variant: str, predictor, args) -> object:
    """One call through the scheduler loop; its SamplerStats, with the replay's CPU time."""
    from infsamp.planner.kv_budget import kv_tokens_needed
    from infsamp.sampling.scheduler import SlotScheduler
    from infsamp.sampling.simulator import TraceEngine, _call_first_tokens, _call_samples

    class StateEngine(TraceEngine):
        def decode_step(self, active):
            for sample in active.values():  # the state at the token this step feeds in
                sample.hidden_state = states[sample.sample_id][sample.num_tokens].astype(np.float32)
            return super().decode_step(active)

    groups, states = call["groups"], call["states"]
    if states is None and getattr(predictor, "uses_hidden", False):
        raise SystemExit(f"{variant}: no hidden_seed<S>.npz beside this trace")
    samples, lengths = _call_samples(groups, args.max_new_tokens)
    policy, _, name = variant.partition(":")
    if hasattr(predictor, "set_lengths"):  # oracle, ceiling: this call's true lengths
        predictor.set_lengths(dict(enumerate(lengths)))
    budget = kv_tokens_needed(args.micro_group, args.max_new_tokens,
                              max(g.prompt_tokens for g in groups), args.B)
    options = {"prefix_tokens": args.prefix_tokens, "park_ratio": args.park_ratio}
    scheduler = SlotScheduler(samples, policy, args.micro_group, budget, predictor, **options)
    engine_type = TraceEngine if states is None else StateEngine  # None: tokens only
    engine = engine_type(lengths, _call_first_tokens(groups))
    start = time.process_time()
    while not scheduler.done:
        for slot, sample in scheduler.admit():
            engine.start(slot, sample)
        scheduler.step(engine.decode_step(scheduler.active()))
    scheduler.stats.schedule_time_s = time.process_time() - start
    if policy == "continuous" and scheduler.stats.decode_steps != call["decode_steps"]:
        raise RuntimeError(f"replayed continuous took {scheduler.stats.decode_steps} steps, the "
                           f"engine {call['decode_steps']}")
    return scheduler.stats


def make_ceiling(sigma: float):
    """`ceiling[:SIGMA]`: nothing known before a sample starts (a third of the limit for every
    pending sample), its true length (times exp(N(0, SIGMA)), fixed per sample) from its first
    point on. Measurement only."""
    from infsamp.sampling.length_predictor import OraclePredictor

    class Ceiling(OraclePredictor):
        name = "ceiling"
        uses_prefix = True

        def __init__(self):
            self._rng, self._noise = random.Random(0), {}
            super().__init__()

        def set_lengths(self, lengths):
            super().set_lengths(lengths)
            self._noise.clear()

        def predict(self, spec):
            return spec.max_new_tokens / 3

        def predict_remaining(self, spec, prefix_token_ids):
            if spec.sample_id not in self._noise:
                self._noise[spec.sample_id] = math.exp(self._rng.gauss(0.0, sigma))
            total = self._length_of(spec) * self._noise[spec.sample_id]
            return max(1.0, total - len(prefix_token_ids))

    return Ceiling()


def replay_variant(calls: list[dict], measured: list[bool], variant: str, args) -> dict:
    from infsamp.sampling.predictors import make_predictor

    name = variant.partition(":")[2]
    if name.partition(":")[0] == "ceiling":
        predictor = make_ceiling(float(name.partition(":")[2] or 0.0))
    else:
        predictor = make_predictor(name) if name else None
    stats = [(replay_call(c, variant, predictor, args), c) for c in calls]
    kept = [s for (s, _), m in zip(stats, measured) if m]
    total = {key: sum(getattr(s, key) for s in kept) for key in
             ("decode_steps", "lower_bound", "num_preemptions", "recomputed_tokens",
              "schedule_time_s", "generated_tokens")}
    taus = [s.predictor_kendall_tau for s in kept if s.predictor_kendall_tau is not None]
    maes = [s.predictor_mae for s in kept if s.predictor_mae is not None]
    total["kendall_tau"] = float(np.mean(taus)) if taus else None
    total["mae"] = float(np.mean(maes)) if maes else None
    return total


def schedules(folders: list[Path], args):
    """(seed, calls, measured flags) per seed (see the module docstring)."""
    seeds = parse_seeds(args.seeds)
    calls = {s: load_calls(folders, s, args.B) for s in seeds}
    for seed in seeds:
        if args.unseen:
            warm = [c for other in seeds if other != seed for c in calls[other]]
            first = [c for c in calls[seed] if c["epoch"] == 1]
            yield seed, warm + first, [False] * len(warm) + [True] * len(first)
        else:
            last = max(c["epoch"] for c in calls[seed])
            yield seed, calls[seed], [c["epoch"] == last for c in calls[seed]]


def replay(args: argparse.Namespace) -> None:
    report = {"args": vars(args), "seeds": {}}
    for seed, calls, measured in schedules([Path(f) for f in args.folders], args):
        report["seeds"][seed] = {v: replay_variant(calls, measured, v, args)
                                 for v in args.variants.split(",")}
    report["total"] = {v: {key: sum(s[v][key] for s in report["seeds"].values())
                           for key in ("decode_steps", "lower_bound", "num_preemptions",
                                       "recomputed_tokens", "schedule_time_s")}
                       for v in args.variants.split(",")}
    for scope, by_variant in [*report["seeds"].items(), ("total", report["total"])]:
        for variant, t in by_variant.items():
            print(format_row(scope, variant, t, by_variant))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def format_row(scope, variant: str, t: dict, by_variant: dict) -> str:
    cont = by_variant["continuous"]["decode_steps"]
    oracle = by_variant.get("length_aware:oracle", {}).get("decode_steps")
    share = ((cont - t["decode_steps"]) / (cont - oracle)) if oracle and cont > oracle else None
    quality = ("" if t.get("kendall_tau") is None
               else f" tau {t['kendall_tau']:.2f} MAE {t['mae']:.1f}")
    return (f"seed {scope!s:<5} {variant:<22} steps {t['decode_steps']:>6} bound "
            f"{t['lower_bound']:>6} parks {t['num_preemptions']:>4} recomputed "
            f"{t['recomputed_tokens']:>5} share "
            f"{'   -' if share is None else f'{share:5.2f}'} "
            f"us/step {1e6 * t['schedule_time_s'] / max(1, t['decode_steps']):5.0f}{quality}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--config", default="examples/smollm2_reasoning_gym.yaml")
    c.add_argument("--model", default="")
    c.add_argument("--prompts", type=int, default=1)
    c.add_argument("--epochs", type=int, default=2)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--seeds", default="0")
    c.add_argument("--out", required=True)
    r = sub.add_parser("replay")
    r.add_argument("folders", nargs="+")
    r.add_argument("--seeds", default="0")
    r.add_argument("--variants", default=VARIANTS)
    r.add_argument("--prefix-tokens", type=int, default=8)
    r.add_argument("--park-ratio", type=float, default=1.0)
    r.add_argument("--unseen", action="store_true")
    r.add_argument("--json", default="")
    for p in (c, r):
        p.add_argument("-B", type=int, default=1)
        p.add_argument("-G", type=int, default=32)
        p.add_argument("--micro-group", type=int, default=8)
        p.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    collect(args) if args.what == "collect" else replay(args)


if __name__ == "__main__":
    main()
