"""Every option, given a bad value, ends in one line naming it and exit code 2, before any model
loads.

Random bad values come from each option's type (a word for a number, NaN and inf for a float, a
mapping in YAML for a string or list) and, for options with a valid range or a set of names, from
outside it. `load_model_and_tokenizer` is replaced by a trap: a bad value that got as far as
loading the model fails the test.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
import typing
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infsamp import cli
from infsamp.config import Config
from infsamp.config_io import iter_options
from infsamp.options import MAX_DURATION_S, parse_size

OPTIONS = {key: (annotation, default) for key, annotation, default, _ in iter_options()}
CHARACTERS = st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="/:,")
WORDS = st.text(CHARACTERS, min_size=1, max_size=12)


def _not_size(text: str) -> bool:
    try:
        parse_size(text)
    except ValueError:
        return True
    return False


def _choices(key: str) -> tuple[str, ...]:
    section, name = key.split(".")
    cls = type(getattr(Config(), section))
    return cls.__dataclass_fields__[name].metadata.get("choices", ())


def _names(module: str, registry: str) -> set[str]:
    import importlib

    return set(getattr(importlib.import_module(module), registry))


def outside(names) -> st.SearchStrategy[str]:
    return WORDS.filter(lambda w: w not in names and w.lower() not in names)


BELOW = {  # int and float options -> their smallest valid value (values below it are bad)
    "model.lora_rank": 0, "model.lora_alpha": 1, "model.lora_dropout": 0,
    "data.num_eval_examples": 0, "data.num_train_examples": 1, "data.max_prompt_length": 1,
    "data.seed": 0, "sampling.num_generations": 2, "sampling.micro_group": 0,
    "sampling.max_new_tokens": 1, "sampling.temperature": 0, "sampling.top_k": 0,
    "sampling.predictor_prefix_tokens": 0, "training.max_steps": 1, "training.prompts_per_step": 1,
    "training.learning_rate": 0, "training.weight_decay": 0, "training.adam_beta1": 0,
    "training.adam_beta2": 0, "training.max_grad_norm": 0, "training.beta": 0,
    "training.epsilon": 0, "training.epsilon_high": 0, "training.num_iterations": 1,
    "training.train_micro_batch_tokens": 0, "training.seed": 0, "training.num_threads": 0,
    "training.warmup_ratio": 0, "eval.every_steps": 0, "eval.num_problems": 0,
    "eval.temperature": 0, "eval.max_new_tokens": 0, "logging.log_every": 1,
    "checkpointing.save_every": 0, "checkpointing.keep_last": 1,
    "sampling.max_num_generations": 0, "sampling.dynamic_chunk": 0,
    "sampling.max_replaced_prompts": -1, "training.completions_per_step": 0,
    "sampling.max_turns": 0, "tools.timeout_s": 0, "tools.max_workers": 1,
    "data.eval_fraction": 0, "distributed.failure_timeout_s": 1, "logging.completions_every": 0,
    "rewards.timeout_s": 0, "sampling.grouping_epsilon": 0, "sampling.probe_tokens": 1,
    "sampling.top_p": 0, "sampling.vllm_importance_sampling_cap": 1,
    "training.top_entropy_quantile": 0,
}
ABOVE = {"training.adam_beta1": 1, "training.adam_beta2": 1, "training.warmup_ratio": 1,
         "model.lora_dropout": 1, "sampling.top_p": 1.0000001, "training.seed": 2**32,
         "data.seed": 2**32, "training.num_threads": 4097, "data.eval_fraction": 1,
         "training.top_entropy_quantile": 1.0000001, "data.num_train_examples": 1_000_001,
         "data.num_eval_examples": 1_000_001}
# every option that is a number has bad values below (or above) its range; these take any
# finite number: a reward threshold (rewards may be negative) and sizes with no upper bound
ANY_FINITE = {"eval.accuracy_threshold"}
NAMED = {  # free-text options with a closed set of valid names
    "sampling.policy": lambda: outside(_names("infsamp.sampling.policies", "POLICIES")),
    "training.loss_type": lambda: outside(_names("infsamp.algorithm.losses", "LOSS_TYPES")),
    "training.scale_rewards": lambda: outside(_names("infsamp.algorithm.advantages",
                                                     "REWARD_SCALERS")),
    "training.lr_scheduler": lambda: outside(_names("infsamp.choices", "LR_SCHEDULERS")),
    "training.optimizer": lambda: outside({"adamw", "adamw8bit", "sgd"}),
    "sampling.predictor": lambda: outside({"online", "hidden", "none", "oracle"}).filter(
        lambda w: not w.startswith("noisy")),
    "sampling.refill": lambda: outside({"auto", "sjf", "ljf"}),
    "sampling.kv_budget": lambda: outside({"auto"}).filter(_not_size),
    "model.device": lambda: outside({"auto", "cpu"}).filter(
        lambda w: not w.startswith(("cpu", "cuda"))),
    "model.attn_implementation": lambda: outside({"sdpa", "eager", "flex_attention"}),
    "rewards.functions": lambda: outside({"format", "accuracy"}),
    "checkpointing.resume": lambda: outside({"latest", "auto"}).filter(
        lambda w: not Path(w).exists()),
    "logging.output_dir": lambda: st.sampled_from([__file__, f"{__file__}/run", " "]),
}


def bad_values(key: str) -> st.SearchStrategy[tuple[str, typing.Any]]:
    """(route, value): 'flag' values go on the command line, 'yaml' values into a config file."""
    annotation, _ = OPTIONS[key]
    flags: list[st.SearchStrategy[str]] = []
    if annotation is int:
        flags.append(st.sampled_from(["abc", "1.5", "nan", "", "true", "1e400", "1e30", "10.0",
                                      "99999999999", "-99999999999", "inf"]))
    if annotation is float:
        flags.append(st.sampled_from(["abc", "nan", "inf", "-inf", "", "1e400"]))
        if key.endswith("_s"):  # a duration: beyond what the OS's waits take
            flags.append(st.sampled_from(["1e30", "1e10", str(MAX_DURATION_S * 2)]))
    if annotation is bool:
        flags.append(outside({"true", "1", "yes", "false", "0", "no"}))
    if annotation == list[float]:
        flags.append(st.sampled_from(["a", "nan", "1,inf", "1,2,3"]))
    if key in BELOW:
        step = 1 if annotation is int else 1e-9
        kind = st.integers if annotation is int else st.floats
        flags.append(kind(max_value=BELOW[key] - step, min_value=-(10**12)).map(str))
    if key in ABOVE:
        flags.append(st.sampled_from([ABOVE[key], ABOVE[key] * 3]).map(str))
    if _choices(key):
        flags.append(outside(set(_choices(key))))
    if key in NAMED:
        flags.append(NAMED[key]())
    if typing.get_origin(annotation) is dict:  # a mapping is its valid form: bad ones are other
        flags.append(st.sampled_from(["[1, 2]", "{unclosed", "3"]))
        reserved = st.dictionaries(st.sampled_from(["add_generation_prompt", "tokenize"]), WORDS,
                                   min_size=1)
        in_yaml = st.one_of(reserved, st.lists(WORDS, min_size=1), st.integers(), st.none())
    else:
        in_yaml = st.one_of(st.dictionaries(WORDS, WORDS, min_size=1), st.none())
    return st.one_of([st.tuples(st.just("yaml"), in_yaml)] +
                     [st.tuples(st.just("flag"), flag) for flag in flags])


def run_train(key: str, route: str, value: typing.Any, folder: Path,
              *extra: str) -> tuple[int, str]:
    argv = ["train", "--logging.output_dir", str(folder / "run"), *extra]
    if route == "flag":
        argv.append(f"--{key}={value}")  # the = keeps a value that starts with - a value
    else:
        section, name = key.split(".")
        (folder / "c.yaml").write_text(yaml.safe_dump({section: {name: value}}))
        argv.insert(1, str(folder / "c.yaml"))
    caught = AssertionError(f"{key}={value!r} got as far as loading the model")
    trap = mock.patch("infsamp.run.trainer.load_model_and_tokenizer", side_effect=caught)
    err = io.StringIO()
    with trap, contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    return code, err.getvalue()


def assert_one_line_naming(key: str, code: int, stderr: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, (key, code, stderr)
    # the bad value is echoed, and random text may spell "Traceback": look for a real one
    assert lines[0].startswith("infsamp train: error: ")
    assert "Traceback (most recent call last)" not in stderr
    section, name = key.split(".")
    assert key in lines[0] or (name in lines[0] and section in lines[0]), (key, lines[0])


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_bad_values_through_every_option(data):
    key = data.draw(st.sampled_from(sorted(OPTIONS)))
    route, value = data.draw(bad_values(key))
    with tempfile.TemporaryDirectory() as folder:
        start = time.monotonic()
        code, stderr = run_train(key, route, value, Path(folder))
        assert time.monotonic() - start < 10, (key, value)
        assert not (Path(folder) / "run").exists(), (key, value)  # the folder as it was
    assert_one_line_naming(key, code, stderr)


@pytest.mark.parametrize("key", sorted(OPTIONS))
def test_every_option_refuses_a_mapping(key, tmp_path):
    mapping = {"not": "a value"}
    if typing.get_origin(OPTIONS[key][0]) is dict:  # a mapping option: one infsamp sets itself
        mapping = {"add_generation_prompt": False}
    assert_one_line_naming(key, *run_train(key, "yaml", mapping, tmp_path))


@given(target=WORDS.filter(lambda w: w not in {"all-linear"}))
@settings(max_examples=15, deadline=None)
def test_lora_targets_must_name_modules_of_the_model(target):
    if target in {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "lm_head", "embed_tokens"}:
        return  # a real module: the run would load the model (the trap), rightly
    with tempfile.TemporaryDirectory() as folder:
        code, stderr = run_train("model.lora_target_modules", "flag", target, Path(folder),
                                 "--model.lora_rank", "4")
    assert_one_line_naming("model.lora_target_modules", code, stderr)


def test_every_numeric_option_gets_values_outside_its_range():
    """The property test draws floats for integers, huge, negative, NaN and inf for every
    option, and values just outside its range for each number that has one."""
    numeric = {key for key, (annotation, _) in OPTIONS.items() if annotation in (int, float)}
    assert numeric - set(BELOW) - ANY_FINITE == set()
