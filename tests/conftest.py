"""Shared test setup: GPU tests skip cleanly without CUDA; a tiny char-level checkpoint for CLI and
trainer tests; `load_benchmark` imports a script of benchmarks/ by name.

Experiment trackers stay local and off the network for the whole session (trackio reads TRACKIO_DIR
once, when first imported, and TRL imports it: so it is set here, before any test module loads).
"""

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from transformers import LlamaConfig, LlamaForCausalLM

from infsamp.models.tiny import build_tokenizer

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="infsamp-tests-trackio-")
# GGUF conversions of test files go to a session folder; the real model's tests (marked slow) use
# the machine's cache, converted once (INFSAMP_TESTS_USER_CACHE_DIR)
from infsamp.models.gguf import cache_root  # noqa: E402

# kept in the environment: test modules cannot import this conftest by name (others share it)
os.environ["INFSAMP_TESTS_USER_CACHE_DIR"] = str(cache_root())
os.environ["INFSAMP_CACHE_DIR"] = tempfile.mkdtemp(prefix="infsamp-tests-cache-")
os.environ.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1"})
for _name in ("WANDB_API_KEY", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "MLFLOW_TRACKING_URI"):
    os.environ.pop(_name, None)

# Property tests draw the same examples on every run, so CI's verdict does not depend on luck;
# HYPOTHESIS_PROFILE=explore draws fresh ones when hunting for new failures.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark('precision') -> the module benchmarks/precision.py."""
    def load(name: str):
        script = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"bench_{name}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama (hidden 32) with the embedded char tokenizer, saved once per
    session."""
    path = tmp_path_factory.mktemp("tiny_model")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gguf_file(tmp_path_factory):
    """(path of a tiny Llama written as GGUF with Q8_0 weights, the model it was written from)."""
    from gguf_files import write_tiny_gguf

    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and do not fight parallel jobs for the 2 cores);
    module-scoped, so module-scoped fixtures (a test file's model) may use it too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Tests never touch the network: the hub probe answers 'unreachable' (a test may change it)."""
    import infsamp.hub

    monkeypatch.setattr(infsamp.hub, "_endpoint_answers", lambda: False)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def chat_model_dirs(tmp_path_factory):
    """{'llama3': folder, 'qwen3': folder}: tiny random chat models saved once per session."""
    from chat_models import build_chat_model

    root = tmp_path_factory.mktemp("chat_models")
    return {style: build_chat_model(style, root / style) for style in ("llama3", "qwen3")}


@pytest.fixture
def tiny_config(tiny_model_dir, tmp_path):
    """A small trainer config around the shared tiny checkpoint."""
    from infsamp.config_io import load_config

    def make(**overrides):
        base = {
            "model.name_or_path": str(tiny_model_dir), "model.attn_implementation": "eager",
            "data.num_train_examples": 40, "data.num_eval_examples": 4, "eval.num_problems": 4,
            "sampling.num_generations": 4, "sampling.max_new_tokens": 12,
            "sampling.policy": "continuous",
            "sampling.micro_group": 4, "sampling.kv_budget": "4096",
            "training.max_steps": 4, "training.prompts_per_step": 2, "training.learning_rate": 1e-2,
            "training.warmup_ratio": 0.0, "logging.output_dir": str(tmp_path / "run"),
            "logging.progress_bar": False, "logging.plot": False,
        }
        base.update(overrides)
        return load_config(overrides=base)
    return make
