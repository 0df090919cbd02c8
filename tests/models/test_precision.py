"""Precision modes: dtypes per mode, the autocast forward, the optimizer chosen, bad input, and
the evidence that `mixed` and `bf16` apply the updates an fp32 run applies
(benchmarks/precision.py)."""

import copy
import warnings

import pytest
import torch

from infsamp.algorithm.optim import build_optimizer
from infsamp.config import ModelConfig
from infsamp.config_io import load_config
from infsamp.models import precision as precision_module
from infsamp.models.loading import load_model_and_tokenizer
from infsamp.models.precision import resolve_precision
from infsamp.options import ConfigError
from infsamp.planner.precisions import PRECISIONS, resolve_precision_name

CPU = torch.device("cpu")
BF16, FP32 = torch.bfloat16, torch.float32


def load(tiny_model_dir, mode: str, lora_rank: int = 0):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), lora_rank=lora_rank, device="cpu")
    model, _ = load_model_and_tokenizer(cfg, CPU, precision=PRECISIONS[mode])
    return model


def config(**overrides):
    """The config, checked against this machine as a run's start-up checks it."""
    cfg = load_config(overrides={"model.device": "cpu", **overrides})
    resolve_precision(cfg, CPU)
    return cfg


def test_auto_is_fp32_on_cpu_and_bf16_on_gpu():
    assert resolve_precision_name("auto", "cpu") == "fp32"
    assert resolve_precision_name("auto", "cuda") == "bf16"
    assert resolve_precision(config(), CPU).name == "fp32"


@pytest.mark.parametrize("mode, weights", [("fp32", FP32), ("mixed", FP32), ("bf16", BF16),
                                           ("bf16_lossy", BF16)])
def test_full_fine_tuning_weights_dtype(tiny_model_dir, mode, weights):
    assert {p.dtype for p in load(tiny_model_dir, mode).parameters()} == {weights}


@pytest.mark.parametrize("mode, base", [("fp32", FP32), ("mixed", BF16), ("bf16", BF16)])
def test_lora_adapters_are_fp32_over_the_base(tiny_model_dir, mode, base):
    model = load(tiny_model_dir, mode, lora_rank=4)
    adapters = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    frozen = {p.dtype for n, p in model.named_parameters() if "lora_" not in n}
    assert adapters == {FP32} and frozen == {base}
    optimizer = build_optimizer(model, load_config().training, PRECISIONS[mode])
    assert type(optimizer) is torch.optim.AdamW  # fp32 adapters need no rounding help


def test_mixed_computes_in_bf16_on_fp32_weights_and_a_copy_reads_its_own(tiny_model_dir):
    model = load(tiny_model_dir, "mixed")
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model(input_ids=ids).logits.dtype == BF16
    assert load(tiny_model_dir, "fp32")(input_ids=ids).logits.dtype == FP32
    twin = copy.deepcopy(model)
    with torch.no_grad():
        next(twin.parameters()).add_(1.0)  # the copy's forward must read the copy's weights
    assert twin(input_ids=ids).logits.dtype == BF16
    assert not torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    model(input_ids=ids).logits.float().sum().backward()
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {FP32}


@pytest.mark.parametrize("mode, optimizer, expected", [
    ("fp32", "adamw", "torch.optim.adamw.AdamW"), ("mixed", "adamw", "torch.optim.adamw.AdamW"),
    ("bf16", "adamw", "torchao.optim.adam._AdamW"),
    ("bf16_lossy", "adamw", "torch.optim.adamw.AdamW"), ("bf16", "sgd", "optimi.sgd.SGD"),
    ("fp32", "adamw8bit", "torchao.optim.adam.AdamW8bit"),
    ("bf16", "adamw8bit", "torchao.optim.adam.AdamW8bit"),
])
def test_optimizer_follows_the_mode(tiny_model_dir, mode, optimizer, expected):
    cfg = load_config(overrides={"training.optimizer": optimizer, "training.precision": mode})
    built = build_optimizer(load(tiny_model_dir, mode), cfg.training, PRECISIONS[mode])
    assert f"{type(built).__module__}.{type(built).__name__}" == expected
    if expected.startswith("optimi"):
        assert built.param_groups[0]["kahan_sum"] is True
    if expected.startswith("torchao"):
        assert built.bf16_stochastic_round is (mode == "bf16")


