"""The run's sizes, decided once (`planner/sizes.py`): the g the start-up line prints is the g
every sampler call runs, whatever the step's prompts; `infsamp plan` and `infsamp train` size
through one function with the same defaults; the out-of-memory retry halves them; a checkpoint
stores them."""

import json
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infsamp.cli import main
from infsamp.config import Config
from infsamp.planner import PRESETS, kv_bytes_per_token, load_shape, plan_memory
from infsamp.planner.estimate import GIB
from infsamp.planner.kv_budget import kv_tokens_needed, micro_group_within
from infsamp.planner.presets import shape_from_config
from infsamp.planner.sizes import RunSizes, plan_line, plan_run_sizes, run_engine
from infsamp.sampling import sizes as run_sizes
from infsamp.sampling.sampler import GroupSampler

LLAMA_1B = PRESETS["llama-3.2-1b"]


def config(**sections) -> Config:
    """The defaults, with some fields of some sections replaced: config(sampling={...})."""
    cfg = Config()
    return replace(cfg, **{name: replace(getattr(cfg, name), **fields)
                           for name, fields in sections.items()})


def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      eos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("longest", [20, 65, 100, 256])
def test_the_printed_g_is_the_g_the_sampler_runs(longest, one_thread):
    """Issue 23's bug: with the defaults (G 8, 4 prompts, g 16, max prompt 256) the line said g=16
    and the sampler ran fewer once a step's longest prompt passed 64 tokens (the budget held one
    open prompt, the sampler allows 4). Short completions make the shortfall large (g=1)."""
    cfg = config(sampling={"max_new_tokens": 4, "temperature": 0.0})
    model = tiny_model()
    plan, sizes = plan_run_sizes(cfg, shape_from_config(model.config), 24 * GIB, device="cpu",
                                 dtype_bytes=4)
    assert sizes.micro_group == 16 and "g=16," in plan_line(plan, sizes)
    prompts = [[2 + (i + k) % 60 for k in range(longest if i == 0 else 10)] for i in range(4)]
    stats = GroupSampler(model, None, cfg.sampling, sizes=sizes).sample(prompts, 8).stats
    assert stats.micro_group == sizes.micro_group == 16
    assert stats.kv_budget_tokens == sizes.kv_budget_tokens


def test_budget_holds_g_for_every_prompt_the_run_allows():
    for engine, device in (("slots", "cpu"), ("vllm", "cuda"), ("vllm", "cpu")):
        _, sizes = plan_run_sizes(config(sampling={"engine": engine}), LLAMA_1B, 80 * GIB,
                                  device=device)
        block = 1 if engine == "slots" else 16 if device == "cuda" else 32
        usable = sizes.kv_budget_tokens - (block if engine == "vllm" else 0)  # vLLM's null block
        for longest in range(1, 257):
            assert micro_group_within(usable, 256, longest, 4, 32, block) >= 16, longest


def test_run_micro_batch_is_the_plans():
    """(was: auto_train_micro_batch_tokens matches the plan) the run's micro-batch is the one
    plan_memory chooses for the same settings."""
    cfg = config(sampling={"num_generations": 64, "max_new_tokens": 786, "micro_group": 0,
                           "engine": "slots"},
                 training={"prompts_per_step": 1, "optimizer": "adamw8bit"},
                 model={"gradient_checkpointing": True})
    plan, sizes = plan_run_sizes(cfg, LLAMA_1B, 16 * GIB, device="cuda")
    alone = plan_memory(LLAMA_1B, gpu_memory_bytes=16 * GIB, num_generations=64,
                        max_prompt_tokens=256, max_new_tokens=786, optimizer="adamw8bit",
                        gradient_checkpointing=True, share_prompt=True)  # training's default
    assert sizes.train_micro_batch_tokens == plan.train_micro_batch_tokens
    assert sizes.train_micro_batch_tokens == alone.train_micro_batch_tokens > 0


