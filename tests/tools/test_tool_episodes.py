"""Tool episodes end to end on the embedded tiny model (plain-text mode: the fallback format):
the sampler runs the calls and appends the template's answer tokens, the trainer trains with
tools (metrics, masks), resumes mid-run to the same weights, and an environment (TRL's
`environment_factory`) gives each episode its instance, its observation and its reward.

A random tiny model never writes a tool call, so these tests force the first turn of every
other sample to be one (a logits processor on the slot engine); the rest is sampled."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infsamp.config import DataConfig
from infsamp.config_algorithm import SamplingConfig
from infsamp.models.tiny import build_tokenizer
from infsamp.run.logs import read_jsonl
from infsamp.run.trainer import GRPOTrainer
from infsamp.sampling.sampler import GroupSampler
from infsamp.tasks.tool_format import ToolCall, answer_text
from infsamp.tools.episodes import Toolbox
from infsamp.tools.loading import load_tools

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = Path(__file__).resolve()
FUNCTIONS = str(HERE.with_name("tool_functions.py"))
EXAMPLES = HERE.parents[2] / "examples" / "tools"
ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class ForcedFirstTurn:
    """Even samples of a group write `text` then stop as their first turn; the rest samples."""

    def __init__(self, samples, text_ids: list[int], eos: int):
        self.samples, self.script = samples, [*text_ids, eos]

    def __call__(self, sample_ids, num_generated, scores):
        scores = scores.clone()
        for row, (sample_id, done) in enumerate(zip(sample_ids.tolist(),
                                                    num_generated.tolist())):
            sample = self.samples[sample_id]
            if sample.index_in_group % 2 == 0 and not sample.context_spans and \
                    done < len(self.script):
                scores[row] = float("-inf")
                scores[row, self.script[done]] = 0.0
        return scores


def forcing(tokenizer, text: str):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return lambda samples: ForcedFirstTurn(samples, ids, tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The embedded tokenizer on a random 2-layer Llama with room for the tools' prompt."""
    path = tmp_path_factory.mktemp("tiny_tools")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_sampler_runs_calls_and_appends_the_answer(tiny_dir):
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    data = DataConfig(use_chat_template="never")
    box = Toolbox(load_tools([f"{FUNCTIONS}:add"]), None, tokenizer, data,
                  [tokenizer.eos_token_id], timeout_s=5.0, max_workers=2)
    try:
        cfg = SamplingConfig(num_generations=4, micro_group=2, max_new_tokens=140,
                             kv_budget="100000", temperature=1.0, predictor="none", max_turns=1)
        prompt = tokenizer("What is 2 + 3?")["input_ids"]
        result = GroupSampler(model, tokenizer, cfg).sample(
            [prompt], 4, generator=torch.Generator().manual_seed(1), turns=box.episodes(),
            logits_processor_factory=forcing(tokenizer, ADD_CALL))
    finally:
        box.close()
    answer = tokenizer(answer_text(tokenizer, data, False, False, [ToolCall("add")], ["5"], []),
                       add_special_tokens=False)["input_ids"]
    called = [c for c in result.completions if c.index_in_group % 2 == 0]
    for c in called:
        (start, end), = c.context_spans
        assert c.token_ids[start:end] == answer[:end - start] and c.num_turns == 1
        assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(c.token_ids)
    assert box.counters.calls == len(called) and box.counters.errors == 0
    assert result.stats.context_tokens == sum(c.num_context_tokens for c in called) > 0


def tool_options(**extra):
    return {"tools.functions": [f"{FUNCTIONS}:add"], "tools.timeout_s": 5.0,
            "sampling.max_new_tokens": 140, "sampling.max_turns": 2,
            "data.use_chat_template": "never", "data.max_prompt_length": 1024, **extra}


@pytest.fixture
def forced_calls(monkeypatch):
    """Every sampler call of the run forces the even samples' first turn to be a call."""
    original = GroupSampler.sample

    def sample(self, *args, **kwargs):
        if kwargs.get("turns") is not None:
            kwargs.setdefault("logits_processor_factory", forcing(self.tokenizer, ADD_CALL))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GroupSampler, "sample", sample)


