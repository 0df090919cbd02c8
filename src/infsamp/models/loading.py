"""Load a policy model and its tokenizer from a local HF checkpoint directory (or the embedded one).

Resolves `model.name_or_path` ('embedded' -> the bundled tiny model), picks device and dtype, applies
LoRA through peft and gradient checkpointing when asked. Every failure becomes one `ModelError` line
naming the path. Hub ids are passed to transformers as is (they work where the hub is reachable).

Deliberately simple: one device, no sharding, no quantised loading.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from infsamp.config import EMBEDDED_MODEL, ModelConfig
from infsamp.errors import ModelError

EMBEDDED_DIR = Path(__file__).parent / "embedded"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_path(name_or_path: str) -> str:
    return str(EMBEDDED_DIR) if name_or_path == EMBEDDED_MODEL else name_or_path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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


def load_model_and_tokenizer(cfg: ModelConfig, device: torch.device | None = None):
    """(model, tokenizer) on `device` with cfg's dtype, LoRA and checkpointing applied."""
    device = device or resolve_device(cfg.device)
    path = resolve_path(cfg.name_or_path)
    tokenizer = load_tokenizer(cfg.name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(cfg.dtype, device), attn_implementation=cfg.attn_implementation)
    except Exception as err:
        raise ModelError(f"model.name_or_path {path!r}: cannot load model ({_first_line(err)})") from None
    model.to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora_rank > 0:
        model = apply_lora(model, cfg)
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


def adaptable_module_names(name_or_path: str) -> set[str] | None:
    """Full names of the modules LoRA can adapt (linear, embedding, convolution layers), from the
    model built on the meta device (no weights read); None when its config cannot be read locally
    (a hub id without the hub: loading reports that itself)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig
    from transformers.pytorch_utils import Conv1D

    nn = torch.nn
    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, Conv1D)
    try:
        config = AutoConfig.from_pretrained(resolve_path(name_or_path), local_files_only=True)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - any failure here is reported by the real load
        return None
    return {name for name, module in model.named_modules() if isinstance(module, kinds)}


def context_length(model) -> int:
    config = model.config
    return int(getattr(config, "max_position_embeddings", 2048) or 2048)


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__
