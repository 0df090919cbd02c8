"""The GPU suite's driver: the plan's five parts in order of value, each in its own process and cap.

    bash benchmarks/gpu_suite.sh OUT                 # the H200 run (installs .whl/ first)
    bash benchmarks/gpu_suite.sh --cpu-smoke OUT     # the same plan at toy sizes on the CPU
    python benchmarks/gpu_suite.py --out OUT --profile h200 --parts 1,3 --cap 1=300

Parts (`PARTS`): 1 the paper's memory table, 2 the planner against the device, 3 infsamp against
TRL, 4 precision, 5 engine speed. Each runs as `gpu_suite.py --run-part N` in a fresh interpreter
(its own CUDA context and peaks) and writes its rows to a JSON file outside OUT as it goes. A part
that fails is one line in the report and the next part runs; a part past its cap plus a grace is
killed with its process group and keeps the rows it wrote. The caps (`Profile.caps_s`) add up to
the run's budget; a part never gets more than its share of the time still left, so the whole run
ends inside `--budget-s` (the profile's: 465 s on the H200, 285 s for the CPU smoke) plus at most
one grace.

OUT receives three files (the device machine returns at most 8, two folders deep): `results.json`
(everything), `results.md` (one table per part, with the date, device, versions, command and load)
and `suite.log` (the install and every part's output). Both results files are rewritten after each
part, so a run stopped from outside still leaves what was done.

Deliberately simple: parts run one after another (one GPU); no retries (a re-run with `--parts`
and `--cap` picks up what a cap cut short).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
for entry in (ROOT / "src", BENCHMARKS):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

from gpu_suite_common import PROFILES, Part, with_settings  # noqa: E402  (benchmarks/, just put on sys.path)

GRACE_S = 15  # past its cap a part gets this long to finish its cell before it is killed
INSTALL_TIMEOUT_S = 90
SITE = Path(tempfile.gettempdir()) / "infsamp-gpu-suite-site"
OUTPUT_FILES = ("results.json", "results.md", "suite.log")

# number -> (title, "module:function" run with a Part, columns of its markdown table)
PARTS: dict[int, tuple[str, str, tuple[str, ...]]] = {
    1: ("The paper's memory table (generation peak with full, rounds, continuous)",
        "gpu_suite_sampling:part_memory_table",
        ("G", "policy", "g", "complete", "decode_steps", "expected_steps", "tokens_per_s",
         "peak_allocated_gib", "kv_gib", "planned_gib", "same_as")),
    2: ("The planner against the device (whole GRPO step)",
        "gpu_suite_training:part_planner",
        ("model", "lora_rank", "g", "micro_batch_tokens", "fits", "measured_generation_gib",
         "planned_generation_gib", "measured_training_gib", "planned_training_gib",
         "measured_peak_gib", "planned_peak_gib", "error_pct", "within_15pct")),
    3: ("infsamp against TRL (whole-step and generation peak, step time)",
        "gpu_suite_trl:part_vs_trl",
        ("framework", "G", "peak_mib", "generation_peak_mib", "seconds_per_step",
         "mean_completion_length", "completion_tokens_per_step_s", "peak_ratio_trl",
         "generation_peak_ratio_trl_cb", "tokens_per_s_ratio_best_peer")),
    4: ("Precision (bf16 follow ratio, step time per mode)",
        "gpu_suite_training:part_precision",
        ("what", "mode", "steps", "follow_ratio", "relative_error", "step_ms", "first_step_s",
         "peak_gib", "state_mib")),
    5: ("Engine speed (slot engine against transformers' generate) and the chunked LM head",
        "gpu_suite_sampling:part_engine_speed",
        ("what", "engine", "g", "complete", "tokens", "tokens_per_s", "peak_gib",
         "chunked_lm_head", "micro_batch_tokens")),
}


# ---------------------------------------------------------------- one part (child process)


def run_part(number: int, target: str, profile, cap_s: float, result: Path) -> int:
    """Run `target` ("module:function", importable from benchmarks/) on a Part."""
    module, function = target.split(":")
    part = Part(number, target, profile, cap_s, result)
    part.save()
    getattr(importlib.import_module(module), function)(part)
    part.save()
    return 0


# ---------------------------------------------------------------- the plan (parent process)


def part_caps(profile_caps: dict[int, float], parts: list[int], overrides: dict[int, float]):
    return {n: float(overrides.get(n, profile_caps[n])) for n in parts}


def share_of_time_left(caps: dict[int, float], number: int, done: set[int],
                       time_left_s: float) -> float:
    """The part's cap, or its share of the time left (by cap) if less is left."""
    waiting = {n: c for n, c in caps.items() if n not in done}
    total = sum(waiting.values()) + GRACE_S  # one part's grace held back
    return max(0.0, min(caps[number], time_left_s * caps[number] / total))


