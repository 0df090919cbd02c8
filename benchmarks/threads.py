"""CPU threads for a real model: 1 vs 2 torch threads, on an idle core pair and beside a busy one.

    .venv/bin/python benchmarks/threads.py [--model smollm2-135m] [--repeats 3] [--out FILE]

For each thread count it times, on `--model` (fp32, CPU), a training pass (forward + backward of
4 sequences x 128 tokens) and a decode (greedy `generate` of 4 sequences, 16 new tokens after a
32-token prompt), `--repeats` times; then the same again while a second process of this script
spins one core (a stand-in for another job on the machine). Reports the median wall time and the
process CPU time of each, with the load average before each. Prints one JSON line per measurement
as it is made (a run cut short keeps what it measured), then the whole as one JSON object.

Deliberately simple: one process; the busy neighbour is a pure-Python loop (one core, no memory
traffic), gentler than a real training job next door.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def _timed(fn, repeats: int) -> dict:
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"wall_s": round(statistics.median(walls), 3),
            "cpu_s": round(statistics.median(cpus), 3)}


def measure(model, threads: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    tokens = torch.randint(100, 1000, (4, 128))
    prompt = torch.randint(100, 1000, (4, 32))

    def train_pass():
        model.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()

    @torch.no_grad()
    def decode():
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                       max_new_tokens=16, min_new_tokens=16, do_sample=False,
                       pad_token_id=0)

    train_pass()  # warm-up
    return {"train_pass": _timed(train_pass, repeats), "decode_16": _timed(decode, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    from infsamp.config import ModelConfig
    from infsamp.models.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(ModelConfig(name_or_path=args.model, device="cpu"))
    result = {"model": args.model, "cores": os.cpu_count(),
              "parameters": sum(p.numel() for p in model.parameters())}
    for part in ("idle", "beside_one_busy_core"):
        stop = multiprocessing.Event()
        spinner = multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
        if part != "idle":
            spinner.start()
            time.sleep(1)
        result[part] = {}
        for threads in (1, 2, 1, 2):  # twice, interleaved: the machine's load drifts
            load = round(os.getloadavg()[0], 2)
            row = {"part": part, "threads": threads, "load_before": load,
                   **measure(model, threads, args.repeats)}
            print(json.dumps(row), flush=True)
            result[part].setdefault(f"{threads}_threads", []).append(row)
        stop.set()
        if spinner.is_alive():
            spinner.join()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
