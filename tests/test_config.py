"""Config tree: YAML + overrides, type coercion, validation errors that name the key."""

from pathlib import Path

import pytest

from infsamp.config import Config
from infsamp.config_io import load_config, save_config
from infsamp.options import ConfigError, parse_size

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_defaults_validate():
    cfg = load_config()
    assert cfg.sampling.num_generations >= 2
    assert cfg.model.name_or_path == "embedded"


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  learning_rate: 1.0e-4\n  max_steps: 7\nsampling:\n  "
                    "num_generations: 16\n")
    cfg = load_config(path, {"training.learning_rate": "1e-5",
                             "rewards.functions": "format,accuracy"})
    assert cfg.training.learning_rate == 1e-5
    assert cfg.training.max_steps == 7
    assert cfg.sampling.num_generations == 16
    assert cfg.rewards.functions == ["format", "accuracy"]


@pytest.mark.parametrize("overrides, key", [
    ({"training.bogus": 1}, "training.bogus"),
    ({"nosection.x": 1}, "nosection.x"),
    ({"training.max_steps": "abc"}, "training.max_steps"),
    ({"training.max_steps": 2.5}, "training.max_steps"),
    ({"training.learning_rate": -1}, "training.learning_rate"),
    ({"sampling.num_generations": 1}, "sampling.num_generations"),
    ({"sampling.max_new_tokens": 0}, "sampling.max_new_tokens"),
    ({"model.name_or_path": "/does/not/exist"}, "model.name_or_path"),
    ({"training.loss_type": "ppo"}, "training.loss_type"),
    ({"training.scale_rewards": "median"}, "training.scale_rewards"),
    ({"sampling.kv_budget": "24XB"}, "sampling.kv_budget"),
    ({"logging.progress_bar": "maybe"}, "logging.progress_bar"),
    ({"rewards.weights": "1.0"}, "rewards.weights"),
    ({"training.loss_type": "gspo_token"}, "training.loss_type"),
    ({"training.top_entropy_quantile": 0}, "training.top_entropy_quantile"),
    ({"training.top_entropy_quantile": 1.5}, "training.top_entropy_quantile"),
    ({"training.mask_truncated_completions": "sometimes"}, "training.mask_truncated_completions"),
    ({"rewards.timeout_s": -1}, "rewards.timeout_s"),
    ({"rewards.allow_async": "perhaps"}, "rewards.allow_async"),
    ({"logging.completions_every": -2}, "logging.completions_every"),
])
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    message = str(info.value)
    assert message.startswith(key)
    assert "\n" not in message


@pytest.mark.parametrize("loss_type, epsilon, epsilon_high", [
    ("dapo", 0.2, 0.2), ("gspo", 3e-4, 4e-4), ("cispo", 0.2, 5.0),
])
def test_loss_type_defaults_of_the_clip_range_are_resolved_and_saved(tmp_path, loss_type, epsilon,
                                                                      epsilon_high):
    cfg = load_config(overrides={"training.loss_type": loss_type})
    assert (cfg.training.epsilon, cfg.training.epsilon_high) == (epsilon, epsilon_high)
    save_config(cfg, tmp_path / "config.yaml")
    assert f"epsilon_high: {epsilon_high}" in (tmp_path / "config.yaml").read_text()
    explicit = load_config(overrides={"training.loss_type": loss_type, "training.epsilon": 0.1})
    assert explicit.training.epsilon == 0.1


@pytest.mark.parametrize("recipe", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_recipes_validate(recipe):
    cfg = load_config(recipe)
    if recipe.name == "gsm8k_gspo.yaml":
        assert cfg.training.loss_type == "gspo" and cfg.training.epsilon_high == 4e-4
    if cfg.data.dataset.startswith("reasoning_gym:"):  # the task takes these options
        pytest.importorskip("reasoning_gym")
        from infsamp.tasks.sources import check_dataset_source

        check_dataset_source(cfg.data)


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("training: 3\n")
    with pytest.raises(ConfigError, match="^training: expected a mapping"):
        load_config(wrong)


def test_save_and_reload_roundtrip(tmp_path):
    cfg = load_config(overrides={"training.max_steps": 3, "sampling.policy": "rounds"})
    save_config(cfg, tmp_path / "out.yaml")
    again = load_config(tmp_path / "out.yaml")
    assert again.to_dict() == cfg.to_dict()
    assert isinstance(again, Config)


def test_parse_size():
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("8192") == 8192
    with pytest.raises(ValueError):
        parse_size("24XB")
    with pytest.raises(ValueError):
        parse_size("0")


@pytest.mark.parametrize("overrides, key", [
    ({"data.chat_template_kwargs": "[1, 2]"}, "data.chat_template_kwargs"),
    ({"data.chat_template_kwargs": "{add_generation_prompt: false}"}, "data.chat_template_kwargs"),
    ({"data.eval_fraction": 1.0}, "data.eval_fraction"),
    ({"data.eval_fraction": -0.1}, "data.eval_fraction"),
    ({"rewards.format_think_block": "strip"}, "rewards.format_think_block"),
    ({"sampling.predictor": "oracle"}, "sampling.predictor"),  # knows the true lengths: bench only
    ({"data.dataset": "./no/such.jsonl"}, "data.dataset"),
    ({"data.dataset": "data/gsm8k/train.jsonl"}, "data.dataset"),  # a path (3 parts), not a hub id
])
def test_issue15_options_are_checked_before_anything_loads(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert str(info.value).startswith(key) and "\n" not in str(info.value)


def test_chat_template_kwargs_from_yaml_and_from_a_flag(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  chat_template_kwargs:\n    enable_thinking: false\n")
    assert load_config(path).data.chat_template_kwargs == {"enable_thinking": False}
    flag = load_config(path, {"data.chat_template_kwargs": "{enable_thinking: true, budget: 3}"})
    assert flag.data.chat_template_kwargs == {"enable_thinking": True, "budget": 3}
    save_config(flag, tmp_path / "saved.yaml")
    saved = load_config(tmp_path / "saved.yaml")
    assert saved.data.chat_template_kwargs == {"enable_thinking": True, "budget": 3}


def test_a_missing_folder_that_looks_like_a_path_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()  # so 'models/qwen3-tin' can only be a local path
    with pytest.raises(ConfigError, match="^model.name_or_path: path does not exist"):
        load_config(overrides={"model.name_or_path": "models/qwen3-tin"})
    hub_id = load_config(overrides={"model.name_or_path": "Qwen/Qwen3-1.7B"})  # fine: a hub id
    assert hub_id.model.name_or_path == "Qwen/Qwen3-1.7B"


def test_a_list_of_mappings_from_the_command_line_is_flow_yaml(tmp_path):
    turns = '[{role: user, content: "Calculate 1, 2."}, {role: assistant, content: "3"}]'
    cfg = load_config(overrides={"data.example_turns": turns})
    assert cfg.data.example_turns == [{"role": "user", "content": "Calculate 1, 2."},
                                      {"role": "assistant", "content": "3"}]
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml").data.example_turns == cfg.data.example_turns
    assert load_config(overrides={"rewards.functions": "[format, accuracy]"}).rewards.functions \
        == ["format", "accuracy"]
    with pytest.raises(ConfigError, match="data.example_turns: expected a list"):
        load_config(overrides={"data.example_turns": "[{role: user"})
