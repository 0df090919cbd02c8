"""Load a policy model and its tokenizer from a local HF checkpoint directory (or the embedded one).

Resolves `model.name_or_path` through `models.source` (a folder, a peft adapter folder, a GGUF
file or a named model such as 'smollm2-135m', or a hub id decided at once; a GGUF file is loaded
from its converted folder, `models.gguf.ensure_converted`, converted on first use); a LoRA
checkpoint folder (e.g. `run/checkpoint-4/model`) loads its base and the adapters are trained
further with `model.lora_rank` > 0, or merged into the base with 0. Picks device and dtype (from
the training precision when one is given, see `infsamp.models.precision`), loads the base in 4-bit
NF4 for QLoRA, applies LoRA through peft (adapters fp32 whatever the base), gradient checkpointing
when asked, and the precision's compute context (autocast for `mixed`). Every failure becomes one
`ModelError` line naming the path. `trust_remote_code` is passed to every loader, False unless
`model.trust_remote_code`: a folder whose classes are its own Python code is refused in one line
(never a prompt on stdin). `stop_token_ids` is the one list of tokens that end a completion
(sampler and evaluation both use it).

Deliberately simple: one device, no sharding; 4-bit is bitsandbytes NF4 with double quantisation,
non-linear modules (embeddings, norms, lm_head) stay in the base dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from infsamp.config import ModelConfig
from infsamp.errors import ModelError, first_line
from infsamp.models.device import DTYPES, resolve_device  # noqa: F401  (callers import them here)
from infsamp.models.gguf import ensure_converted
from infsamp.models.source import (  # noqa: F401
    ADAPTER_CONFIG,
    EMBEDDED_DIR,
    ModelSource,
    load_error,
    resolve_model_source,
)
from infsamp.options import ConfigError


def quiet_transformers() -> None:
    """No weight-loading or per-save progress bars, nor advisory warnings, between our own lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def stop_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every token that ends a completion, in first-seen order: the model's generation config
    `eos_token_id` (an int or a list: Llama-3 Instruct lists three, Qwen two), the model config's,
    and the tokenizer's."""
    found: list[int] = []
    sources = (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
               getattr(getattr(model, "config", None), "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None))
    for value in sources:
        for token in (value if isinstance(value, (list, tuple)) else [value]):
            if token is not None and int(token) not in found:
                found.append(int(token))
    return tuple(found)


def require_stop_tokens(model, tokenizer, name_or_path: str) -> tuple[int, ...]:
    """`stop_token_ids`, or one line before training when there is none: no completion could
    end, every one would run to sampling.max_new_tokens (and evaluation would fail them all)."""
    stops = stop_token_ids(model, tokenizer)
    if not stops:
        raise ModelError(f"model.name_or_path {name_or_path!r}: neither the tokenizer nor the "
                         "model's config names an end-of-sequence token, so no completion could "
                         "end before sampling.max_new_tokens; set eos_token in its "
                         "tokenizer_config.json (or eos_token_id in generation_config.json)")
    return stops


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def local_source(name_or_path: str) -> ModelSource:
    """`resolve_model_source`, with a GGUF file converted into its cache folder if not yet done."""
    source = resolve_model_source(name_or_path)
    if source.gguf_file is not None:
        quiet_transformers()
        ensure_converted(source.gguf_file)
    return source


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    quiet_transformers()
    source = local_source(name_or_path)
    path = source.tokenizer_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises many types for a bad path
        raise _load_failure(source, "tokenizer", err) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _load_failure(source: ModelSource, what: str, err: BaseException) -> ModelError:
    """One line; a GGUF file's converted copy that fails to load is named as the cache's."""
    failure = load_error(f"model.name_or_path {source.path!r}", what, err)
    if source.gguf_file is None:
        return failure
    return ModelError(f"{failure}; this is the cache's converted copy of {source.gguf_file}: "
                      f"remove {source.path} to convert it again")


def weight_kwargs(cfg: ModelConfig, device: torch.device, precision=None) -> dict:
    """from_pretrained's dtype (and 4-bit quantisation) for `precision` (a PrecisionMode), else
    cfg.dtype."""
    if precision is None:
        return {"dtype": resolve_dtype(cfg.dtype, device)}
    from infsamp.models.precision import COMPUTE_DTYPE, weights_dtype

    dtype = weights_dtype(precision, lora=cfg.lora_rank > 0)
    if not cfg.load_in_4bit:
        return {"dtype": dtype}
    from transformers import BitsAndBytesConfig

    compute = COMPUTE_DTYPE if precision.compute == "bf16" else torch.float32
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=compute)
    return {"dtype": dtype, "quantization_config": quantization, "device_map": {"": device}}


def load_model_and_tokenizer(cfg: ModelConfig, device: torch.device | None = None, tokenizer=None,
                             *, precision=None):
    """(model, tokenizer) on `device` in the precision's dtypes (or cfg.dtype), LoRA and
    checkpointing applied; pass the `tokenizer` when it was loaded already (the trainer encodes its
    data before loading weights)."""
    device = device or resolve_device(cfg.device)
    source = local_source(cfg.name_or_path)
    tokenizer = tokenizer or load_tokenizer(cfg.name_or_path, cfg.trust_remote_code)
    weights = weight_kwargs(cfg, device, precision)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.path, attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code, **weights)
    except Exception as err:
        raise _load_failure(source, "model", err) from None
    if "device_map" not in weights:  # a quantised model is placed by from_pretrained
        model.to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if source.adapter_dir is not None:
        model = load_adapters(model, cfg, source.adapter_dir)
    elif cfg.lora_rank > 0:
        model = apply_lora(model, cfg)
    if precision is not None:
        from infsamp.models.precision import apply_compute

        apply_compute(model, precision)
    return model, tokenizer


