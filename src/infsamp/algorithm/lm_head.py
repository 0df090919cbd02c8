"""Log-probs and entropies from the final hidden states, the LM head applied per chunk, so that no
`[tokens, vocabulary]` tensor exists at once, in the forward or in the backward.

How the model is called: its forward runs as usual (through DDP, FSDP2 and peft wrappers, autocast
included), with a forward pre-hook on its output embedding (`get_output_embeddings()`, the LM head,
tied to the input embedding or not, LoRA-wrapped or not). The hook receives the head's input, the
final hidden states of the kept positions, computes the chosen-token log-probs there (where FSDP
holds the head's weights whole and autocast is on) and hands the head an empty input, so the
model's own logits are `[b, 0, V]` and whatever the model does to them afterwards costs nothing.
Logit transforms a model applies after its head (Gemma's final soft-capping, Cohere's
`logit_scale`, Granite's `logits_scaling`) are applied per chunk instead (`logit_transform`).
A model whose head cannot be found or hooked gets the full-logits path (`logits_log_softmax`).

The computation, for a plain `nn.Linear` head (`ChunkedLinearLogProbs`, a custom autograd function):
- forward, in chunks of rows (`logits_chunk_rows`): logits of the chunk -> transform -> / T ->
  fp32 -> chosen logit - logsumexp, and the entropy when asked. Per row these are the very
  operations of the full-logits path, so the log-probs are the same (tested). Saved: the hidden
  states `[n, H]` and the fp32 normaliser `[n]`, no logits.
- backward, in chunks of the VOCABULARY (`logits_chunk_columns`): each chunk's logits are
  recomputed for all rows (in the forward's autocast state), `dlogp/dlogits = onehot - p` with
  `p = exp(logits - normaliser)`, and torch's own autograd carries that through the transform,
  the temperature and the matmul of that chunk. The weight gradient of each vocabulary slice is
  written once (`[C, n] @ [n, H]`, a full-depth matmul); the hidden gradient `[n, H]` is summed
  over the slices in fp32.
Any other head module (peft's LoRA `lora.Linear` on the head, a quantised linear) goes through
`torch.utils.checkpoint` per chunk of rows (non-reentrant: the module's own autograd, recomputed in
the backward), which is exact for any module and slower.
Only real completion tokens (mask 1) go through the head; padded positions get log-prob 0.

Why this design (read 2026-12: Liger-Kernel `fused_linear_cross_entropy` / `fused_linear_ppo`,
Unsloth's `UnslothEfficientGRPO`, TRL's `_ChunkedLogProbFunction`):
- Liger and Unsloth chunk rows and compute the loss AND its gradients inside the forward
  (`torch.func` / a fused kernel), so nothing is recomputed. That needs the loss inside the head
  function; here the loss registry (`algorithm/losses.py`), the whole-step normalisers and
  sequence-level ratios (gspo) stay outside it, so we pay one recomputation of the head in the
  backward instead. Liger also accumulates the weight gradient once per row chunk (a `[V, H]`
  read-modify-write with a shallow matmul), which on a CPU costs more than the matmuls.
- TRL chunks the vocabulary in both passes with an online logsumexp. Its log-probs differ from the
  full softmax in the last bits, and it reads `lm_head.weight` directly (a LoRA adapter on the head
  would be ignored). We keep row chunks in the forward (exact log-probs and entropy) and take
  TRL's vocabulary chunks for the backward (each weight slice written once), and route every
  non-`Linear` head through its own module.

Deliberately simple: the head is applied once per forward (models with several heads, e.g.
multi-token prediction, are not handled); chunk sizes come from a fixed byte size
(`planner.activations.LOGITS_CHUNK_BYTES`), not from free memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from infsamp.models.device import base_model
from infsamp.planner.activations import logits_chunk_columns, logits_chunk_rows

Transform = Callable[[Tensor], Tensor]
GIVEN_LOGITS_CHUNK_ROWS = 256  # rows per fp32 logsumexp chunk of given logits (full-logits path)


@dataclass(frozen=True)
class HeadSpec:
    """What turns the head's output into the logits the log-softmax sees."""

    temperature: float = 1.0
    transform: Transform | None = None  # the model's own post-head transform (logit_transform)
    with_entropy: bool = False

    def scale(self, head_output: Tensor) -> Tensor:
        """Head output -> the model's transform -> / temperature, in the head's dtype."""
        logits = head_output if self.transform is None else self.transform(head_output)
        if self.temperature > 0 and self.temperature != 1.0:  # 0 (greedy) leaves logits unscaled
            logits = logits / self.temperature
        return logits

    def logits(self, head_output: Tensor) -> Tensor:
        """The fp32 logits the log-softmax sees, as the full-logits path computes them."""
        return self.scale(head_output).float()


# --- the model's own post-head transforms -------------------------------------------------------


