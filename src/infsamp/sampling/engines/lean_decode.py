"""The slot engine's decode forward for plain Llama models, without transformers' per-call
machinery: the same torch operations in the same order on the same shapes, so the logits are
bit for bit those of `model(...)`, at a fraction of the Python cost on a small model.

On the embedded tiny Llama (4 layers, hidden 128, vocabulary 104) a decode step's matrix products
take microseconds; what costs is the model's Python: each `nn.Module.__call__` with its hook
checks, the output-capturing and config-merging decorators, `create_causal_mask` (which passes the
engine's 4-D mask through), the output dataclasses. `LeanLlamaDecode` calls the weights' own
functional operations (`F.embedding`, `F.linear`, the RMSNorm formula, transformers' own
`apply_rotary_pos_emb` and rotary module, `slot_attention.split_attention_forward`) and nothing
else.

`lean_decode(model)` builds it only where that is exact: a `LlamaForCausalLM`, alone or under a
peft LoRA wrapper (one active adapter, unmerged, no DoRA or other variant, adapter weights in the
base weight's dtype: each such projection is peft's `lora.Linear.forward`, base(x) +
B(A(dropout(x))) * scaling), every other projection a plain `nn.Linear`, SiLU MLPs, default
rotary, no hooks on any module, no wrapped forward (the `mixed` precision's autocast), sdpa or
eager attention (what the split attention reads); else None and the engine calls the model.

Deliberately simple: Llama's layout only (SmolLM2 and the embedded model are Llamas); no hidden
states handed out (the engine calls the model when a predictor asks for them).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaRMSNorm,
)

from infsamp.sampling.engines.slot_attention import split_attention_forward, supports_split

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def lean_decode(model) -> LeanLlamaDecode | None:
    """The lean decode forward of `model`, or None where it would not be bit-exact."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return None
    if any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)  # or a wrapped forward
           for m in model.modules()):
        return None
    model = _llama_under_lora(model)
    if type(model) is not LlamaForCausalLM or not supports_split(model):
        return None
    config = model.config
    if getattr(config, "pretraining_tp", 1) != 1 or type(model.lm_head) is not nn.Linear:
        return None
    rotary = model.model.rotary_emb
    if rotary.rope_type != "default" or rotary.attention_scaling != 1.0:
        return None
    if type(model.model.embed_tokens) is not nn.Embedding or not all(
            _plain_layer(layer) for layer in model.model.layers):
        return None
    return LeanLlamaDecode(model)


def _peft_loaded() -> bool:
    """Whether peft was imported: a model holds peft modules only then, so a run without LoRA
    never pays peft's import (and torchao's below it) here."""
    return "peft" in sys.modules


def _llama_under_lora(model):
    """A peft LoRA model's inner model (what its forward calls, `LoraModel.forward`); any other
    model as it is."""
    if not _peft_loaded():
        return model
    from peft import LoraConfig, PeftModel
    from peft.tuners.lora import LoraModel

    if not isinstance(model, PeftModel):
        return model
    if type(model.active_peft_config) is not LoraConfig or \
            type(model.base_model) is not LoraModel:
        return None
    return model.base_model.model


def _plain_linear(module) -> bool:
    """nn.Linear, or peft's LoRA Linear computing base(x) + B(A(dropout(x))) * scaling exactly."""
    if type(module) is nn.Linear:
        return True
    if not _peft_loaded():
        return False
    from peft.tuners.lora.layer import Linear as LoraLinear

    if type(module) is not LoraLinear or module.merged or module.disable_adapters or \
            module.lora_variant or len(module.active_adapters) != 1:
        return False
    name = module.active_adapters[0]
    if name not in module.lora_A:
        return False
    parts = (module.base_layer, module.lora_A[name], module.lora_B[name])
    return (all(type(part) is nn.Linear for part in parts)
            and len({part.weight.dtype for part in parts}) == 1
            and type(module.lora_dropout[name]) in (nn.Identity, nn.Dropout))


def _plain_layer(layer) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer) is not LlamaDecoderLayer or type(attention) is not LlamaAttention or \
            type(mlp) is not LlamaMLP:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (all(_plain_linear(getattr(attention, n)) for n in LINEARS)
            and all(_plain_linear(getattr(mlp, n)) for n in MLP_LINEARS)
            and type(mlp.act_fn) in (nn.SiLU, SiLUActivation)
            and all(type(n) is LlamaRMSNorm for n in norms))


