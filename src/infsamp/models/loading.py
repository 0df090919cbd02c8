"""Load a policy model and its tokenizer from a local HF checkpoint directory (or the embedded one).

Resolves `model.name_or_path` ('embedded' -> the bundled tiny model), picks device and dtype (from
the training precision when one is given, see `infsamp.rl.precision`), loads the base in 4-bit NF4
for QLoRA, applies LoRA through peft (adapters fp32 whatever the base), gradient checkpointing when
asked, and the precision's compute context (autocast for `mixed`). Every failure becomes one
`ModelError` line naming the path. Hub ids are passed to transformers as is (they work where the
hub is reachable).

Deliberately simple: one device, no sharding; 4-bit is bitsandbytes NF4 with double quantisation,
non-linear modules (embeddings, norms, lm_head) stay in the base dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from infsamp.config import EMBEDDED_MODEL, ModelConfig
from infsamp.errors import ModelError
from infsamp.models.device import resolve_device  # noqa: F401  (callers import it from here)

EMBEDDED_DIR = Path(__file__).parent / "embedded"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_path(name_or_path: str) -> str:
    return str(EMBEDDED_DIR) if name_or_path == EMBEDDED_MODEL else name_or_path


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def load_tokenizer(name_or_path: str):
    path = resolve_path(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # transformers raises many types for a bad path
        raise ModelError(f"model.name_or_path {path!r}: cannot load tokenizer ({_first_line(err)})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def weight_kwargs(cfg: ModelConfig, device: torch.device, precision=None) -> dict:
    """from_pretrained's dtype (and 4-bit quantisation) for `precision` (a PrecisionMode), else
    cfg.dtype."""
    if precision is None:
        return {"dtype": resolve_dtype(cfg.dtype, device)}
    from infsamp.rl.precision import COMPUTE_DTYPE, weights_dtype

    dtype = weights_dtype(precision, lora=cfg.lora_rank > 0)
    if not cfg.load_in_4bit:
        return {"dtype": dtype}
    from transformers import BitsAndBytesConfig

    compute = COMPUTE_DTYPE if precision.compute == "bf16" else torch.float32
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=compute)
    return {"dtype": dtype, "quantization_config": quantization, "device_map": {"": device}}


def load_model_and_tokenizer(cfg: ModelConfig, device: torch.device | None = None, *,
                             precision=None):
    """(model, tokenizer) on `device` in the precision's dtypes (or cfg.dtype), with LoRA and
    gradient checkpointing applied."""
    device = device or resolve_device(cfg.device)
    path = resolve_path(cfg.name_or_path)
    tokenizer = load_tokenizer(cfg.name_or_path)
    weights = weight_kwargs(cfg, device, precision)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation=cfg.attn_implementation, **weights)
    except Exception as err:
        raise ModelError(f"model.name_or_path {path!r}: cannot load model ({_first_line(err)})") from None
    if "device_map" not in weights:  # a quantised model is placed by from_pretrained
        model.to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora_rank > 0:
        model = apply_lora(model, cfg)
    if precision is not None:
        from infsamp.rl.precision import apply_compute

        apply_compute(model, precision)
    return model, tokenizer


def apply_lora(model: PreTrainedModel, cfg: ModelConfig):
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target_modules
    target = "all-linear" if targets == ["all-linear"] else targets
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=target, task_type="CAUSAL_LM")
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()
    return get_peft_model(model, lora)


def context_length(model) -> int:
    config = model.config
    return int(getattr(config, "max_position_embeddings", 2048) or 2048)


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__
