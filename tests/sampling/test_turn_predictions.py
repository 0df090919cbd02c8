"""Issue 35 item 3: the length predictor sees episodes with turns. It learns the model's tokens
(the decode work; a tool's answer is prefilled context), per turn; a sample resumed after a
tool's answer is predicted from what its prompt's episodes decoded from that turn on, and the
scheduler asks for that prediction as soon as the sample resumes. `infsamp simulate` replays a
multi-turn trace with the online predictor."""

from __future__ import annotations

import json

from infsamp.cli import main
from infsamp.sampling.length_predictor import OnlinePredictor
from infsamp.sampling.simulator import _call_samples, _call_turns, run_call
from infsamp.sampling.traces import TraceGroup, write_trace
from infsamp.sampling.turn_memory import TurnMemory, model_turn_lengths
from infsamp.sampling.types import Sample

MAX_NEW = 200


def episode(sample_id: int, turns: list[tuple[int, int]], finished: bool = True) -> Sample:
    """A sample whose tokens are its turns, (model tokens, the answer's tokens after them); the
    last turn of a finished episode has no answer after it."""
    sample = Sample(sample_id, 0, sample_id, 5, MAX_NEW, "p", "what is 123456 + 654321?")
    for number, (model_tokens, context_tokens) in enumerate(turns):
        sample.token_ids.extend([7] * model_tokens)
        if not finished or number < len(turns) - 1:
            sample.append_context([9] * context_tokens)
            sample.num_turns += 1
    return sample


def trained(episodes_per_call: list[list[tuple[int, int]]], calls: int = 4) -> OnlinePredictor:
    predictor = OnlinePredictor()
    for _ in range(calls):
        for sample_id, turns in enumerate(episodes_per_call):
            sample = episode(sample_id, turns)
            predictor.observe_finished(sample, sample.num_tokens)
        predictor.end_call()
    return predictor


def test_model_turn_lengths_leave_the_answers_out():
    assert model_turn_lengths(23, [(10, 15)]) == [10, 8]
    assert model_turn_lengths(12, [(4, 4), (6, 9)]) == [4, 2, 3]  # an empty answer is a turn
    assert model_turn_lengths(7, []) == [7]


def test_a_resumed_sample_is_predicted_from_its_prompts_later_turns():
    """The first turn's reasoning is 10 or 50 tokens, the turn after the calculator's answer 8:
    resumed after a 10-token first turn, 8 tokens are left (its total's countdown says ~23),
    and 5 once 3 of them are decoded."""
    predictor = trained([[(10, 5), (8, 0)], [(50, 5), (8, 0)]] * 8)
    resumed = episode(99, [(10, 5)], finished=False)
    assert abs(predictor.predict_remaining(resumed, resumed.token_ids) - 8) < 0.5
    resumed.token_ids.extend([7] * 3)
    assert abs(predictor.predict_remaining(resumed, resumed.token_ids) - 5) < 0.5


def test_the_predictor_learns_the_models_tokens_not_the_answers():
    """Episodes of 20 + 10 model tokens around a 30-token answer: a new sample of the prompt is
    predicted ~30 tokens of decode work, not 60."""
    predictor = trained([[(20, 30), (10, 0)]] * 16)
    assert abs(predictor.predict(episode(99, [], finished=False)) - 30) < 1.5


def test_the_turn_memory_falls_back_to_the_run_and_is_checkpointed():
    memory = TurnMemory()
    memory.add("p", [10, 8])
    assert memory.remaining("q", 1, 0) == 8  # another prompt: the run's memory
    assert memory.remaining("q", 2, 0) is None  # nobody reached a third turn
    assert memory.remaining("p", 1, 20) == 20  # outlived: as long again
    predictor = trained([[(10, 5), (8, 0)]] * 4)
    restored = OnlinePredictor()
    restored.load_state_dict(json.loads(json.dumps(predictor.state_dict())))
    resumed = episode(99, [(10, 5)], finished=False)
    assert restored.predict_remaining(resumed, resumed.token_ids) == \
        predictor.predict_remaining(resumed, resumed.token_ids)


class Spy(OnlinePredictor):
    """Records (tokens, answers) of every re-prediction."""

    def __init__(self):
        super().__init__()
        self.points: list[tuple[int, int]] = []

    def predict_remaining(self, spec, prefix_token_ids):
        self.points.append((len(prefix_token_ids), len(spec.context_spans)))
        return super().predict_remaining(spec, prefix_token_ids)


def multi_turn_groups() -> list[TraceGroup]:
    """Two prompts x 4 episodes: 3 model tokens, a 2-token answer, then 9 to 12 more."""
    return [TraceGroup(f"p{g}", 5, [3 + 2 + 9 + i for i in range(4)],
                       turns=[[[3, 2, 0.0], [9 + i, 0, 0.0]] for i in range(4)])
            for g in range(2)]


def test_the_scheduler_repredicts_a_sample_as_it_resumes():
    """The answer ends at token 5 (not a multiple of k = 8): the policy asks for the resumed
    sample's remaining turns right then."""
    groups = multi_turn_groups()
    samples, lengths = _call_samples(groups, 40)
    spy = Spy()
    stats = run_call(samples, lengths, "length_aware", 2, predictor=spy, turns=_call_turns(groups))
    assert stats.num_tool_turns == 8
    assert spy.points.count((5, 1)) == 8


def test_simulate_replays_a_multi_turn_trace_with_the_online_predictor(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    write_trace(multi_turn_groups() * 3, path)
    for policy in ("length_aware", "probe"):
        assert main(["simulate", "--trace", str(path), "--policy", policy, "--predictor",
                     "online", "--micro-group", "2", "--kv-budget", "400", "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["num_tool_turns"] == 24 and result["generated_tokens"] == 3 * (8 * 3 + 84)


def test_hidden_defers_to_the_turn_memory_past_an_answer():
    """Its probe, trained at 8 tokens on the same episodes, would not know the turn after the
    answer (the hidden state at hand predates it): the turn memory's 8 tokens."""
    import numpy as np

    from infsamp.sampling.hidden_predictor import HiddenPredictor

    predictor = HiddenPredictor()
    for _ in range(4):
        for sample_id, first_turn in enumerate([10, 50] * 8):
            sample = episode(sample_id, [(first_turn, 5), (8, 0)])
            sample.hidden_state = np.full(8, 1.0 + sample_id % 2)
            predictor.predict_remaining(sample, sample.token_ids[:8])
            predictor.observe_finished(sample, sample.num_tokens)
        predictor.end_call()
    resumed = episode(99, [(10, 5)], finished=False)
    resumed.hidden_state = np.full(8, 1.0)
    assert abs(predictor.predict_remaining(resumed, resumed.token_ids) - 8) < 0.5