def child_env(profile: str) -> dict[str, str]:
    """The parts' environment: src/, benchmarks/ and the installed wheels first; offline; one
    torch thread on the CPU (on a shared 2-core machine two threads spin-wait: vs_trl.py)."""
    paths = [str(ROOT / "src"), str(BENCHMARKS)] + ([str(SITE)] if SITE.exists() else [])
    old = os.environ.get("PYTHONPATH")
    threads = {"OMP_NUM_THREADS": "1"} if PROFILES[profile].device == "cpu" else {}
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])),
            "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1", **threads}


def run_child(number: int, args, cap_s: float, scratch: Path, log) -> dict:
    """One part in its own process group; its JSON plus status ok / failed / killed."""
    result = scratch / f"part{number}.json"
    command = [sys.executable, __file__, "--run-part", str(number), "--target", PARTS[number][1],
               "--profile", args.profile, "--cap-s", f"{cap_s:.1f}", "--result", str(result),
               *[f"--set={item}" for item in args.set]]
    log.write(f"\n===== part {number}: {PARTS[number][0]} (cap {cap_s:.0f} s)\n")
    log.flush()
    offset = log.tell()
    began, cpu_before = time.monotonic(), children_cpu_s()
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                             env=child_env(args.profile), cwd=ROOT, start_new_session=True)
    try:
        code = child.wait(timeout=cap_s + GRACE_S)
        status = "ok" if code == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        code, status = None, "killed"
    data = json.loads(result.read_text()) if result.exists() else {"rows": [], "notes": {}}
    data.update(part=number, title=PARTS[number][0], status=status, exit_code=code,
                cap_s=round(cap_s, 1), wall_s=round(time.monotonic() - began, 1),
                cpu_s=round(children_cpu_s() - cpu_before, 1))
    if status != "ok":
        data["reason"] = failure_reason(status, code, cap_s, Path(log.name), offset)
    return data


def children_cpu_s() -> float:
    """CPU seconds of the waited-for child processes so far (steadier than wall time when the
    machine is shared)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def failure_reason(status: str, code: int | None, cap_s: float, log_path: Path,
                   offset: int) -> str:
    """One line: the hard cap, or the part's last line of output that is not a traceback frame."""
    if status == "killed":
        return f"killed at its hard cap ({cap_s + GRACE_S:.0f} s); rows so far kept"
    with open(log_path, errors="replace") as log:
        log.seek(offset)
        lines = [line.strip() for line in log.read().splitlines()]
    errors = [line for line in lines if line and not line.startswith(("File ", "Traceback"))]
    return f"exit {code}: {errors[-1][:300] if errors else 'no output'}"


