"""Bytes of the planner's parts that grow with tokens: what autograd saves per training token,
the training LM head's logits chunks, the decoding rows' logits, the no-grad forward's workspace
and the shared-prompt block mask. Pure Python (no torch); `estimate.py` adds them up per phase.

Deliberately simplified: counted per HF Llama/Qwen decoder layer with sdpa attention (other
architectures are assumed alike); each formula names what it counts.
"""

from __future__ import annotations

import math

from infsamp.planner.inputs import ADAPTER_BYTES, PlanInputs


def layer_activation_bytes_per_token(p: PlanInputs) -> int:
    """Bytes autograd saves for one token in one decoder layer (HF Llama/Qwen layer, sdpa
    attention).

    RMSNorm: fp32 copy of its input + normalised output; attention: q, k and v repeated to all heads
    (a padding mask rules out sdpa's GQA path), output, fp32 log-sum-exp, o_proj's input copy, and
    the float mask row sdpa converts per layer; SwiGLU: gate, silu(gate), up, their product. Matmul
    outputs are in the compute dtype (d), the residual stream and norms in the weights' dtype (r).
    Under autocast with fp32 weights, q/k/v/gate/up each save a bf16 copy of their fp32 input. With
    LoRA in a 16-bit dtype peft keeps a copy of every adapted linear's input (fp32; bf16 in
    autocast).
    """
    s, d, r = p.shape, p.compute_bytes, p.dtype_bytes
    norms = 2 * (4 + r) * s.hidden_size
    qk_norm = (4 + d) * (s.q_dim + s.kv_dim) if s.qk_norm else 0
    attention = 5 * s.q_dim * d + 4 * s.num_attention_heads + p.seq_len * r
    mlp = 4 * s.intermediate_size * d
    input_casts = 5 * s.hidden_size * d if p.mode.autocast and r != d else 0
    lora_casts = 0
    if p.lora_rank > 0 and (p.mode.autocast or d != ADAPTER_BYTES):
        cast = d if p.mode.autocast else ADAPTER_BYTES
        lora_casts = cast * (5 * s.hidden_size + s.q_dim + s.intermediate_size)
    return norms + qk_norm + attention + mlp + input_casts + lora_casts


def activation_bytes_per_token(p: PlanInputs) -> int:
    """Saved activations of one training token, whole model (with or without checkpointing)."""
    layer = layer_activation_bytes_per_token(p)
    final_norm = (4 + p.dtype_bytes) * p.shape.hidden_size
    if p.gradient_checkpointing:  # each layer keeps its input; one layer is recomputed at a time
        return p.shape.num_hidden_layers * p.dtype_bytes * p.shape.hidden_size + layer + final_norm
    return p.shape.num_hidden_layers * layer + final_norm


# fp32 logits of one chunk of the training LM head (algorithm/lm_head.py)
LOGITS_CHUNK_BYTES = 32 * 2**20
LOGITS_CHUNK_BUFFERS = 4  # chunk-sized buffers alive at once in the head's forward or backward


def logits_chunk_rows(vocab_size: int) -> int:
    """Rows of one forward chunk of the training LM head: LOGITS_CHUNK_BYTES of fp32 logits."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def logits_chunk_columns(num_rows: int) -> int:
    """Vocabulary columns of one backward chunk over `num_rows` rows: as many fp32 bytes."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * max(num_rows, 1)))


def train_logits_chunk_bytes(p: PlanInputs, rows: int) -> int:
    """fp32 logits of one chunk of the training head for a micro-batch of `rows` completion rows
    (at most LOGITS_CHUNK_BYTES; the whole micro-batch's logits when they are fewer)."""
    return min(rows, logits_chunk_rows(p.shape.vocab_size)) * p.shape.vocab_size * 4


def train_logits_bytes_per_row(p: PlanInputs) -> int:
    """What the chunked head keeps per completion row: the hidden state it saves and its fp32
    gradient, and the fp32 log-prob, normaliser, entropy and padded output, int64 target and
    row index."""
    return p.shape.hidden_size * (p.dtype_bytes + 4) + 4 * 4 + 2 * 8


def train_logits_bytes(p: PlanInputs, micro_batch_tokens: int) -> int:
    """The training head's working set: LOGITS_CHUNK_BUFFERS chunks of logits (the head's output,
    the fp32 logits, logsumexp's or the entropy's two temporaries; in the backward the recomputed
    chunk, its gradient and the gradient's casts), plus its per-row tensors. Independent of the
    micro-batch once it holds a chunk's rows: logits no longer grow with the token budget."""
    rows = completion_rows(p, micro_batch_tokens)
    return (LOGITS_CHUNK_BUFFERS * train_logits_chunk_bytes(p, rows)
            + rows * train_logits_bytes_per_row(p))


def decode_logits_bytes_per_row(p: PlanInputs) -> int:
    """One decoding row: model logits + fp32 copy, scaled copy and probabilities for sampling."""
    return p.shape.vocab_size * (p.compute_bytes + 12)


def prefill_logits_bytes(p: PlanInputs) -> int:
    """Logits of a prompt's prefill: at most one row (the slot engine keeps none:
    `slot_prefix.no_logits`)."""
    return p.shape.vocab_size * p.compute_bytes


def inference_workspace_bytes(p: PlanInputs, tokens: int) -> int:
    """No-grad forward working set: one layer's intermediates for `tokens` tokens at a time."""
    s = p.shape
    width = 2 * s.hidden_size + s.q_dim + 2 * s.kv_dim + 3 * s.intermediate_size
    return tokens * width * p.compute_bytes


def completion_rows(p: PlanInputs, tokens: int) -> int:
    """Completion positions (logits rows) in a micro-batch of `tokens` padded tokens."""
    return math.ceil(tokens * p.max_new_tokens / p.seq_len)


def shared_mask_bytes(p: PlanInputs, micro_batch_tokens: int) -> int:
    """With `share_prompt` a micro-batch is r rows of width W (a prompt and as many of its
    completions as fit behind it) under one bool block mask [r, 1, W, W], alive through the
    forward and backward: r x W x W = tokens x W bytes, W at most the micro-batch and at most a
    whole group (P + G x R). Deliberately simple: the attention kernel's own float copy of the
    mask is a temporary of one layer, not counted."""
    if not p.share_prompt:
        return 0
    group_width = p.max_prompt_tokens + p.num_generations * p.max_new_tokens
    return micro_batch_tokens * min(micro_batch_tokens, group_width)
