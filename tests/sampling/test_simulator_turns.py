"""Issue 35 item 3: traces record episodes with turns (per turn the model's tokens, the tool
answer's tokens, the tool's latency) and the simulator replays them through the sampler's own
turn loop: a multi-turn trace of the real sampler on the embedded model's architecture, with a
deterministic scripted tool, replays to the engine's decode steps under every policy."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from tiny_sampling import eos_boost

from infsamp.cli import main
from infsamp.config_algorithm import SamplingConfig
from infsamp.errors import DataError
from infsamp.models.tiny import build_model, build_tokenizer
from infsamp.sampling.length_predictor import OraclePredictor
from infsamp.sampling.sampler import GroupSampler
from infsamp.sampling.simulator import _call_samples, _call_turns, run_call, simulate
from infsamp.sampling.traces import TraceGroup, episode_turns, group_turns, read_trace, write_trace

pytestmark = pytest.mark.usefixtures("one_thread")
EOS = build_tokenizer().eos_token_id
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14]]
GROUP_SIZE, MAX_NEW = 5, 20


@pytest.fixture(scope="module")
def model():
    """The embedded model's architecture with random weights."""
    return build_model(build_tokenizer(), seed=0).eval()


EosBoost = eos_boost(EOS)

class AtOnceTool:
    """Every turn of two or more tokens is a tool call; its answer (its length depends on the
    episode so far) is there at the next step, as `TraceTurns` replays a zero latency."""

    def __init__(self):
        self.done = []

    def continues(self, sample):
        start = sample.context_spans[-1][1] if sample.context_spans else 0
        return sample.num_tokens - start >= 2

    def submit(self, sample):
        self.done.append((sample, [40 + i for i in range(1 + sum(sample.token_ids) % 4)]))

    def answered(self, timeout_s):
        ready, self.done = self.done, []
        return ready


