"""Settings that used to start anyway or crash late (issue 32, items 4, 5, 7, 8, 11b): integer
options take integer literals only, every integer and duration has an upper bound, a key given
twice in a YAML file is refused naming both lines, a config file larger than a config is refused
before it is parsed, and sizes read up to PiB.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from infsamp.config_io import MAX_CONFIG_BYTES, load_config
from infsamp.options import MAX_DURATION_S, MAX_INTEGER, ConfigError, parse_size


@pytest.mark.parametrize("text", ["1e30", "10.0", "1.5", "three", "nan", "0x10"])
def test_an_integer_option_takes_integer_literals_only(text):
    with pytest.raises(ConfigError, match="training.max_steps: expected an integer literal"):
        load_config(overrides={"training.max_steps": text})


def test_integer_literals_and_yaml_integers_are_read(tmp_path):
    assert load_config(overrides={"training.max_steps": " 12 "}).training.max_steps == 12
    (tmp_path / "c.yaml").write_text("training:\n  max_steps: 7\n  prompts_per_step: 10.0\n")
    with pytest.raises(ConfigError, match="training.prompts_per_step: expected an integer"):
        load_config(tmp_path / "c.yaml")


@pytest.mark.parametrize("key, value, why", [
    ("training.max_steps", str(MAX_INTEGER + 1), "must be between"),
    ("sampling.num_generations", "99999999999", "must be between"),
    ("rewards.timeout_s", "1e30", "must be at most 604800 seconds"),
    ("distributed.failure_timeout_s", str(MAX_DURATION_S + 1), "must be at most 604800 seconds"),
])
def test_every_number_has_an_upper_bound(key, value, why):
    with pytest.raises(ConfigError, match=f"{key}: {why}"):
        load_config(overrides={key: value})
    assert load_config(overrides={"rewards.timeout_s": str(MAX_DURATION_S)}).rewards.timeout_s


@pytest.mark.parametrize("text, lines, key", [
    ("sampling:\n  num_generations: 4\ntraining:\n  max_steps: 2\nsampling:\n  micro_group: 2\n",
     "lines 1 and 5", "'sampling'"),
    ("training:\n  max_steps: 2\n  seed: 1\n  max_steps: 3\n", "lines 2 and 4", "'max_steps'"),
])
def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path, text, lines, key):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=f"{key} is given twice \\({lines}\\)"):
        load_config(tmp_path / "c.yaml")


def test_a_huge_config_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n" + "".join(f"  k{i}: {i}\n" for i in range(150_000)))
    assert path.stat().st_size > MAX_CONFIG_BYTES
    start = time.monotonic()
    with pytest.raises(ConfigError, match="more than a config holds"):
        load_config(path)
    assert time.monotonic() - start < 1


def test_a_huge_system_prompt_in_yaml_is_refused_at_once(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  system_prompt: " + "x" * (2 * MAX_CONFIG_BYTES) + "\n")
    with pytest.raises(ConfigError, match="more than a config holds"):
        load_config(path)


def test_sizes_read_up_to_pib():
    assert parse_size("1PiB") == 2**50 and parse_size("2 pb") == 2 * 10**15
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size("1EiB")


def test_the_cli_ends_each_in_one_line_fast_with_no_folder(tmp_path):
    for flag, value in [("--training.max_steps", "1e30"), ("--rewards.timeout_s", "1e30"),
                        ("--sampling.num_generations", "99999999999")]:
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "infsamp.cli", "train", flag, value,
                               "--logging.output_dir", str(tmp_path / "run")],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert flag[2:] in done.stderr and time.monotonic() - start < 10
        assert not (tmp_path / "run").exists()