def logit_transform(config) -> Transform | None:
    """What the model's forward does to its head's output before returning logits, or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is None:
        return None
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:  # Gemma 2/3/4, nanochat, VaultGemma
        cap = float(cap)
        return lambda logits: torch.tanh(logits / cap) * cap
    if str(getattr(text, "model_type", "")).startswith("cohere") and \
            getattr(text, "logit_scale", None) is not None:
        scale = text.logit_scale
        return lambda logits: logits * scale
    divisor = getattr(text, "logits_scaling", None)  # Granite: logits / logits_scaling
    if divisor is not None:
        return lambda logits: logits / divisor
    return None


# --- log-softmax of given logits (the full-logits path) ------------------------------------------


@torch.no_grad()
def token_entropy(logits: Tensor, normaliser: Tensor) -> Tensor:
    """-sum_v p log p of each row of fp32 logits [r, V]; p = 0 terms (logit -inf) count as 0."""
    logp = logits - normaliser.unsqueeze(-1)  # [r, V]
    return -logp.exp().mul_(logp).nan_to_num_(nan=0.0).sum(-1)  # [r], one more [r, V] buffer


def _rows_log_softmax(logits: Tensor, index: Tensor, with_entropy: bool):
    """(chosen log-probs, entropy or None) of fp32 logits [r, V] and targets [r]."""
    normaliser = torch.logsumexp(logits, dim=-1)  # [r]
    chosen = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)  # [r]
    entropy = token_entropy(logits.detach(), normaliser.detach()) if with_entropy else None
    return chosen - normaliser, entropy


def logits_log_softmax(logits: Tensor, index: Tensor, chunk_rows: int = GIVEN_LOGITS_CHUNK_ROWS,
                       with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Chosen-token log-probs (with grad) and, optionally, entropies (no grad) of given logits
    [..., V], the fp32 logsumexp in row chunks."""
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [R, V]
    # split (not slicing): its backward concatenates chunk grads instead of R/r full-size zeros
    pieces, entropies = [], []
    for chunk, chunk_index in zip(flat_logits.split(chunk_rows),
                                  index.reshape(-1).split(chunk_rows)):
        logps, entropy = _rows_log_softmax(chunk.float(), chunk_index, with_entropy)
        pieces.append(logps)
        entropies.append(entropy)
    logps = torch.cat(pieces).reshape(index.shape)  # [...]
    return logps, torch.cat(entropies).reshape(index.shape) if with_entropy else None


# --- the chunked head ----------------------------------------------------------------------------


