"""Time one held-out evaluation of a config, as the trainer runs it at step 0 (the checkout on
PYTHONPATH decides how): wall and CPU seconds of `GRPOTrainer._evaluate` alone, after loading,
and every problem's completion ids (to compare two checkouts problem by problem).

    PYTHONPATH=CHECKOUT/src taskset -c 1 python benchmarks/eval_time.py CONFIG OUT_DIR [k=v ...]

Prints one JSON line: {"wall_s", "cpu_s", "accuracy", "num_problems"}; writes OUT_DIR/ids.json.
Pair two checkouts side by side with `benchmarks/eval_versus.sh`.
Deliberately simple: one process, the base model (the step-0 evaluation), no checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from infsamp.config_io import load_config
from infsamp.run.logs import RunLogger
from infsamp.run.trainer import GRPOTrainer


def main(config: str, out: str, *pairs: str) -> None:
    overrides = {"logging.output_dir": out, "checkpointing.save_every": 0,
                 "checkpointing.keep_best": "", "logging.progress_bar": False}
    overrides.update(dict(pair.split("=", 1) for pair in pairs))
    trainer = GRPOTrainer(load_config(config, overrides))
    logger = RunLogger(Path(out), 1, 0, 1, False)
    wall, cpu = time.perf_counter(), time.process_time()
    accuracy = trainer._evaluate(logger)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rows = [json.loads(line) for line in (Path(out) / "eval_completions.jsonl").open()]
    (Path(out) / "ids.json").write_text(json.dumps([row.get("completion") for row in rows]))
    print(json.dumps({"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "accuracy": accuracy,
                      "num_problems": len(trainer.eval_prompts.prompts)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
