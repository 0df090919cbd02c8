"""Trace reading (validated), the replay, the synthetic workload and the `infsamp simulate` CLI."""

import json

import pytest

from infsamp.cli import main
from infsamp.errors import DataError, SamplingError
from infsamp.sampling.simulator import simulate
from infsamp.sampling.traces import TraceGroup, read_trace, synthetic_trace, write_trace


def write_lines(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = '{"prompt_id": "a", "prompt_tokens": 5, "lengths": [3, 4]}'


def test_read_trace_round_trip(tmp_path):
    groups = [TraceGroup("a", 5, [3, 4]), TraceGroup("b", 7, [1])]
    write_trace(groups, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == groups


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"prompt_id": "a", "lengths": [3]}', "missing field 'prompt_tokens'"),
    ('{"prompt_id": "a", "prompt_tokens": 5}', "missing field 'lengths'"),
    ('{"prompt_id": "a", "prompt_tokens": -1, "lengths": [3]}', "prompt_tokens must be"),
    ('{"prompt_id": "a", "prompt_tokens": 5, "lengths": []}', "lengths must be a non-empty list"),
    ('{"prompt_id": "a", "prompt_tokens": 5, "lengths": [3, -4]}',
     r"lengths\[1\] must be an integer >= 1, got -4"),
    ('{"prompt_id": "a", "prompt_tokens": 5, "lengths": [3.5]}', r"lengths\[0\] .* got 3.5"),
    ('{"prompt_id": "a", "prompt_tokens": 5, "lengths": ["3"]}', r"lengths\[0\]"),
    ('{"prompt_id": "a", "prompt_tokens": 5, "lengths": [true]}', r"lengths\[0\]"),
    ('{"prompt_id": null, "prompt_tokens": 5, "lengths": [3]}', "prompt_id must be"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, message):
    path = write_lines(tmp_path, [GOOD, "", bad])  # the blank line still counts
    with pytest.raises(DataError, match=rf"trace.jsonl:3: {message}"):
        read_trace(path)


def test_empty_or_missing_trace(tmp_path):
    with pytest.raises(DataError, match="empty"):
        read_trace(write_lines(tmp_path, [""]))
    with pytest.raises(DataError, match="cannot read"):
        read_trace(tmp_path / "nope.jsonl")


def test_synthetic_trace_is_the_length_controlled_workload():
    groups = synthetic_trace(50, 32, epochs=2, seed=3)
    assert len(groups) == 100 and groups[0].prompt_id == groups[50].prompt_id
    lengths = [x for g in groups for x in g.lengths]
    assert min(lengths) >= 16 and max(lengths) <= 1024
    assert 120 < sorted(lengths)[len(lengths) // 2] < 260  # median around 180
    assert synthetic_trace(5, 4, seed=3) == synthetic_trace(5, 4, seed=3)


def test_steps_group_consecutive_lines():
    groups = [TraceGroup("a", 5, [4, 1]), TraceGroup("b", 5, [1, 1]), TraceGroup("c", 5, [2])]
    result = simulate(groups, "continuous", micro_group=2, prompts_per_step=2)
    # step 1: slot 0 runs 4; slot 1 runs 1, 1, 1 -> 4 steps; step 2: 2 steps
    assert (result.num_calls, result.decode_steps, result.lower_bound) == (2, 6, 4 + 2)
    assert result.num_samples == 5 and result.generated_tokens == 9
    assert result.peak_kv_tokens_used == 5 + 5 + 3 + 1  # both prompts held at step 2 of step 1


def test_kv_budget_sets_the_slots():
    groups = synthetic_trace(2, 16, seed=0)
    result = simulate(groups, "continuous", kv_budget=160 + 4 * 1024, max_new_tokens=1024)
    assert result.micro_group == 4 and result.peak_kv_tokens_used <= 160 + 4 * 1024
    with pytest.raises(SamplingError, match="too small"):
        simulate(groups, "continuous", kv_budget=500, max_new_tokens=1024)
    with pytest.raises(SamplingError, match="--max-new-tokens"):
        simulate(groups, "continuous", micro_group=2, max_new_tokens=8)


def test_oracle_length_aware_near_the_lower_bound():
    for prompts_per_step in (1, 4):
        groups = synthetic_trace(8, 32, seed=1)
        result = simulate(groups, "length_aware", micro_group=8, predictor="oracle",
                          prompts_per_step=prompts_per_step)
        assert result.decode_steps <= 1.03 * result.lower_bound
        rounds = simulate(groups, "rounds", micro_group=8, prompts_per_step=prompts_per_step)
        assert result.decode_steps < 0.7 * rounds.decode_steps


def test_cli_json(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    code = main(["simulate", "--synthetic", "lognormal", "--groups", "4", "--num-generations", "16",
                 "--epochs", "2",
                 "--micro-group", "4", "--policy", "length_aware", "--predictor", "online",
                 "--json", "--prompts-per-step", "2", "--write-trace", str(trace)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(read_trace(trace)) == 8
    for key in ("decode_steps", "lower_bound", "peak_kv_tokens_used", "num_samples",
                "generated_tokens", "predictor_kendall_tau", "predictor_mae"):
        assert out[key] is not None, key
    assert out["num_samples"] == 128 and out["decode_steps"] >= out["lower_bound"]
    main(["simulate", "--trace", str(trace), "--micro-group", "4", "--json"])
    assert json.loads(capsys.readouterr().out)["generated_tokens"] == out["generated_tokens"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    path = write_lines(tmp_path, [GOOD, '{"prompt_id": "a"}'])
    assert main(["simulate", "--trace", str(path), "--micro-group", "2"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "trace.jsonl:2: missing field" in err
    assert main(["simulate", "--trace", str(write_lines(tmp_path, [GOOD])), "--policy",
                 "rounds"]) == 2
    assert "--micro-group or --kv-budget" in capsys.readouterr().err


def test_g_has_one_flag(tmp_path, capsys):
    """g is `--micro-group` only: its old alias `--slots` is an unknown flag (argparse's usage
    line and one error line)."""
    trace = write_lines(tmp_path, [GOOD])
    with pytest.raises(SystemExit) as exited:
        main(["simulate", "--trace", str(trace), "--slots", "2"])
    assert exited.value.code == 2
    assert "error: unrecognized arguments: --slots 2" in capsys.readouterr().err


def test_cli_replays_first_tokens_with_warmup_and_parking(tmp_path, capsys):
    """Guesses (token 5 first, 3 tokens) and derivations (token 9 first, 30 tokens) of one prompt:
    once the first call has taught the prefix memory, parking after k=2 tokens beats
    arrival order in the measured call; --no-preempt is arrival order again."""
    lengths = [3, 3, 30, 3, 30, 3, 30, 3]
    first = [[5, 6] if n == 3 else [9, 8] for n in lengths]
    line = json.dumps({"prompt_id": "a", "prompt_tokens": 4, "lengths": lengths,
                       "first_tokens": first})
    trace = write_lines(tmp_path, [line, line])
    runs = {}
    for name, flags in (("continuous", ["--policy", "continuous"]),
                        ("parking", ["--policy", "length_aware", "--predictor", "online"]),
                        ("no preempt", ["--policy", "length_aware", "--predictor", "online",
                                        "--no-preempt"])):
        assert main(["simulate", "--trace", str(trace), "--micro-group", "2", "--prefix-tokens",
                     "2", "--warmup-steps", "1", "--json", *flags]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["continuous"]["num_calls"] == 1 and runs["parking"]["num_preemptions"] > 0
    assert runs["parking"]["decode_steps"] < runs["continuous"]["decode_steps"]
    assert runs["no preempt"]["decode_steps"] == runs["continuous"]["decode_steps"]


@pytest.mark.parametrize("flags, message", [
    (["--predictor", "hidden"], "--predictor hidden needs the model's hidden states"),
    (["--warmup-steps", "1"], "--warmup-steps 1 leaves none of the trace's 1 steps"),
    (["--prefix-tokens", "0"], "--prefix-tokens must be between 1 and"),
])
def test_cli_new_flags_fail_in_one_line(tmp_path, capsys, flags, message):
    trace = write_lines(tmp_path, [GOOD])
    assert main(["simulate", "--trace", str(trace), "--micro-group", "2", "--policy",
                 "length_aware", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().count("\n") == 0


def test_cli_plot(tmp_path, capsys):
    png = tmp_path / "quality.png"
    code = main(["simulate", "--synthetic", "lognormal", "--groups", "3", "--num-generations", "8",
                 "--micro-group", "4", "--plot", str(png)])
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_arithmetic_stand_in_with_guesses_is_bimodal():
    from infsamp.sampling.traces import arithmetic_trace

    plain = arithmetic_trace(8, 16, seed=3)
    # the default draws nothing extra
    assert plain == arithmetic_trace(8, 16, seed=3, direct_share=0.0)
    mixed = arithmetic_trace(8, 16, seed=3, direct_share=0.5, sigma_sample=0.0)
    for group in mixed:
        short, long = min(group.lengths), max(group.lengths)
        assert 20 <= short <= 32 and long > 2 * short  # a guess is ~25 tokens, a derivation longer
    guesses = sum(length < 33 for group in mixed for length in group.lengths)
    assert 0.3 < guesses / (8 * 16) < 0.7


def test_simulate_cli_direct_share(capsys):
    code = main(["simulate", "--synthetic", "arithmetic", "--groups", "4", "--num-generations", "8",
                 "--direct-share", "0.5", "--micro-group", "4", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["num_samples"] == 32


def test_direct_share_out_of_range_is_one_line(capsys):
    code = main(["simulate", "--synthetic", "arithmetic", "--direct-share", "1.5",
                 "--micro-group", "2"])
    assert code == 2
    assert capsys.readouterr().err.strip() == ("infsamp simulate: error: --direct-share must be "
                                               "between 0 and 1, got 1.5")


@pytest.mark.parametrize("flag", ["-G", "--num-generations", "--sampling.num_generations"])
def test_train_takes_g_as_every_command_does(flag):
    """`infsamp train -G 32` is `--sampling.num_generations 32`, as `-G` is in simulate, sample,
    plan and bench."""
    from infsamp.cli import build_parser
    from infsamp.commands.train import config_overrides

    args = build_parser(["train"]).parse_args(["train", flag, "32"])
    assert config_overrides(args) == {"sampling.num_generations": "32"}
