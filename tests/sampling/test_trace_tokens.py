"""Traces with each completion's first tokens: written by the trainer and `infsamp sample`, read
with or without them, and decoded by the replay so a token-conditioned predictor sees them."""

import json

import pytest

from infsamp.errors import DataError
from infsamp.run.logs import read_jsonl
from infsamp.sampling.length_predictor import OnlinePredictor
from infsamp.sampling.simulator import simulate
from infsamp.sampling.traces import TraceGroup, read_trace, write_trace


def test_first_tokens_round_trip_and_traces_without_them_still_read(tmp_path):
    groups = [TraceGroup("a", 5, [3, 4], first_tokens=[[7, 8], [9, 9, 9]]),
              TraceGroup("b", 7, [1])]
    write_trace(groups, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == groups
    assert "first_tokens" not in json.loads((tmp_path / "t.jsonl").read_text().splitlines()[1])


@pytest.mark.parametrize("first, message", [
    ([[1]], "first_tokens must hold one list of token ids per length \\(2\\)"),
    ([[1], "x"], "first_tokens\\[1\\] must be a list of token ids"),
    ([[1], [-1]], "first_tokens\\[1\\] must be a list of token ids"),
    ([[1, 2, 3, 4], [1]], "first_tokens\\[0\\] has 4 ids, more than its length 3"),
])
def test_bad_first_tokens_name_the_line(tmp_path, first, message):
    line = {"prompt_id": "a", "prompt_tokens": 5, "lengths": [3, 4], "first_tokens": first}
    (tmp_path / "t.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(DataError, match=f"t.jsonl:1: {message}"):
        read_trace(tmp_path / "t.jsonl")


def test_the_replay_feeds_the_traced_tokens_to_a_token_conditioned_predictor(monkeypatch):
    seen = []
    original = OnlinePredictor.predict_remaining

    def spy(self, spec, prefix_token_ids):
        seen.append(list(prefix_token_ids))
        return original(self, spec, prefix_token_ids)

    monkeypatch.setattr(OnlinePredictor, "predict_remaining", spy)
    groups = [TraceGroup("a", 5, [6, 8], first_tokens=[[11, 12, 13], [21, 22, 23]])]
    simulate(groups, "length_aware", micro_group=1, predictor="online", prefix_tokens=3)
    assert [11, 12, 13] in seen and [21, 22, 23] in seen


def test_a_run_trace_keeps_each_completions_first_tokens(tiny_config, tmp_path):
    from infsamp.commands.sample import write_lengths_trace
    from infsamp.run.trainer import GRPOTrainer

    cfg = tiny_config(**{"training.max_steps": 1, "sampling.predictor_prefix_tokens": 5,
                         "eval.num_problems": 0})
    trainer = GRPOTrainer(cfg)
    trainer.train()
    lines = read_jsonl(tmp_path / "run" / "lengths.jsonl")
    assert len(lines) == 2
    for line in lines:
        assert [len(ids) for ids in line["first_tokens"]] == [min(5, n) for n in line["lengths"]]
    groups = read_trace(tmp_path / "run" / "lengths.jsonl")
    assert groups[0].first_tokens == lines[0]["first_tokens"]
    result = trainer.sampler.sample([[5, 6, 7]], 2)
    write_lengths_trace(str(tmp_path / "sample.jsonl"), ["p"], [[5, 6, 7]], result, 4)
    [group] = read_trace(tmp_path / "sample.jsonl")
    assert group.first_tokens == [c.token_ids[:4] for c in result.groups[0]]
