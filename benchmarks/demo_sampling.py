"""The demo's sampling alone: the embedded model, `--calls` calls of 4 arithmetic prompts x 8
completions at the demo's settings (continuous, g = 16, temperature 0.7), each call's seed fixed.
Prints the CPU seconds of the calls, the decode steps, CPU ms per step and a hash of every
completion's tokens: run it from two checkouts (each pinned, one torch thread) to compare the
decode step's cost with the completions unchanged.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/demo_sampling.py --calls 6

Deliberately simple: a sampler used alone (sized per call), no training between calls; the
seeds go through `generator` (what every checkout's sampler takes).
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch

from infsamp.config import ModelConfig
from infsamp.config_algorithm import SamplingConfig
from infsamp.models.loading import load_model_and_tokenizer
from infsamp.sampling.sampler import GroupSampler
from infsamp.tasks.arithmetic import generate_problems

PROMPTS_PER_CALL, NUM_GENERATIONS = 4, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model_and_tokenizer(ModelConfig(), torch.device("cpu"))
    problems = generate_problems(PROMPTS_PER_CALL * args.calls, seed=1)
    prompts = [tokenizer(p["prompt"])["input_ids"] for p in problems]
    sampler = GroupSampler(model, tokenizer, SamplingConfig(micro_group=16))
    digest, cpu_s, steps, tokens = hashlib.sha256(), 0.0, 0, 0
    for call in range(args.calls):
        batch = prompts[PROMPTS_PER_CALL * call: PROMPTS_PER_CALL * (call + 1)]
        start = time.process_time()
        result = sampler.sample(batch, NUM_GENERATIONS,
                                generator=torch.Generator().manual_seed(1000 + call))
        cpu_s += time.process_time() - start
        steps += result.stats.decode_steps
        for completion in result.completions:
            digest.update(str(completion.token_ids).encode())
            tokens += len(completion.token_ids)
    print(f"cpu_s={cpu_s:.2f} decode_steps={steps} tokens={tokens} "
          f"cpu_ms_per_step={1000 * cpu_s / steps:.2f} "
          f"completions_sha256={digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