def test_a_configured_micro_batch_is_the_one_planned():
    """The start-up line's peak is that of the micro-batch the run trains with (issue 20: it was
    the peak of the planner's own, larger choice, 14.33 GiB printed for a 4096-token run)."""
    cfg = config(training={"train_micro_batch_tokens": 4 * 512}, sampling={"engine": "slots"})
    plan, sizes = plan_run_sizes(cfg, LLAMA_1B, 80 * GIB, device="cuda")
    auto, _ = plan_run_sizes(config(sampling={"engine": "slots"}), LLAMA_1B, 80 * GIB,
                             device="cuda")
    assert sizes.train_micro_batch_tokens == plan.train_micro_batch_tokens == 4 * 512
    assert auto.train_micro_batch_tokens > 4 * 512 and auto.training["peak"] > plan.training["peak"]


def test_auto_kv_budget_follows_memory():
    """(was: auto_kv_budget_tokens) with `micro_group: 0` the budget is what the largest g that
    fits needs: none fits in too little memory, the KV never exceeds the memory, more memory holds
    more."""
    cfg = config(sampling={"num_generations": 64, "micro_group": 0, "max_new_tokens": 786,
                           "engine": "slots"},
                 training={"prompts_per_step": 2, "optimizer": "adamw8bit"})
    starved, _ = plan_run_sizes(cfg, LLAMA_1B, 4 * GIB, device="cuda")
    assert starved.micro_group == 0 and not starved.fits
    plans = {gib: plan_run_sizes(cfg, LLAMA_1B, gib * GIB, device="cuda")
             for gib in (6, 8)}
    for gib, (plan, sizes) in plans.items():
        assert 0 < sizes.micro_group == plan.micro_group < 128
        assert sizes.kv_budget_tokens == kv_tokens_needed(sizes.micro_group, 786, 256, 2)
        assert sizes.kv_budget_tokens * kv_bytes_per_token(LLAMA_1B) <= gib * GIB
    assert plans[8][1].kv_budget_tokens > 2 * plans[6][1].kv_budget_tokens


