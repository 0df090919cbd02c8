"""Every precision mode (and 8-bit states) through the trainer: it trains, checkpoints, and a
resumed run ends on the same weights as an uninterrupted one."""

import pytest
import torch

from infsamp.errors import InfsampError
from infsamp.run.trainer import GRPOTrainer


class Killed(Exception):
    pass


def kill_after_step_2(step, _metrics):
    if step == 2:
        raise Killed


def resumed_equals_straight(make, tmp_path, **overrides) -> GRPOTrainer:
    def run(folder: str, **extra):
        return make(**{"logging.output_dir": str(tmp_path / folder), **overrides, **extra})

    straight = GRPOTrainer(run("a"))
    straight.train()
    with pytest.raises(Killed):
        GRPOTrainer(run("b", **{"checkpointing.save_every": 2}),
                    step_callback=kill_after_step_2).train()
    resumed = GRPOTrainer(run("b", **{"checkpointing.resume": "latest"}))
    assert resumed.step == 2
    resumed.train()
    expected, got = straight.model.state_dict(), resumed.model.state_dict()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    return straight


@pytest.mark.parametrize("overrides", [
    {"training.precision": "mixed"},
    {"training.precision": "bf16"},
    {"training.precision": "bf16", "training.optimizer": "sgd"},
    {"training.precision": "mixed", "model.lora_rank": 4, "training.beta": 0.04},
    {"training.precision": "bf16", "model.lora_rank": 4},
], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_mode_trains_and_resumes_exactly(tiny_config, tmp_path, overrides):
    trainer = resumed_equals_straight(tiny_config, tmp_path,
                                      **{"eval.num_problems": 0, **overrides})
    weights = torch.bfloat16 if overrides["training.precision"] == "bf16" else torch.float32
    expected = torch.float32 if "model.lora_rank" in overrides else weights
    assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {expected}


def test_resume_with_another_precision_is_one_line(tiny_config, tmp_path):
    out = str(tmp_path / "run")
    GRPOTrainer(tiny_config(**{"logging.output_dir": out, "training.max_steps": 1,
                               "eval.num_problems": 0})).train()
    with pytest.raises(InfsampError, match=r"training.precision fp32 \(this run: bf16\)"):
        GRPOTrainer(tiny_config(**{"logging.output_dir": out, "checkpointing.resume": "latest",
                                   "training.precision": "bf16", "training.max_steps": 2}))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_8bit_adamw_on_cpu_trains_and_resumes_exactly(tiny_config, tmp_path, precision):
    """torchao's AdamW8bit on the embedded model (its large tensors get 8-bit states; the tiny test
    model's all have fewer than torchao's 4096 values). Slow: torchao compiles its step per
    shape."""
    trainer = resumed_equals_straight(
        tiny_config, tmp_path,
        **{"model.name_or_path": "embedded", "eval.num_problems": 0,
           "training.precision": precision, "training.optimizer": "adamw8bit",
           "training.learning_rate": 1e-3})
    states = trainer.optimizer.state[trainer.model.model.layers[0].mlp.up_proj.weight]
    assert type(states["exp_avg"]).__name__ == "OptimState8bit"


@pytest.mark.gpu
def test_qlora_trains_adapters_over_a_4bit_base(tiny_config):
    pytest.importorskip("bitsandbytes")
    trainer = GRPOTrainer(tiny_config(**{"model.device": "cuda", "model.load_in_4bit": True,
                                         "model.lora_rank": 4, "training.precision": "bf16",
                                         "training.max_steps": 2, "eval.num_problems": 2}))
    linear = trainer.model.get_base_model().model.layers[0].mlp.up_proj.base_layer
    assert type(linear).__name__ == "Linear4bit"
    trainer.train()
    adapters = [p for p in trainer.model.parameters() if p.requires_grad]
    assert adapters and {p.dtype for p in adapters} == {torch.float32}


def test_8bit_states_are_written_as_data_and_rebuilt():
    """torchao's quantized states go into a checkpoint as plain tensors (codes, scales, code map)
    and come back as the same class; any other tensor subclass is refused."""
    import json

    from torchao.optim.subclass_8bit import OptimState8bit

    from infsamp.run.state_data import from_data, to_data

    state = OptimState8bit.zeros((64, 128), True, 256, "cpu")
    state.scale.uniform_(0.5, 1.0)
    state.codes.random_(0, 256)
    tree, tensors = to_data({"exp_avg": state, "dtype": torch.bfloat16})
    json.dumps(tree)  # the structure is JSON; every tensor is a plain one
    assert all(type(t) is torch.Tensor for t in tensors.values())
    back = from_data(tree, tensors)
    assert type(back["exp_avg"]) is OptimState8bit and back["dtype"] is torch.bfloat16
    assert torch.equal(back["exp_avg"].dequantize(), state.dequantize())
    tree["exp_avg"]["__subclass__"] = "os.system"
    with pytest.raises(ValueError, match="not a tensor class a checkpoint may rebuild"):
        from_data(tree, tensors)
