"""A tiny random Llama with the embedded char tokenizer, saved once per session, and a small config."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infsamp.config import load_config
from infsamp.models.tiny import build_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_model")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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