def test_plan_command_sizes_as_train_does(capsys):
    """`infsamp plan` without flags plans `infsamp train` without flags (the config's defaults,
    `auto` engine), through the same function."""
    assert main(["plan", "--model", "qwen3-0.6b", "--gpu-memory", "24GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan, sizes = plan_run_sizes(Config(), load_shape("qwen3-0.6b"), 24 * GIB, device="cuda")
    assert data["run_sizes"] == sizes.state_dict() and data["micro_group"] == plan.micro_group
    settings = data["settings"]
    assert (settings["max_new_tokens"], settings["max_prompt_tokens"]) == (256, 256)
    assert (settings["num_generations"], settings["num_prompts"], settings["engine"]) == \
        (8, 4, run_engine(Config(), "cuda"))
    assert main(["plan", "--model", "qwen3-0.6b", "--engine", "slots"]) == 0
    out = capsys.readouterr().out
    assert "run sizes (as infsamp train prints them): g=16, KV budget 5120 tokens" in out


@pytest.mark.parametrize("temperature, engine", [(0.7, "vllm"), (2.5, "slots")])
def test_plan_and_train_size_one_config_alike(temperature, engine, tmp_path, monkeypatch,
                                              capsys):
    """Issue 20: `infsamp plan` resolved `auto` without the sampling temperature (vLLM at 2.5,
    where the trainer decodes on the slot engine). Both now size through `plan_run_sizes` with
    the same inputs: the trainer's `plan_run` on a loaded model and the command on its
    config.json give the same engine, sizes and plan (vLLM 'installed', a CUDA device whose
    memory and runtime are fixed)."""
    monkeypatch.setattr("infsamp.planner.sizes.vllm_installed", lambda: True)
    monkeypatch.setattr(run_sizes, "device_memory_bytes", lambda *args: 8 * GIB)
    monkeypatch.setattr(run_sizes, "measured_runtime_bytes", lambda *args: None)
    model = tiny_model().to(torch.bfloat16)
    model.config.save_pretrained(tmp_path)
    cfg = config(sampling={"temperature": temperature, "num_generations": 4,
                           "max_new_tokens": 32, "micro_group": 0},
                 training={"prompts_per_step": 2}, data={"max_prompt_length": 64})
    trained = run_sizes.plan_run(cfg, model, torch.device("cuda"))
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "8GiB", "--temperature",
                 str(temperature), "--num-generations", "4", "--max-completion", "32",
                 "--micro-group", "0", "--prompts-per-step", "2", "--max-prompt", "64",
                 "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["settings"]["engine"] == engine
    assert planned["run_sizes"] == trained.sizes.state_dict()
    assert f"peak {planned['peak_bytes'] / GIB:.2f} GiB" in trained.note


def test_old_flag_names_still_work(capsys):
    args = ["plan", "--model", "qwen3-0.6b", "--engine", "slots", "--prompts-per-step", "1",
            "--json"]
    assert main(args + ["--num-generations", "4"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert main(args + ["--num-generations", "4"]) == 0
    assert json.loads(capsys.readouterr().out) == old and old["settings"]["num_generations"] == 4


def test_out_of_memory_halving_and_checkpoint_state():
    sizes = RunSizes(kv_budget_tokens=5120, micro_group=32, max_micro_group=32,
                     max_prompt_tokens=256, max_new_tokens=256, train_micro_batch_tokens=200)
    assert sizes.sampling_policy("full") == "full"
    assert sizes.halve("sampling") == 16 and sizes.sampling_policy("full") == "continuous"
    assert sizes.halve("training") == 100 and sizes.halve("training") == 64  # its floor
    assert sizes.oom_retries == {"sampling": 1, "training": 2}
    saved = json.loads(json.dumps(sizes.state_dict()))
    fresh = RunSizes(kv_budget_tokens=5120, micro_group=32, max_micro_group=32,
                     max_prompt_tokens=256, max_new_tokens=256, train_micro_batch_tokens=200)
    fresh.load_state_dict(saved)
    assert fresh == sizes
    smaller = RunSizes(kv_budget_tokens=5120, micro_group=8, max_micro_group=8,
                       max_prompt_tokens=256, max_new_tokens=256, train_micro_batch_tokens=200)
    smaller.load_state_dict(saved)
    assert smaller.micro_group == 8  # never more than the engine started for


def test_the_runtime_is_measured_once_and_printed_as_its_own_part(monkeypatch):
    """Issue 20: the whole process holds the runtime beside the tensors. The run measures it
    before planning (CPU: resident set less the model's tensors; CUDA: the allocator's reserved
    less allocated, plus the assumed context), rounds it up to 32 MiB and the line prints it."""
    from infsamp.models import device as device_module

    model = torch.nn.Linear(256, 1024)  # 263,168 fp32 parameters
    tensors = sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(device_module, "resident_bytes", lambda: 500 * 2**20)
    cpu = torch.device("cpu")
    assert device_module.runtime_bytes(cpu, model, 512 * 2**20) == 500 * 2**20 - tensors
    assert run_sizes.measured_runtime_bytes(cpu, model) == 512 * 2**20  # rounded up to 32 MiB
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 96 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 90 * 2**20)
    assert device_module.runtime_bytes(torch.device("cuda"), model, 512 * 2**20) == 518 * 2**20
    monkeypatch.setattr(device_module, "resident_bytes", lambda: None)  # no /proc: assumed
    assert run_sizes.measured_runtime_bytes(cpu, model) is None
    measured, sizes = plan_run_sizes(Config(), LLAMA_1B, 80 * GIB, device="cpu",
                                     runtime_bytes=2 * GIB)
    assumed, _ = plan_run_sizes(Config(), LLAMA_1B, 80 * GIB, device="cpu")
    assert measured.peak_bytes - assumed.peak_bytes == 2 * GIB - assumed.training["runtime"]
    tensors_gib = (measured.peak_bytes - 2 * GIB) / GIB
    assert (f"memory plan: peak {measured.peak_bytes / GIB:.2f} GiB (runtime 2.00 GiB measured "
            f"+ tensors {tensors_gib:.2f} GiB), g=16,") in plan_line(measured, sizes)
    assert "GiB assumed + tensors" in plan_line(assumed, sizes)


def test_resident_bytes_reads_this_process():
    from infsamp.models.device import resident_bytes

    before = resident_bytes()
    assert before is None or 10 * 2**20 < before < 64 * GIB