def tool_config(tiny_config, tiny_dir, **extra):
    return tiny_config(**{"model.name_or_path": str(tiny_dir), **tool_options(**extra)})


def test_a_run_with_a_tool_trains_and_resumes_to_the_same_weights(tiny_config, tiny_dir,
                                                                  tmp_path, forced_calls):
    """Tool metrics per step; checkpoint and --resume mid-run continue the same episodes."""
    sys.path.insert(0, str(HERE.parents[1] / "run"))
    from test_trainer import assert_resume_after_kill_matches

    options = {"model.name_or_path": str(tiny_dir), **tool_options()}
    assert_resume_after_kill_matches(tiny_config, tmp_path, **options)
    rows = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    for row in rows:
        assert row["tools/calls"] >= 2 and row["tools/errors"] == 0
        assert row["tools/turns_per_episode"] > 1 and row["sampling/context_tokens"] > 0
    evals = read_jsonl(tmp_path / "a" / "eval.jsonl")
    assert "eval/tools/calls_per_episode" in evals[0]


def test_a_run_with_a_tool_logs_its_metrics(tiny_config, tiny_dir, forced_calls):
    cfg = tool_config(tiny_config, tiny_dir, **{"training.max_steps": 1, "eval.num_problems": 0})
    trainer = GRPOTrainer(cfg)
    metrics = trainer.train_step()
    trainer.close()
    assert metrics["tools/calls"] == 2 * 2  # 2 prompts x the 2 even samples of G = 4
    assert metrics["tools/errors"] == 0 and metrics["tools/episodes_with_calls"] == 0.5
    assert metrics["tools/valid_call_share"] == 0.5  # each call answered without an error
    assert metrics["sampling/num_tool_turns"] == 4 and metrics["sampling/engine_idle_s"] >= 0


def test_a_bad_tool_reference_stops_the_run_before_the_model_loads(tiny_config, tiny_dir,
                                                                   tmp_path):
    from infsamp.errors import ToolError

    cfg = tool_config(tiny_config, tiny_dir, **{"tools.functions": [f"{FUNCTIONS}:nope"]})
    with pytest.raises(ToolError, match="has no function 'nope'"):
        GRPOTrainer(cfg)
    assert not (tmp_path / "run").exists()


def test_an_environment_gives_each_episode_its_instance_and_reward(tiny_config, tiny_dir,
                                                                   monkeypatch):
    original = GroupSampler.sample

    def sample(self, *args, **kwargs):
        call = '<tool_call>{"name": "guess", "arguments": {"number": 5}}</tool_call>'
        kwargs.setdefault("logits_processor_factory", forcing(self.tokenizer, call))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GroupSampler, "sample", sample)
    factory = f"{EXAMPLES}/guess_number.py:GuessNumber"
    cfg = tool_config(tiny_config, tiny_dir, **{
        "tools.functions": [], "tools.environment_factory": factory,
        "training.max_steps": 1, "eval.num_problems": 0})
    trainer = GRPOTrainer(cfg)
    assert trainer.rewards.names[-1] == "GuessNumber"
    prompts, turns = trainer.tools.episodes([{"prompt": "Find it.", "answer": "5"}],
                                            [[1, 2, 3]], 4)
    assert "call guess to find it" in trainer.tokenizer.decode(prompts[0])
    instances = trainer.tools.reward.instances
    assert len(instances) == 4 and len({id(i) for i in instances}) == 4  # one per episode
    metrics = trainer.train_step()
    trainer.close()
    assert metrics["tools/calls"] == 4 and metrics["tools/errors"] == 0
    assert "rewards/GuessNumber/mean" in metrics


def sample_one_call(model, tokenizer, box, name: str):
    """Two episodes of one prompt, each forced to call tool `name` once (max_turns 1): the
    sampler's result. The toolbox is closed after."""
    call = f'<tool_call>{{"name": "{name}", "arguments": {{"a": 1}}}}</tool_call>'
    try:
        cfg = SamplingConfig(num_generations=2, micro_group=2, max_new_tokens=160,
                             kv_budget="100000", temperature=1.0, predictor="none", max_turns=1)
        result = GroupSampler(model, tokenizer, cfg).sample(
            [tokenizer("Go.")["input_ids"]], 2, generator=torch.Generator().manual_seed(1),
            turns=box.episodes(), logits_processor_factory=forcing(tokenizer, call))
    finally:
        box.close()
    return result


