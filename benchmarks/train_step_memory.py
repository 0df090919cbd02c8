"""Peak memory of one training step: whole batch vs token-budget micro-batches.

    .venv/bin/python benchmarks/train_step_memory.py N BUDGET     # BUDGET 1000000 = whole batch

Prints the peak RSS growth of forward + loss + backward over N completions (one process per row).
"""
import resource
import sys
import time

import torch

from infsamp.algorithm.logprobs import build_micro_batches, micro_batch_logprobs
from infsamp.algorithm.losses import LOSS_TYPES, BatchTotals, per_token_loss
from infsamp.models.tiny import build_model, build_tokenizer

n, budget = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
torch.set_num_threads(2)
tok = build_tokenizer()
model = build_model(tok)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, len(tok), (64,), generator=g).tolist() for _ in range(n)]
completions = [torch.randint(3, len(tok), (int(length),), generator=g).tolist()
               for length in torch.randint(32, 512, (n,), generator=g)]
adv = torch.randn(n, generator=g)
totals = BatchTotals.from_lengths([len(c) for c in completions], 512)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.time()
k = 0
for mb in build_micro_batches(prompts, completions, max_tokens=budget, pad_token_id=0):
    logps = micro_batch_logprobs(model, mb)
    loss, _ = per_token_loss(logps, None, None, mb.rows(adv), epsilon_low=0.2, epsilon_high=0.2,
                             beta=0.0, mask=mb.completion_mask)
    LOSS_TYPES["dapo"].aggregate(loss, mb.completion_mask, totals).backward()
    k += 1
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"N={n} budget={budget} micro_batches={k} peak_rss_growth_MiB={(peak - base) / 1024:.0f} "
      f"seconds={time.time() - t:.1f}")