class ChunkedLinearLogProbs(torch.autograd.Function):
    """(log-probs [n], entropy [n] or [0]) of targets [n] under logits = linear(hidden, W, b)
    through `spec`, without [n, V] logits: row chunks forward, vocabulary chunks backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                spec: HeadSpec):
        n = hidden.shape[0]
        logps, normaliser = (hidden.new_empty(n, dtype=torch.float32) for _ in range(2))
        entropy = hidden.new_empty(n if spec.with_entropy else 0, dtype=torch.float32)
        rows = logits_chunk_rows(weight.shape[0])
        for start in range(0, n, rows):
            part = slice(start, start + rows)
            _forward_chunk(spec, F.linear(hidden[part], weight, bias), targets[part],
                           logps[part], normaliser[part], entropy[part] if entropy.numel()
                           else None)
        ctx.save_for_backward(hidden, weight, bias, targets, normaliser)
        device = hidden.device.type
        ctx.spec, ctx.autocast = spec, (torch.is_autocast_enabled(device),
                                        torch.get_autocast_dtype(device))
        ctx.mark_non_differentiable(entropy)
        return logps, entropy  # [n] each ([0] without entropy)

    @staticmethod
    def backward(ctx, grad_logps: Tensor, _grad_entropy: Tensor):
        hidden, weight, bias, targets, normaliser = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]  # hidden, weight, bias
        leaf = hidden.detach().requires_grad_(needs[0])
        grads = [torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device),
                 torch.empty_like(weight), None if bias is None else torch.empty_like(bias)]
        grads = [g if need else None for g, need in zip(grads, needs)]
        columns, grad = logits_chunk_columns(hidden.shape[0]), grad_logps.float()  # [n]
        for start in range(0, weight.shape[0], columns):
            _backward_chunk(ctx, (leaf, weight, bias, targets, normaliser),
                            slice(start, start + columns), grad, grads)
        grad_hidden = grads[0].to(hidden.dtype) if needs[0] else None
        return grad_hidden, grads[1], grads[2], None, None


def _forward_chunk(spec: HeadSpec, head_output: Tensor, targets: Tensor, logps: Tensor,
                   normaliser: Tensor, entropy: Tensor | None) -> None:
    """One row chunk, written into slices of the outputs. Its temporaries die when it returns,
    and no small tensor outlives it: on the CPU glibc would carve a surviving one out of a freed
    chunk-sized block, the next chunk would no longer fit there and the heap would grow by a
    chunk per chunk (measured: 3.8 GB resident for one 3,328-row forward with per-chunk lists)."""
    logits = spec.logits(head_output)  # [r, V] fp32
    torch.logsumexp(logits, dim=-1, out=normaliser)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [r]
    torch.sub(chosen, normaliser, out=logps)
    if entropy is not None:
        entropy.copy_(token_entropy(logits, normaliser))


def _backward_chunk(ctx, saved: tuple, part: slice, grad: Tensor, grads: list) -> None:
    """Vocabulary columns `part`: recompute their logits for every row in the forward's autocast,
    d logp / d logits = onehot - p, and torch's autograd through transform, temperature and the
    matmul; the hidden gradient is summed into grads[0], the weight and bias slices written."""
    leaf, weight, bias, targets, normaliser = saved
    w = weight[part].detach().requires_grad_(grads[1] is not None)  # [C, H]
    b = None if bias is None else bias[part].detach().requires_grad_(grads[2] is not None)
    enabled, dtype = ctx.autocast
    with torch.enable_grad(), torch.autocast(leaf.device.type, dtype, enabled=enabled):
        logits = ctx.spec.logits(F.linear(leaf, w, b))  # [n, C] fp32
    dlogits = _softmax_grad(logits.detach(), normaliser, targets, grad, part.start)  # [n, C]
    inputs = [(t, g) for t, g in zip((leaf, w, b), grads) if g is not None]
    computed = torch.autograd.grad(logits, [t for t, _ in inputs], dlogits)
    for (t, into), value in zip(inputs, computed):
        if t is leaf:
            into += value.float()
        else:
            into[part] = value


def _softmax_grad(logits: Tensor, normaliser: Tensor, targets: Tensor, grad: Tensor,
                  start: int) -> Tensor:
    """grad * d(chosen - logsumexp)/d logits = grad * (onehot - p) on columns start.. [n, C]."""
    out = logits.sub_(normaliser.unsqueeze(-1)).exp_().mul_(-grad.unsqueeze(-1))  # [n, C]
    hit = (targets >= start) & (targets < start + out.shape[1])  # [n]
    rows = hit.nonzero().squeeze(-1)  # [k]
    out[rows, targets[rows] - start] += grad[rows]
    return out


def _module_log_probs(head: torch.nn.Module, hidden: Tensor, targets: Tensor,
                      spec: HeadSpec) -> tuple[Tensor, Tensor]:
    """Any head module, per chunk of rows; with grad each chunk is recomputed in the backward."""
    def chunk(h: Tensor, t: Tensor):
        chosen, entropy = _rows_log_softmax(spec.logits(head.forward(h)), t, spec.with_entropy)
        return chosen, entropy if entropy is not None else chosen.detach()[:0]

    rows = logits_chunk_rows(int(getattr(head, "out_features", 0) or head.weight.shape[0]))
    recompute = torch.is_grad_enabled()
    pieces = [checkpoint(chunk, h, t, use_reentrant=False) if recompute else chunk(h, t)
              for h, t in zip(hidden.split(rows), targets.split(rows))]
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])


def head_log_probs(head: torch.nn.Module, hidden: Tensor, targets: Tensor,
                   spec: HeadSpec) -> tuple[Tensor, Tensor]:
    """(log-probs [n], entropies [n], or [0] without spec.with_entropy) of targets [n] given the
    head's input hidden states [n, H]."""
    if type(head) is torch.nn.Linear:
        return ChunkedLinearLogProbs.apply(hidden, head.weight, head.bias, targets, spec)
    return _module_log_probs(head, hidden, targets, spec)


# --- the hook on the model's head ----------------------------------------------------------------


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP and peft wrappers (FSDP2 wraps in place)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return base_model(inner)


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The LM head module of a (DDP-, peft- or FSDP-wrapped) causal LM, or None."""
    get = getattr(unwrapped(model), "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


@dataclass
class HeadCall:
    """What the hook computed: the hidden states of the kept positions go in, `compute`'s
    result comes out (None until the head has run)."""

    compute: Callable[[torch.nn.Module, Tensor], tuple[Tensor, Tensor]]
    result: tuple[Tensor, Tensor] | None = None


@contextlib.contextmanager
def head_hook(model: torch.nn.Module, call: HeadCall) -> Iterator[None]:
    """Within the context, the model's head runs `call.compute(head, hidden [b, t, H])` and then
    itself on an empty input ([b, 0, H]); without a head nothing is hooked."""
    head = output_head(model)
    if head is None:
        yield
        return

    def pre_hook(module: torch.nn.Module, args: tuple):
        if call.result is not None:
            raise RuntimeError("lm_head: the model applied its output head twice in one forward")
        call.result = call.compute(module, args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()
