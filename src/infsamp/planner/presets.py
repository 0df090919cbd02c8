"""Model shapes: built-in presets, reading a local config.json, and exact parameter counts.

A `ModelShape` holds the few numbers of a decoder-only transformer (Llama / Qwen2 / Qwen3 family)
that memory depends on. Presets copy the public `config.json` values of each model; `load_shape`
also reads a local HF checkpoint directory or a config.json path (JSON only, no torch).
`count_parameters` adds up the tensors layer by layer (embedding, q/k/v/o with Qwen2.5's q/k/v
biases, Qwen3's q/k RMSNorm, SwiGLU MLP, two RMSNorms per layer, final norm, lm_head unless tied).

Deliberately simple: dense decoder-only models only (no MoE, no sliding window, no vision tower).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infsamp.errors import ModelError

LORA_TARGETS_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj")


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = False  # Qwen2 / Qwen2.5: biases on q, k, v
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _llama(name: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           head_dim: int, tie: bool) -> ModelShape:
    return ModelShape(name, hidden, inter, layers, heads, kv_heads, head_dim, 128256, tie, 131072)


def _qwen3(name: str, hidden: int, inter: int, layers: int, heads: int, tie: bool) -> ModelShape:
    return ModelShape(name, hidden, inter, layers, heads, 8, 128, 151936, tie, 40960, qk_norm=True)


def _qwen25(name: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int,
            tie: bool, max_positions: int) -> ModelShape:
    return ModelShape(name, hidden, inter, layers, heads, kv_heads, hidden // heads, vocab, tie,
                      max_positions, attention_bias=True)


# Public config.json values (Hugging Face model repos of Qwen and meta-llama, base models).
PRESETS: dict[str, ModelShape] = {shape.name: shape for shape in (
    _qwen3("qwen3-0.6b", 1024, 3072, 28, 16, tie=True),
    _qwen3("qwen3-1.7b", 2048, 6144, 28, 16, tie=True),
    _qwen3("qwen3-4b", 2560, 9728, 36, 32, tie=True),
    _qwen3("qwen3-8b", 4096, 12288, 36, 32, tie=False),
    _qwen3("qwen3-14b", 5120, 17408, 40, 40, tie=False),
    _qwen25("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 151936, tie=True, max_positions=32768),
    _qwen25("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, 151936, tie=True, max_positions=131072),
    _qwen25("qwen2.5-3b", 2048, 11008, 36, 16, 2, 151936, tie=True, max_positions=32768),
    _qwen25("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, tie=False, max_positions=131072),
    _qwen25("qwen2.5-14b", 5120, 13824, 48, 40, 8, 152064, tie=False, max_positions=131072),
    _llama("llama-3.2-1b", 2048, 8192, 16, 32, 8, 64, tie=True),
    _llama("llama-3.2-3b", 3072, 8192, 28, 24, 8, 128, tie=True),
    _llama("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128, tie=False),
)}


# --- reading a config -----------------------------------------------------------------------------


def shape_from_config(config: Mapping[str, Any] | Any, name: str = "") -> ModelShape:
    """ModelShape from a config.json mapping or a transformers PretrainedConfig (anything with
    to_dict)."""
    values = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    # multimodal wrappers keep the LM under text_config
    values = {**values, **values.get("text_config", {})}
    try:
        heads = int(values["num_attention_heads"])
        hidden = int(values["hidden_size"])
        return ModelShape(
            name=name or str(values.get("_name_or_path") or values.get("model_type") or "model"),
            hidden_size=hidden, intermediate_size=int(values["intermediate_size"]),
            num_hidden_layers=int(values["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(values.get("num_key_value_heads") or heads),
            head_dim=int(values.get("head_dim") or hidden // heads),
            vocab_size=int(values["vocab_size"]),
            tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),
            max_position_embeddings=int(values.get("max_position_embeddings") or 0),
            attention_bias=_has_qkv_bias(values), qk_norm=values.get("model_type") in ("qwen3",),
        )
    except KeyError as err:
        raise ModelError(f"model config {name or '<mapping>'}: missing key "
                         f"{err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise ModelError(f"model config {name or '<mapping>'}: bad value ({err})") from None


def _has_qkv_bias(values: Mapping[str, Any]) -> bool:
    if "attention_bias" in values:
        return bool(values["attention_bias"])
    # Qwen2 always has q/k/v biases and no attention_bias key
    return values.get("model_type") == "qwen2"


def load_shape(name_or_path: str) -> ModelShape:
    """A preset name (case-insensitive), a checkpoint directory or a config.json path ->
    ModelShape."""
    key = str(name_or_path).strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ModelError(f"model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
                         "nor a checkpoint directory or config.json")
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelError(f"model config {path}: cannot read JSON "
                         f"({str(err).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise ModelError(f"model config {path}: top level must be a JSON object")
    return shape_from_config(values, name=str(name_or_path))


def with_layers(shape: ModelShape, num_hidden_layers: int) -> ModelShape:
    """The same shape with fewer (or more) layers, e.g. for quick CPU measurements."""
    return dataclasses.replace(shape, name=f"{shape.name}-{num_hidden_layers}l",
                               num_hidden_layers=num_hidden_layers)


# --- parameter counts -----------------------------------------------------------------------------


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of one decoder layer, by peft module
    name."""
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def layer_parameters(shape: ModelShape) -> int:
    """Parameters of one decoder layer."""
    weights = sum(n_in * n_out for n_in, n_out in linear_shapes(shape).values())
    biases = shape.q_dim + 2 * shape.kv_dim if shape.attention_bias else 0
    qk_norm = 2 * shape.head_dim if shape.qk_norm else 0
    return weights + biases + qk_norm + 2 * shape.hidden_size  # + input and post-attention RMSNorm


def embedding_parameters(shape: ModelShape) -> int:
    return shape.vocab_size * shape.hidden_size


def count_parameters(shape: ModelShape) -> int:
    """Exact parameter count: embedding + layers + final norm + lm_head (unless tied)."""
    lm_head = 0 if shape.tie_word_embeddings else embedding_parameters(shape)
    return (embedding_parameters(shape) + shape.num_hidden_layers * layer_parameters(shape)
            + shape.hidden_size + lm_head)


def count_lora_parameters(shape: ModelShape, rank: int,
                          targets: tuple[str, ...] = LORA_TARGETS_ALL_LINEAR) -> int:
    """LoRA adapter parameters: rank * (in + out) per adapted linear per layer (peft 'all-linear' by
    default)."""
    if rank <= 0:
        return 0
    linears = linear_shapes(shape)
    unknown = [t for t in targets if t not in linears]
    if unknown:
        raise ModelError(f"lora target {unknown[0]!r}: unknown (known: {', '.join(linears)}, "
                         f"all-linear)")
    per_layer = sum(rank * (linears[t][0] + linears[t][1]) for t in targets)
    return shape.num_hidden_layers * per_layer
