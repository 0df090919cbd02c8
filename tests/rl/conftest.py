"""A small trainer config around the shared tiny checkpoint (tests/conftest.py)."""

import pytest
from infsamp.config_io import load_config


@pytest.fixture
def tiny_config(tiny_model_dir, tmp_path):
    def make(**overrides):
        base = {
            "model.name_or_path": str(tiny_model_dir), "model.attn_implementation": "eager",
            "data.num_train_examples": 40, "data.num_eval_examples": 4, "eval.num_problems": 4,
            "sampling.num_generations": 4, "sampling.max_new_tokens": 12, "sampling.policy": "continuous",
            "sampling.micro_group": 4, "sampling.kv_budget": "4096",
            "training.max_steps": 4, "training.prompts_per_step": 2, "training.learning_rate": 1e-2,
            "training.warmup_ratio": 0.0, "logging.output_dir": str(tmp_path / "run"),
            "logging.progress_bar": False, "logging.plot": False,
        }
        base.update(overrides)
        return load_config(overrides=base)
    return make