def load_adapters(base: PreTrainedModel, cfg: ModelConfig, adapter_dir: Path):
    """Adapters of an earlier LoRA run: trained further with lora_rank > 0 (the same rank), or
    merged into the base with lora_rank 0 (then every weight trains)."""
    from peft import PeftModel

    rank = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("r")
    if cfg.lora_rank and rank is not None and cfg.lora_rank != rank:
        raise ModelError(f"model.lora_rank {cfg.lora_rank}: the adapters in {adapter_dir} have "
                         f"rank {rank}; use --model.lora_rank {rank} to train them further, or 0 "
                         "to merge them")
    if cfg.gradient_checkpointing and cfg.lora_rank:
        base.enable_input_require_grads()
    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=cfg.lora_rank > 0)
    except Exception as err:  # noqa: BLE001 - peft raises many types for mismatched adapters
        raise ModelError(f"model.name_or_path {str(adapter_dir)!r}: cannot load adapters "
                         f"({first_line(err)})") from None
    if cfg.lora_rank:
        return model
    return model.merge_and_unload().requires_grad_(True)  # peft froze the base weights


def apply_lora(model: PreTrainedModel, cfg: ModelConfig):
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target_modules
    target = "all-linear" if targets == ["all-linear"] else targets
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=target, task_type="CAUSAL_LM")
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()
    return get_peft_model(model, lora)


def adaptable_module_names(name_or_path: str, trust_remote_code: bool = False) -> set[str] | None:
    """Full names of the modules LoRA can adapt (linear, embedding, convolution layers), from the
    model built on the meta device (no weights read); None when its config cannot be read locally
    (a hub id without the hub: loading reports that itself)."""
    from accelerate import init_empty_weights
    from transformers.pytorch_utils import Conv1D

    nn = torch.nn
    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, Conv1D)
    config = config_before_loading(name_or_path, trust_remote_code)
    if config is None:
        return None
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - any failure here is reported by the real load
        return None
    return {name for name, module in model.named_modules() if isinstance(module, kinds)}


def config_before_loading(name_or_path: str, trust_remote_code: bool = False):
    """The model's config (its shape) read from its folder, cache or converted GGUF, no weights;
    None when it cannot be read locally (a hub id without the hub: loading reports that)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(local_source(name_or_path).path, local_files_only=True,
                                          trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - any failure here is reported by the real load
        return None


def check_lora_targets(cfg: ModelConfig) -> None:
    """Each LoRA target names a layer LoRA can adapt (built on the meta device: no weights)."""
    if cfg.lora_rank == 0 or cfg.lora_target_modules == ["all-linear"]:
        return
    names = adaptable_module_names(cfg.name_or_path, cfg.trust_remote_code)
    if names is None:  # its config cannot be read here (a hub id offline): loading will say
        return
    for target in cfg.lora_target_modules:
        if not any(name == target or name.endswith("." + target) for name in names):
            known = sorted({n.rsplit(".", 1)[-1] for n in names})[:10]
            raise ConfigError(f"model.lora_target_modules: {target!r} names no layer LoRA can "
                              f"adapt in this model (it has {', '.join(known)}; or all-linear)")


