"""`infsamp bench sampling`'s report: the targets per engine and g (peak KV against G, full
against continuous, continuous against rounds, vLLM against the slot engine), the printed table
and the plot (peak KV bytes and decode steps against G). Pure Python over the bench's rows, but
for matplotlib in `plot`.

Deliberately simple: one figure per target, from single runs (no repetitions).
"""

from __future__ import annotations

from pathlib import Path

from infsamp.commands.engine_choice import print_startup
from infsamp.files import headless_pyplot

POLICIES = ("full", "rounds", "continuous")


def _cell(rows, workload, group_size, policy):
    return next((r for r in rows
                 if (r["workload"], r["G"], r["policy"]) == (workload, group_size, policy)), None)


def check_targets(rows: list[dict]) -> dict:
    """The policy targets per engine and g (prefixed `engine g=..` when there are several), and the
    vLLM / slot engine tokens/s of every cell both ran."""
    setups = sorted({(r["engine"], r["micro_group"]) for r in rows})
    targets = {}
    for engine, g in setups:
        prefix = f"{engine} g={g}: " if len(setups) > 1 else ""
        subset = [r for r in rows if (r["engine"], r["micro_group"]) == (engine, g)]
        targets.update({prefix + k: v for k, v in policy_targets(subset).items()})
    for r in rows:
        if "step_over_forward" in r:
            cell = f"{r['workload']} G={r['G']} g={r['micro_group']} {r['policy']}: decode step"
            for name, what in (("forward", "model forward over a ready cache"),
                               ("matmul", "its matrix products alone")):
                targets[f"{cell} / {what} (wall)"] = r[f"step_over_{name}"]
                targets[f"{cell} / {what} (CPU)"] = r[f"step_over_{name}_cpu"]
        other = next((o for o in rows if o["engine"] == "slots" and r["engine"] == "vllm" and all(
            o[k] == r[k] for k in ("workload", "G", "micro_group", "policy"))), None)
        if other is not None:
            name = (f"{r['workload']} G={r['G']} g={r['micro_group']} {r['policy']}: "
                    "vllm / slots tokens/s")
            targets[name] = r["tokens_per_second"] / other["tokens_per_second"]
    return targets


def policy_targets(rows: list[dict]) -> dict:
    targets = {}
    for workload in sorted({r["workload"] for r in rows}):
        sizes = sorted({r["G"] for r in rows if r["workload"] == workload})
        for policy in ("rounds", "continuous"):
            first, last = (_cell(rows, workload, size, policy) for size in (sizes[0], sizes[-1]))
            if first and last:
                targets[f"{workload}/{policy}: peak KV G={sizes[-1]} / G={sizes[0]}"] = (
                    last["peak_kv_bytes"] / first["peak_kv_bytes"])
        for size in sizes:
            full, cont = (_cell(rows, workload, size, policy) for policy in ("full", "continuous"))
            if full and cont:
                targets[f"{workload}: peak KV full / continuous at G={size}"] = (
                    full["peak_kv_bytes"] / cont["peak_kv_bytes"])
    for r in rows:
        if r["policy"] == "continuous" and r["workload"] == "embedded":
            targets[f"embedded G={r['G']}: sampler overhead share of wall time"] = (
                r["overhead_fraction"])
    rounds, cont = (_cell(rows, "controlled", 32, policy) for policy in ("rounds", "continuous"))
    if rounds and cont:
        name = "controlled G=32: continuous"
        targets[f"{name} decode steps saved vs rounds"] = (
            1 - cont["decode_steps"] / rounds["decode_steps"])
        for key, what in (("tokens_per_second", "second"), ("tokens_per_cpu_second", "CPU second")):
            targets[f"{name} / rounds tokens per {what}"] = cont[key] / rounds[key]
    return targets


HEADER = (f"{'engine':<7}{'workload':<11}{'G':>5} {'policy':<11}{'g':>4}{'steps':>8}{'bound':>8}"
          f"{'peak KV':>11}{'prefill':>8}{'preempt':>8}{'tokens':>8}{'wall s':>8}{'tok/s':>8}"
          f"{'tok/cpu-s':>10}{'ovh':>6}")
# --bound, CPU ms per step: the engine's replayed steps, the model's own forward of them over a
# ready cache, their matrix products alone, and the ratios (wall figures in sampling.json)
BOUND_HEADER = (f"{'step ms':>9}{'fwd ms':>9}{'step/fwd':>9}{'mm ms':>9}{'step/mm':>9}")


def format_row(r: dict) -> str:
    return (f"{r['engine']:<7}{r['workload']:<11}{r['G']:>5} {r['policy']:<11}{r['g']:>4}"
            f"{r['decode_steps']:>8}{r['lower_bound']:>8}{r['peak_kv_bytes'] / 2**20:>9.2f}Mi"
            f"{r['prefill_tokens']:>8}{r['num_preemptions']:>8}{r['generated_tokens']:>8}"
            f"{r['wall_time_s']:>8.1f}{r['tokens_per_second']:>8.0f}"
            f"{r['tokens_per_cpu_second']:>10.0f}{100 * r['overhead_fraction']:>5.1f}%"
            + (f"{r['step_cpu_ms']:>9.1f}{r['forward_cpu_ms']:>9.1f}"
               f"{r['step_over_forward_cpu']:>8.2f}x{r['matmul_cpu_ms']:>9.1f}"
               f"{r['step_over_matmul_cpu']:>8.2f}x" if "step_over_forward" in r else ""))


def print_report(rows: list[dict], report: dict) -> None:
    print("\n" + HEADER + (BOUND_HEADER if any("step_over_forward" in r for r in rows) else ""))
    for r in rows:
        print(format_row(r))
    print("\ntargets:")
    for name, value in report["targets"].items():
        print(f"  {name}: {value:.3f}")
    if report["profile"]:
        print("profile (continuous, G=32, g=8), share of profiled time:")
        for name, share in report["profile"]["share_of_profiled_time"].items():
            print(f"  {name:<36} {100 * share:5.1f}%")
    print_startup(report.get("engine_startup_s", {}))


def plot(rows: list[dict], path: Path) -> None:
    plt = headless_pyplot()

    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(len(names), 2, figsize=(10, 3.6 * len(names)), squeeze=False)
    setups = sorted({(r["engine"], r["micro_group"]) for r in rows})
    for row_axes, workload in zip(axes, names):
        for (engine, g), policy in ((setup, p) for setup in setups for p in POLICIES):
            key = (workload, policy, engine, g)
            cells = sorted((r for r in rows
                            if (r["workload"], r["policy"], r["engine"], r["micro_group"]) == key),
                           key=lambda r: r["G"])
            label = policy if len(setups) == 1 else f"{engine} g={g} {policy}"
            sizes = [r["G"] for r in cells]
            peaks = [r["peak_kv_bytes"] / 2**20 for r in cells]
            row_axes[0].plot(sizes, peaks, marker="o", label=label)
            steps = [r["decode_steps"] / r["num_prompts"] for r in cells]
            row_axes[1].plot(sizes, steps, marker="o", label=label)
        for ax, label in zip(row_axes, ("peak KV cache (MiB)", "decode steps per prompt")):
            ax.set(xscale="log", yscale="log", xlabel="G (samples per prompt)", ylabel=label,
                   title=workload)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