def install_wheels(wheels: Path, log) -> dict:
    """pip install --no-index the carried wheels into SITE (the machine cannot reach an index)."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return {"wheels": [], "status": f"no wheels in {wheels}: nothing installed"}
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE),
               *map(str, found)]
    log.write("===== install: " + " ".join(command) + "\n")
    log.flush()
    try:
        done = subprocess.run(command, check=False, stdout=log, stderr=subprocess.STDOUT,
                              timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"wheels": [w.name for w in found], "status": "pip timed out (see suite.log)"}
    status = "ok" if done.returncode == 0 else f"pip exit {done.returncode} (see suite.log)"
    return {"wheels": [w.name for w in found], "status": status}


def environment(profile: str) -> dict:
    """Date, machine, load and the versions that matter, read in a child (torch imports there)."""
    probe = ("import json, importlib.metadata as m, torch, platform\n"
             "def v(n):\n  try: return m.version(n)\n  except Exception: return None\n"
             "d = {n: v(n) for n in ('torch','transformers','trl','torchao','peft','datasets')}\n"
             "d['cuda'] = torch.cuda.get_device_name() if torch.cuda.is_available() else None\n"
             "d['python'] = platform.python_version()\nprint(json.dumps(d))")
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True,
                          text=True, env=child_env(profile), timeout=120)
    versions = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
        "probe_error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "profile": profile,
            "host": os.uname().nodename, "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()], **versions}


def check_out_dir(out: Path) -> None:
    """OUT may exist (the device machine's $OUT does) but must not hold another run's files."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"gpu_suite: --out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise SystemExit(f"gpu_suite: --out {out}: not empty; give a new or empty folder "
                         "(a run never shares its folder with another)")


def run_plan(args) -> dict:
    out = Path(args.out)
    check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    began, profile = time.monotonic(), args.profile_sizes
    caps = part_caps(profile.caps_s, args.parts, args.caps)
    budget = args.budget_s or profile.budget_s
    report = {"command": " ".join(["benchmarks/gpu_suite.py", *sys.argv[1:]]),
              "budget_s": budget, "settings": args.set, "parts": []}
    with open(out / "suite.log", "a") as log, tempfile.TemporaryDirectory() as scratch:
        report["install"] = install_wheels(Path(args.wheels), log) if args.wheels else None
        report["environment"] = environment(args.profile)
        write_report(out, report)
        done: set[int] = set()
        for number in args.parts:
            time_left = budget - (time.monotonic() - began)
            cap = share_of_time_left(caps, number, done, time_left)
            report["parts"].append(run_child(number, args, cap, Path(scratch), log) if cap > 0
                                   else skipped_part(number))
            done.add(number)
            report["total_s"] = round(time.monotonic() - began, 1)
            write_report(out, report)
            print(summary_line(report["parts"][-1]), flush=True)
    report["environment"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    write_report(out, report)
    return report


def skipped_part(number: int) -> dict:
    return {"part": number, "title": PARTS[number][0], "status": "skipped", "rows": [],
            "reason": "no time left in the run's budget"}


def summary_line(part: dict) -> str:
    rows = [r for r in part.get("rows", []) if "error" not in r]
    errors = len(part.get("rows", [])) - len(rows)
    tail = f": {part['reason']}" if part.get("reason") else ""
    return (f"part {part['part']} {part['status']} in {part.get('wall_s', 0)} s "
            f"({part.get('cpu_s', 0)} CPU s): {len(rows)} "
            f"row(s), {errors} failed cell(s), {len(part.get('skipped', []))} skipped{tail}")


# ---------------------------------------------------------------- the report


def cell_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def part_table(part: dict) -> list[str]:
    columns = PARTS[part["part"]][2]
    lines = [f"## Part {part['part']}: {part['title']}", "",
             f"status: {part['status']}" + (f" ({part['reason']})" if part.get("reason") else "")
             + f"; {part.get('wall_s', 0)} s ({part.get('cpu_s', 0)} CPU s) of a "
             f"{part.get('cap_s', 0)} s cap", ""]
    if part.get("rows"):
        lines += ["| cell | " + " | ".join(columns) + " |",
                  "|---|" + "---|" * len(columns)]
        for row in part["rows"]:
            if "error" in row:
                lines.append(f"| {row.get('cell', '')} | error: {row['error']} |"
                             + " |" * (len(columns) - 1))
                continue
            lines.append(f"| {row.get('cell', '')} | "
                         + " | ".join(cell_text(row.get(c)) for c in columns) + " |")
    for key, value in part.get("notes", {}).items():
        lines.append(f"- {key}: {json.dumps(value, default=str)}")
    if part.get("skipped"):
        lines.append(f"- skipped (cap): {', '.join(part['skipped'])}")
    return lines + [""]


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    machine = (f"{env.get('date')} on {env.get('cuda') or 'CPU'} ({env.get('profile')} profile, "
               f"{env.get('cpus')} CPUs, load {env.get('load_average')} -> "
               f"{env.get('load_average_end')}); torch {env.get('torch')}, transformers "
               f"{env.get('transformers')}, trl {env.get('trl')}, torchao {env.get('torchao')}, "
               f"python {env.get('python')}")
    command = (f"command: `{report['command']}`; total {report.get('total_s', 0)} s of a "
               f"{report['budget_s']:.0f} s budget")
    lines = ["# infsamp GPU suite", "", machine, "", command, ""]
    if report.get("install"):
        wheels = ", ".join(report["install"]["wheels"])
        lines += [f"install: {report['install']['status']} ({wheels})", ""]
    for part in report["parts"]:
        lines += part_table(part)
    return "\n".join(lines)


def write_report(out: Path, report: dict) -> None:
    for name, text in (("results.json", json.dumps(report, indent=1, default=str)),
                       ("results.md", markdown(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


# ---------------------------------------------------------------- command line


def parse_caps(items: list[str]) -> dict[int, float]:
    caps = {}
    for item in items:
        number, _, seconds = item.partition("=")
        try:
            caps[int(number)] = float(seconds)
        except ValueError:
            raise SystemExit(f"gpu_suite: --cap {item!r}: give PART=SECONDS, e.g. 1=300") from None
    return caps


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for results.json, results.md and suite.log")
    p.add_argument("--profile", choices=sorted(PROFILES), default="h200")
    p.add_argument("--parts", default="1,2,3,4,5", help="which parts, in this order")
    p.add_argument("--cap", action="append", default=[], metavar="PART=SECONDS",
                   help="a part's time cap instead of the profile's (repeatable)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="the whole run's time (0: the profile's: h200 465 s, cpu-smoke 285 s)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a size of the profile (gpu_suite_common.Profile), e.g. plan_gib=12 or "
                        "memory_groups=32,64 (repeatable)")
    p.add_argument("--wheels", default="", help="install these carried wheels first (.whl)")
    p.add_argument("--run-part", type=int, help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--cap-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.parts = [int(n) for n in args.parts.split(",") if n.strip()]
    except ValueError:
        p.error(f"--parts {args.parts!r}: give part numbers, e.g. 1,3")
    unknown = [n for n in args.parts if n not in PARTS]
    if unknown:
        p.error(f"--parts: no part {unknown[0]} (parts are {', '.join(map(str, PARTS))})")
    args.caps = parse_caps(args.cap)
    args.profile_sizes = with_settings(PROFILES[args.profile], args.set)  # checked before any work
    if args.run_part is None and not args.out:
        p.error("--out is required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run_part is not None:
        return run_part(args.run_part, args.target, args.profile_sizes, args.cap_s,
                        Path(args.result))
    report = run_plan(args)
    print(f"wrote {Path(args.out) / 'results.json'} and results.md ({report['total_s']} s)")
    return 0 if all(p["status"] == "ok" for p in report["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
