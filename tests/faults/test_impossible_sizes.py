"""A run that cannot fit is refused in one line before the weights load (issue 32 item 3:
`--sampling.num_generations 99999999999` printed a plan of 23.5 GiB on a 23 GiB machine, started
and never reached step 1); one whose model is known only once loaded, right after."""

from __future__ import annotations

import pytest
import torch

from infsamp.config import Config
from infsamp.options import ConfigError
from infsamp.sampling import sizes as run_sizes

from test_config_property import run_train

BEFORE_LOADING = "(planned from its config, before the weights load)"


@pytest.mark.parametrize("key, value, words", [
    ("sampling.num_generations", "4000000000",
     "sampling.num_generations 4000000000 x training.prompts_per_step 4: the step's "
     "16,000,000,000 samples need 4,768.37 GiB of memory before a token is decoded"),
    ("sampling.num_generations", "100000000", "samples per step"),
    ("training.train_micro_batch_tokens", "1000000000",
     "the run does not fit this machine's "),
])
def test_a_run_that_cannot_fit_is_refused_before_the_weights_load(key, value, words, tmp_path):
    code, stderr = run_train(key, "flag", value, tmp_path)  # loading the weights fails the test
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0], stderr
    assert "Traceback" not in stderr and not (tmp_path / "run").exists()
    if key == "training.train_micro_batch_tokens":
        assert BEFORE_LOADING in lines[0]
        assert "advice: fits with a smaller micro-batch: --training.train_micro_batch_tokens" \
            in lines[0]  # the option of `infsamp train`, not `infsamp plan`'s flag


def test_a_plan_that_does_not_fit_once_loaded_is_refused(monkeypatch):
    """A model whose config cannot be read before loading is planned once loaded: the plan that
    does not fit is refused there too (it was printed and the run went on)."""
    model = torch.nn.Linear(2, 2)
    model.config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "vocab_size": 1000}
    monkeypatch.setattr(run_sizes, "device_memory_bytes", lambda *args: 2**20)
    with pytest.raises(ConfigError, match=r"the run does not fit this machine's 0.00 GiB: "
                                          r"memory plan: .*\(does not fit; advice: "):
        run_sizes.plan_run(Config(), model, torch.device("cpu"))


def test_a_model_known_only_once_loaded_is_not_refused_before(monkeypatch, tmp_path):
    monkeypatch.setattr(run_sizes, "config_before_loading", lambda *args: None)
    run_sizes.check_fits_before_loading(Config(), torch.device("cpu"))  # nothing to plan yet


def test_a_run_that_fits_is_not_refused():
    run_sizes.check_fits_before_loading(Config(), torch.device("cpu"))