def _rms_norm(weight: torch.Tensor, eps: float, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward, operation for operation."""
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_pos_emb`'s x * cos + rotate_half(x) * sin, bit for bit, in 4 operations:
    rotate_half(x) = cat(-x2, x1) is roll(x, D/2) with the first half's sign moved onto sin
    ((-a) * b == a * (-b) exactly)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


def _projection(module) -> tuple:
    """(weight, bias) of an nn.Linear; of a LoRA Linear, also its dropout, (A's weight, bias),
    (B's weight, bias) and scaling."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    name = module.active_adapters[0]
    lora_a, lora_b = module.lora_A[name], module.lora_B[name]
    return (module.base_layer.weight, module.base_layer.bias, module.lora_dropout[name],
            (lora_a.weight, lora_a.bias), (lora_b.weight, lora_b.bias), module.scaling[name])


def _project(x: torch.Tensor, projection: tuple) -> torch.Tensor:
    """nn.Linear.forward, or peft's `lora.Linear.forward` operation for operation."""
    result = F.linear(x, projection[0], projection[1])
    if len(projection) == 2:
        return result
    dropout, lora_a, lora_b, scaling = projection[2:]
    if type(dropout) is nn.Dropout:
        x = F.dropout(x, dropout.p, dropout.training, dropout.inplace)
    return result + F.linear(F.linear(x, *lora_a), *lora_b) * scaling


class LeanLlamaDecode:
    """`__call__(input_ids [S, 1], position_ids [S, 1], mask, cache)` -> logits [S, V] (float32),
    the cache's `update` and the split attention called as the model's layers call them; a
    packed step's one sequence ([1, T], `keep` = S: new prompt rows' suffixes, then the S
    tokens) -> the last S tokens' logits. The weights are looked up once (a new one per sampler
    call: `lean_decode`)."""

    def __init__(self, model: LlamaForCausalLM):  # the Llama itself (under LoRA: its inner model)
        inner = model.model
        self.embed, self.rotary, self.head = inner.embed_tokens, inner.rotary_emb, model.lm_head
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.layers = [self._layer(layer)
                       for layer in inner.layers[: inner.config.num_hidden_layers]]

    @staticmethod
    def _layer(layer: LlamaDecoderLayer) -> tuple:
        attention, mlp = layer.self_attn, layer.mlp
        return ((layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                attention, [_projection(getattr(attention, n)) for n in LINEARS],
                (layer.post_attention_layernorm.weight,
                 layer.post_attention_layernorm.variance_epsilon),
                [_projection(getattr(mlp, n)) for n in MLP_LINEARS])

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 cache, keep: int = 0) -> torch.Tensor:
        embed = self.embed
        hidden = F.embedding(input_ids, embed.weight, embed.padding_idx, embed.max_norm,
                             embed.norm_type, embed.scale_grad_by_freq, embed.sparse)  # [S, 1, H]
        cos, sin = self.rotary(hidden, position_ids)  # [S, 1, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [S, 1, 1, D]: over the heads
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        if mask.dtype == torch.bool:  # additive, once per step: + 0 / -inf is masked_fill's
            mask = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, -torch.inf)
        for first_norm, attention, linears, second_norm, mlp in self.layers:
            residual = hidden
            attended = self._attention(attention, linears, _rms_norm(*first_norm, hidden),
                                       cos, signed_sin, mask, cache)
            hidden = residual + attended
            residual = hidden
            hidden = residual + self._mlp(mlp, _rms_norm(*second_norm, hidden))
        hidden = _rms_norm(*self.norm, hidden)
        if keep:  # a packed step [1, T]: the last `keep` tokens' logits, as logits_to_keep's
            return F.linear(hidden[:, -keep:], self.head.weight, self.head.bias)[0].float()
        return F.linear(hidden, self.head.weight, self.head.bias)[:, -1].float()  # [S, V]

    @staticmethod
    def _attention(attention: LlamaAttention, linears: list, hidden: torch.Tensor,
                   cos: torch.Tensor, signed_sin: torch.Tensor, mask: torch.Tensor,
                   cache) -> torch.Tensor:
        input_shape = hidden.shape[:-1]
        hidden_shape = (*input_shape, -1, attention.head_dim)
        q_proj, k_proj, v_proj, o_proj = linears
        q = _rotate(_project(hidden, q_proj).view(hidden_shape).transpose(1, 2), cos,
                    signed_sin)  # [S, H, 1, D]
        k = _rotate(_project(hidden, k_proj).view(hidden_shape).transpose(1, 2), cos,
                    signed_sin)  # [S, H_kv, 1, D]
        v = _project(hidden, v_proj).view(hidden_shape).transpose(1, 2)
        k, v = cache.update(k, v, attention.layer_idx)
        out, _ = split_attention_forward(attention, q, k, v, mask, dropout=0.0,
                                         scaling=attention.scaling)
        out = out.reshape(*input_shape, -1).contiguous()  # [S, 1, H * D]
        return _project(out, o_proj)

    @staticmethod
    def _mlp(linears: list, hidden: torch.Tensor) -> torch.Tensor:
        gate, up, down = linears
        return _project(F.silu(_project(hidden, gate)) * _project(hidden, up), down)