@pytest.mark.parametrize("name, words", [
    ("fails", "ZeroDivisionError"), ("hangs", "longer than 0.5 s"), ("huge", "bytes of text"),
    ("not_text", "bytes"), ("nope", "Tool nope not found.")])
def test_a_failing_call_is_a_tool_error_and_the_episode_goes_on(tiny_dir, name, words):
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    data = DataConfig(use_chat_template="never")
    tools = load_tools([f"{FUNCTIONS}:{n}" for n in ("fails", "hangs", "huge", "not_text")])
    box = Toolbox(tools, None, tokenizer, data, [tokenizer.eos_token_id], timeout_s=0.5,
                  max_workers=2)
    called = sample_one_call(model, tokenizer, box, name).completions[0]
    (start, end), = called.context_spans
    answer = tokenizer.decode(called.token_ids[start:end])
    assert '{"error": ' in answer and words in answer
    assert box.counters.errors == box.counters.calls == 1
    assert called.finish_reason in ("eos", "length") and called.length > end  # it went on


def test_a_tool_that_returns_nothing_is_answered_and_traced(tiny_dir):
    """A tool returning "" is a normal answer (no tool error): the template's tool message with
    nothing inside, its tokens a context span, its turn and latency in the trace."""
    from infsamp.sampling.traces import group_turns

    tokenizer = build_tokenizer()
    model = LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    data = DataConfig(use_chat_template="never")
    box = Toolbox(load_tools([f"{FUNCTIONS}:empty"]), None, tokenizer, data,
                  [tokenizer.eos_token_id], timeout_s=0.0, max_workers=1)
    result = sample_one_call(model, tokenizer, box, "empty")
    called = result.completions[0]
    (start, end), = called.context_spans
    assert tokenizer.decode(called.token_ids[start:end]).strip() == \
        "<tool_response>\n\n</tool_response>"
    assert box.counters.calls == 1 and box.counters.errors == 0
    first, last = group_turns(result.groups[0])[0]
    assert first[:2] == [start, end - start] and first[2] >= 0 and last[1] == 0


def test_the_sample_command_runs_tools(tiny_dir, tmp_path, capsys, forced_calls):
    """`infsamp sample` with the trainer's tools.* settings: calls run, answers appended, the
    completions and the trace keep the turns; a bad tool reference is one line, exit 2."""
    import json

    from infsamp.cli import main

    prompts, recipe = tmp_path / "prompts.txt", tmp_path / "tools.yaml"
    prompts.write_text("What is 2 + 3?\n")
    recipe.write_text(json.dumps({"tools": {"functions": [f"{FUNCTIONS}:add"], "timeout_s": 5},
                                  "sampling": {"max_turns": 1, "predictor": "none"},
                                  "data": {"use_chat_template": "never",
                                           "max_prompt_length": 1024}}))
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.jsonl"
    flags = [str(recipe), "--model", str(tiny_dir), "--prompts", str(prompts), "-G", "4",
             "--max-new-tokens", "140", "--kv-budget", "100000", "--quiet"]
    assert main(["sample", *flags, "--out", str(out), "--trace", str(trace)]) == 0
    printed = capsys.readouterr().out
    assert "tool calls: 2 (0 errors)" in printed and "tool turns: 2" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    called = [r for r in rows if r.get("num_turns")]
    assert len(called) == 2 and all(len(r["tool_latencies_s"]) == 1 for r in called)
    for row in called:
        (start, end), = row["context_spans"]
        assert "<tool_response>\n5\n</tool_response>" in \
            build_tokenizer().decode(row["token_ids"][start:end])
    turns = json.loads(trace.read_text().splitlines()[0])["turns"]
    assert sum(len(episode) - 1 for episode in turns) == 2
    recipe.write_text(recipe.read_text().replace(":add", ":nope"))
    assert main(["sample", *flags]) == 2
    assert "has no function 'nope'" in capsys.readouterr().err