@pytest.mark.parametrize("overrides, message", [
    ({"training.precision": "fp16"},
     "training.precision: must be one of auto, bf16, bf16_lossy, fp32, mixed"),
    ({"training.precision": "fp32", "model.dtype": "bf16"},
     "model.dtype bf16: training.precision fp32 keeps the trained weights in fp32; leave "
     "model.dtype auto"),
    ({"training.precision": "mixed", "model.dtype": "bf16"},
     "model.dtype bf16: training.precision mixed"),
    ({"model.load_in_4bit": "true"},
     "model.load_in_4bit: trains LoRA adapters over the 4-bit base"),
    ({"model.load_in_4bit": "true", "model.lora_rank": 8},
     "model.load_in_4bit: bitsandbytes NF4 needs a CUDA GPU"),
])
def test_bad_settings_are_one_line_naming_the_option(overrides, message):
    with pytest.raises(ConfigError) as info:
        config(**overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_model_dtype_spelled_out_as_the_mode_says_is_accepted():
    config(**{"training.precision": "bf16", "model.dtype": "bf16"})
    config(**{"training.precision": "mixed", "model.dtype": "bf16", "model.lora_rank": 4})


def test_missing_libraries_and_cpu_without_bf16_are_one_line(monkeypatch):
    monkeypatch.setattr(precision_module, "has_module", lambda name: False)
    with pytest.raises(ConfigError, match=r"^training.precision bf16: needs torchao \(pip"):
        config(**{"training.precision": "bf16"})
    with pytest.raises(ConfigError, match=r"^training.precision bf16: bf16 SGD .* torch-optimi"):
        config(**{"training.precision": "bf16", "training.optimizer": "sgd"})
    with pytest.raises(ConfigError, match=r"^training.optimizer adamw8bit: needs torchao"):
        config(**{"training.optimizer": "adamw8bit"})
    config(**{"training.precision": "bf16", "model.lora_rank": 4})  # fp32 adapters: torch AdamW
    monkeypatch.setattr(precision_module, "has_module", lambda name: True)
    monkeypatch.setattr(precision_module.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^training.precision bf16: torchao .* C\+\+ compiler"):
        config(**{"training.precision": "bf16"})
    monkeypatch.setattr(precision_module, "cpu_computes_bf16", lambda: False)
    with pytest.raises(ConfigError, match=r"^training.precision mixed: this CPU / torch build "
                                          r"cannot compute in bf16; use training.precision fp32$"):
        config(**{"training.precision": "mixed"})
    config(**{"training.precision": "fp32"})  # fp32 needs neither


def test_lossy_mode_warns_that_it_loses_updates(capsys):
    """One plain line on stderr, not a Python warning with its source line (issue 32 item 11)."""
    cfg = config()
    cfg.training.precision = "bf16_lossy"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Python warning would raise here
        assert resolve_precision(cfg, CPU).name == "bf16_lossy"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: training.precision bf16_lossy: ")
    assert "rounds most updates away" in err[0]


STEPS = 300  # 300 x 1e-6 > 2.4e-4: a bf16 rounding step of the median weight (|w| 0.035)


@pytest.mark.slow
def test_bf16_and_mixed_updates_follow_fp32_and_plain_bf16_adamw_does_not(load_benchmark):
    """Same start (the embedded checkpoint), same data (one fixed rollout), lr 1e-6, 300 steps.

    Measure: follow_ratio = <D_mode, D_fp32> / |D_fp32|^2, where D is the change over the run of
    the weights as the forward pass uses them (bf16 casts in mixed and bf16). It is the share of
    the fp32 run's update that reaches the forward pass: 1 when nothing is lost, the surviving
    fraction when updates are rounded away. Rounding noise unrelated to the update's direction
    projects out, so stochastic rounding (exact on average) or a compensated optimizer (exact
    within one bf16 step) is not penalised for the noise, only for lost or biased updates. 300
    steps take the fp32 update past a bf16 rounding step of typical weights, which is when lost
    updates show and a compensated buffer has carried over (docs/benchmarks/memory.md: 10 to 300
    steps).
    """
    bench = load_benchmark("precision")
    torch.set_num_threads(1)
    reference = bench.train_updates("fp32", [STEPS])["deltas"][STEPS]
    ratios = {}
    for mode in ("mixed", "bf16", "bf16_lossy"):
        delta = bench.train_updates(mode, [STEPS])["deltas"][STEPS]
        ratios[mode] = bench.follow_ratio(delta, reference)
    assert abs(ratios["mixed"] - 1) <= 0.10, ratios
    assert abs(ratios["bf16"] - 1) <= 0.10, ratios
    assert ratios["bf16_lossy"] < 0.10, ratios  # plain AdamW on bf16 loses >90% of the update


def test_a_4bit_base_decodes_on_the_slot_engine():
    """vLLM cannot load a bitsandbytes base: `auto` picks the slot engine, `vllm` is refused."""
    from infsamp.sampling.engines.base import resolve_engine_name

    assert resolve_engine_name("auto", torch.device("cuda"), quantized=True) == "slots"
    cfg = config(**{"model.lora_rank": 8})
    cfg.model.load_in_4bit, cfg.sampling.engine = True, "vllm"
    with pytest.raises(ConfigError, match=r"^sampling.engine vllm: vLLM cannot load a bitsandbytes "
                                          r"4-bit base; .* sampling.engine slots"):
        resolve_precision(cfg, torch.device("cuda"))