class SlowTool(AtOnceTool):
    """The same answers, each from a thread after `delay_s`."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s, self.lock = delay_s, threading.Lock()

    def submit(self, sample):
        def run():
            time.sleep(self.delay_s)
            with self.lock:
                AtOnceTool.submit(self, sample)

        threading.Thread(target=run).start()

    def answered(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if self.done or time.monotonic() >= deadline:
                    return AtOnceTool.answered(self, 0)
            time.sleep(0.001)


def sample(model, policy, kv_budget, predictor=None, tool=None, **options):
    cfg = SamplingConfig(policy=policy, micro_group=3, kv_budget=kv_budget, max_new_tokens=MAX_NEW,
                         temperature=1.0, predictor="none", max_turns=3, **options)
    generator = torch.Generator().manual_seed(7)
    return GroupSampler(model, None, cfg, predictor).sample(
        PROMPTS, GROUP_SIZE, generator=generator, logits_processor_factory=EosBoost,
        turns=tool or AtOnceTool())


def trace_of(result, path) -> list[TraceGroup]:
    """The call as a trace with turns, written and read back."""
    groups = [TraceGroup(str(number), len(prompt), [c.length for c in group],
                         turns=group_turns(group))
              for number, (prompt, group) in enumerate(zip(PROMPTS, result.groups))]
    write_trace(groups, path)
    return read_trace(path)


TIGHT = "75"  # g = 3, too little room beside them to keep a waiting sample's KV
KEYS = ("decode_steps", "generated_tokens", "num_tool_turns", "context_tokens",
        "peak_kv_tokens_used", "num_preemptions", "recomputed_tokens", "row_steps", "lower_bound")


@pytest.mark.parametrize("policy, kv_budget, predictor, options", [
    ("continuous", "100000", None, {}),
    ("continuous", TIGHT, None, {}),
    ("rounds", "100000", None, {}),
    ("length_aware", "100000", "oracle", {}),
    ("probe", TIGHT, None, {"probe_tokens": 3})])
def test_multi_turn_trace_replays_to_the_engines_decode_steps(model, tmp_path, policy, kv_budget,
                                                              predictor, options):
    oracle = None
    if predictor == "oracle":  # told the lengths (episodes do not depend on the schedule)
        reference = sample(model, "continuous", kv_budget).completions
        oracle = OraclePredictor({i: c.length for i, c in enumerate(reference)})
    real = sample(model, policy, kv_budget, oracle, **options)
    assert real.stats.num_tool_turns > 0 and real.stats.context_tokens > 0
    groups = trace_of(real, tmp_path / "trace.jsonl")
    samples, lengths = _call_samples(groups, MAX_NEW)
    replay = run_call(samples, lengths, policy, real.stats.micro_group,
                      real.stats.kv_budget_tokens,
                      OraclePredictor() if predictor == "oracle" else None,
                      turns=_call_turns(groups), **options)
    for key in KEYS:
        assert getattr(replay, key) == getattr(real.stats, key), key
    # the context spans replay where the engine put them
    assert [s.context_spans for s in samples] == [c.context_spans for c in real.completions]
    if kv_budget == TIGHT:
        assert replay.recomputed_tokens > 0  # waiting samples' KV dropped, recomputed


def test_without_its_turns_the_trace_replays_other_decode_steps(model, tmp_path):
    """The same lengths as single-turn samples: the context tokens count as decode steps."""
    real = sample(model, "continuous", "100000")
    groups = trace_of(real, tmp_path / "trace.jsonl")
    samples, lengths = _call_samples(groups, MAX_NEW)
    single = run_call(samples, lengths, "continuous", real.stats.micro_group,
                      real.stats.kv_budget_tokens)
    assert single.decode_steps != real.stats.decode_steps
    assert single.generated_tokens == real.stats.generated_tokens + real.stats.context_tokens


def two_samples(latency_s: float) -> list[TraceGroup]:
    return [TraceGroup("p", 4, [5, 10], turns=[[[2, 1, latency_s], [2, 0, 0.0]],
                                              [[10, 0, 0.0]]])]


def test_tool_latency_waits_its_decode_steps():
    """g = 2: sample 0 calls a tool after 2 tokens (1 context token, then 2 more tokens), sample
    1 decodes 10. At zero latency sample 0 resumes at the next step (10 steps in all); 1 s at
    0.1 s per step answers before step 2 + 10 = 12: sample 1 ends at step 10, the engine idles
    (no decode steps) until the answer, then 2 more steps."""
    at_once = simulate(two_samples(1.0), "continuous", 2)
    assert (at_once.decode_steps, at_once.num_tool_turns, at_once.context_tokens) == (10, 1, 1)
    assert at_once.generated_tokens == 14
    slow = simulate(two_samples(1.0), "continuous", 2, step_seconds=0.1)
    assert slow.decode_steps == 12 and slow.generated_tokens == 14
    assert simulate(two_samples(0.5), "continuous", 2, step_seconds=0.1).decode_steps == 10


def test_episode_turns_from_context_spans():
    assert episode_turns(9, [(3, 5), (6, 7)], [0.25]) == [[3, 2, 0.25], [1, 1, 0.0], [2, 0, 0.0]]
    assert episode_turns(4, []) == [[4, 0, 0.0]]


@pytest.mark.parametrize("turns, message", [
    ([[[2, 1, 0.0]], [[10, 0, 0.0]]], "last turn has context"),
    ([[[2, 1, 0.0], [3, 0, 0.0]], [[10, 0, 0.0]]], "hold 6 tokens, its length is 5"),
    ([[[2, 1, -1.0], [2, 0, 0.0]], [[10, 0, 0.0]]], "a turn is"),
    ([[[0, 1, 0.0], [4, 0, 0.0]], [[10, 0, 0.0]]], "a turn is"),
    ([[[5, 0, 0.0]]], "one list of turns per length"),
])
def test_bad_turns_are_one_line_naming_the_line(tmp_path, turns, message):
    path = tmp_path / "trace.jsonl"
    write_trace([TraceGroup("p", 4, [5, 10], turns=turns)], path)
    with pytest.raises(DataError, match=message) as caught:
        read_trace(path)
    assert f"{path}:1" in str(caught.value)


def test_a_trace_without_turns_reads_and_replays_as_before(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace([TraceGroup("p", 4, [5, 10])], path)
    assert "turns" not in path.read_text() and read_trace(path)[0].turns is None
    assert simulate(read_trace(path), "continuous", 2).decode_steps == 10


def test_simulate_replays_turns_with_step_seconds(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    write_trace(two_samples(1.0), path)
    for step_seconds, steps in (("0", 10), ("0.1", 12)):
        assert main(["simulate", "--trace", str(path), "--micro-group", "2", "--json",
                     "--step-seconds", step_seconds]) == 0
        result = json.loads(capsys.readouterr().out)
        assert (result["decode_steps"], result["num_tool_turns"]) == (steps, 1)
    assert main(["simulate", "--trace", str(path), "--micro-group", "2",
                 "--step-seconds", "-1"]) == 2
    assert "--step-seconds must be >= 0" in capsys.readouterr().err


def test_the_trace_keeps_each_calls_latency(model, tmp_path):
    """A tool that answers after 20 ms: each traced tool turn holds a latency of at least that,
    the same episodes as at once (a replay at zero latency then takes the at-once engine's
    decode steps; at the recorded latencies the wall-clock schedule is not decode steps)."""
    slow = sample(model, "continuous", "100000", tool=SlowTool(0.02))
    groups = trace_of(slow, tmp_path / "trace.jsonl")
    calls = [turn for group in groups for episode in group.turns for turn in episode[:-1]]
    assert len(calls) == slow.stats.num_tool_turns > 0
    assert all(latency_s >= 0.02 for _, _, latency_s in calls)
    at_once = sample(model, "continuous", "100000")
    assert [c.token_ids for c in slow.completions] == [c.token_ids for c in at_once.completions]
    samples, lengths = _call_samples(groups, MAX_NEW)
    replay = run_call(samples, lengths, "continuous", at_once.stats.micro_group, 100000,
                      turns=_call_turns(groups))
    assert replay.decode_steps == at_once.stats.decode_steps


class EmptyTool(AtOnceTool):
    """Every call is answered with no tokens at all (a handler's empty answer)."""

    def submit(self, sample):
        self.done.append((sample, []))


def test_an_answer_without_tokens_is_traced_and_replays(model, tmp_path):
    """An empty answer is still a tool turn: an empty context span, its turn and latency in the
    trace ([model tokens, 0, latency]), and the replay takes the engine's decode steps."""
    real = sample(model, "continuous", "100000", tool=EmptyTool())
    called = [c for c in real.completions if c.num_turns]
    assert called and all(len(c.context_spans) == c.num_turns == len(c.tool_latencies_s)
                          and c.num_context_tokens == 0 for c in called)
    groups = trace_of(real, tmp_path / "trace.jsonl")
    tool_turns = [turn for group in groups for episode in group.turns for turn in episode[:-1]]
    assert len(tool_turns) == real.stats.num_tool_turns and all(t[1] == 0 for t in tool_turns)
    samples, lengths = _call_samples(groups, MAX_NEW)
    replay = run_call(samples, lengths, "continuous", real.stats.micro_group, 100000,
                      turns=_call_turns(groups))
    for key in KEYS:
        assert getattr(replay, key) == getattr(real.stats, key), key
