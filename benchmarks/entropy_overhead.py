"""Cost of the token entropy in the chunked log-softmax: time and peak RSS of forward + backward
over random fp32 logits [B, T, V], with `logits_log_softmax` for log-probs alone or with entropy.

    .venv/bin/python benchmarks/entropy_overhead.py logps      # log-probs only
    .venv/bin/python benchmarks/entropy_overhead.py entropy    # log-probs and entropy, one pass

One mode per process (peak RSS is per process); 1 torch thread; median of 3 repeats.
"""

import argparse
import resource
import time

import torch

from infsamp.algorithm.lm_head import logits_log_softmax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("logps", "entropy"))
    parser.add_argument("--shape", default="4,512,32000", help="B,T,V of the logits")
    args = parser.parse_args()
    torch.set_num_threads(1)
    b, t, v = (int(x) for x in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=g).requires_grad_()  # [B, T, V]
    index = torch.randint(0, v, (b, t), generator=g)  # [B, T]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(3):
        start = time.perf_counter()
        logps, _ = logits_log_softmax(logits, index, with_entropy=args.mode == "entropy")  # [B, T]
        logps.sum().backward()
        times.append(time.perf_counter() - start)
        logits.grad = None
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(f"{args.mode}: median {sorted(times)[1]:.2f} s, peak RSS growth {peak:.0f} MiB "
          f"(logits {b * t * v * 4 / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
