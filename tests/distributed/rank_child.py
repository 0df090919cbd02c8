"""What each process of a test launch runs: an optional fault, then one or more `infsamp` runs.

    torchrun --nproc-per-node 2 tests/distributed/rank_child.py RUNS.json [KILL]

RUNS.json holds a list of argument lists (each one `infsamp train ...`, run one after the other in
the same processes, which saves the ~10 s of imports per launch) and for each run the folder the
recording reward writes to; optionally `argv_by_rank` (another argument list for some ranks) and
`expect` (the exit code the run must end with for the next one to start). Each rank writes its PID
to RUNS.rank-R.pid and each run's exit code to a line of RUNS.rank-R.codes. KILL is
`RANK:sampling@N` (tests/faults/fault_harness.py's moments): that rank SIGKILLs itself there (or
pauses: `RANK:pause@N`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))


def main() -> int:
    spec, rank = Path(sys.argv[1]), os.environ["RANK"]
    runs = json.loads(spec.read_text())
    spec.with_suffix(f".rank-{rank}.pid").write_text(str(os.getpid()))
    if len(sys.argv) > 2:
        rank, _, moment = sys.argv[2].partition(":")
        if int(os.environ["RANK"]) == int(rank):
            import fault_harness

            name, _, step = moment.partition("@")
            fault_harness.ARM[name](int(step))
            die = fault_harness._die

            def note_and_die() -> None:  # the test measures how long the others take to stop
                Path(sys.argv[1]).with_suffix(".killed").write_text(str(time.time()))
                die()

            fault_harness._die = note_and_die
    from infsamp.cli import main as cli

    for run in runs:
        os.environ["INFSAMP_TEST_RECORD"] = run["record"]
        code = cli(run.get("argv_by_rank", {}).get(rank, run["argv"]))
        with spec.with_suffix(f".rank-{rank}.codes").open("a") as codes:
            codes.write(f"{code}\n")
        if code != run.get("expect", 0):
            return code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
