"""Held-out evaluation: decode each problem once (greedy by default) and score it with the run's
reward functions.

Takes the prompts as token ids, the same ids the sampler gets for the same example
(`infsamp.tasks.prompts.encode_prompt`), and stops on the same tokens (`stop_token_ids`). Given the
run's sampler, `held_out_completions` decodes every problem as one completion of one sampler call
through the run's engine (`engine_completions`; docs/decoding.md); without one it runs
transformers `generate` in left-padded batches (`generate_completions`, the reference the tests
compare the engine with). Each completion is cut at its first stop token. The trainer scores them
with the run's own reward functions, as in training (`eval.reward` picks the one that says
"solved": `eval_reward_name`), and logs to eval.jsonl (`eval_metrics`):

    eval/accuracy             share of problems eval.reward scores >= eval.accuracy_threshold
    eval/reward               eval.reward's mean over the problems it scored
    eval/rewards/NAME/mean    each reward function's mean (TRL's names, with eval/)

`logs.problem_records` gives eval_completions.jsonl's rows (one per problem: completion, each
function's score, solved), so two evaluations can be compared problem by problem (McNemar).
`tally` gives the sums behind them as one list of numbers, so several ranks add theirs up
(`Ranks.sum`). `BestEvaluation` follows `checkpointing.keep_best`'s metric over the evaluations
after training began (each of those has a checkpoint; the base model's does not).

Deliberately simple: one completion per problem (pass@1), no self-consistency; a problem the chosen
function returns None for counts as unsolved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infsamp.options import ConfigError
from infsamp.rewards.builtin import ACCURACY_LIKE
from infsamp.rewards.compute import RewardResult

EVAL_METRICS = ("eval/accuracy", "eval/reward")
GENERATE_BATCH = 64  # prompts per `generate` call (generate_completions)


def left_padded(prompt_ids: Sequence[Sequence[int]],
                pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [B, T], prompts right-aligned."""
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)  # [B, T]
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
        mask[row, width - len(ids):] = 1
    return input_ids, mask


def until_stop(ids: Sequence[int], stop_token_ids: Sequence[int]) -> list[int]:
    """The completion before its first stop token (the whole of it when none occurs)."""
    stops = set(stop_token_ids)
    return next((list(ids[:i]) for i, token in enumerate(ids) if token in stops), list(ids))


@torch.no_grad()
def generate_completions(model, prompt_ids: Sequence[Sequence[int]], *, pad_token_id: int,
                         stop_token_ids: Sequence[int], max_new_tokens: int,
                         temperature: float = 0.0) -> list[list[int]]:
    """Each prompt's completion ids, cut before its first stop token."""
    device = next(model.parameters()).device
    completions: list[list[int]] = []
    for start in range(0, len(prompt_ids), GENERATE_BATCH):
        input_ids, mask = left_padded(prompt_ids[start: start + GENERATE_BATCH], pad_token_id)
        out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else None,
                             top_p=None, top_k=None,
                             pad_token_id=pad_token_id, eos_token_id=list(stop_token_ids) or None)
        new_tokens = out[:, input_ids.shape[1]:].tolist()  # [b, T_new]
        completions.extend(until_stop(row, stop_token_ids) for row in new_tokens)
    return completions


def engine_completions(sampler, prompt_ids: Sequence[Sequence[int]], *,
                       stop_token_ids: Sequence[int], max_new_tokens: int,
                       temperature: float = 0.0, turns=None) -> list[list[int]]:
    """Each prompt's completion ids, cut before its first stop token: one sampler call of one
    completion per prompt on the run's engine (greedy at temperature 0, as `generate`), their
    common prefix held once. With `turns` (tools) an episode holds the stop tokens of its tool
    turns: only its last goes."""
    groups = sampler.sample([list(p) for p in prompt_ids], 1, max_new_tokens=max_new_tokens,
                            temperature=temperature, generator=torch.Generator().manual_seed(0),
                            turns=turns, share_prefix=True, fill_budget=True).groups
    if turns is not None:
        return [list(g[0].token_ids[:-1] if g[0].finish_reason == "eos" else g[0].token_ids)
                for g in groups]
    return [until_stop(group[0].token_ids, stop_token_ids) for group in groups]


def held_out_completions(model, tokenizer, prompt_ids: Sequence[Sequence[int]], *,
                         stop_token_ids: Sequence[int], max_new_tokens: int = 256,
                         temperature: float = 0.0, sampler=None,
                         turns=None) -> tuple[list[list[int]], list[str]]:
    """(completion ids, their texts) of each prompt, decoded in eval mode (restored after):
    through `sampler`'s engine when given (with `turns`: tool episodes), else with
    `generate`."""
    if not prompt_ids:
        return [], []
    was_training = model.training
    model.eval()
    try:
        if sampler is not None:
            completions = engine_completions(sampler, prompt_ids, stop_token_ids=stop_token_ids,
                                             max_new_tokens=max_new_tokens,
                                             temperature=temperature, turns=turns)
        else:
            completions = generate_completions(
                model, prompt_ids, pad_token_id=tokenizer.pad_token_id,
                stop_token_ids=stop_token_ids, max_new_tokens=max_new_tokens,
                temperature=temperature)
    finally:
        model.train(was_training)
    return completions, tokenizer.batch_decode(completions, skip_special_tokens=True)


# ---------------------------------------------------------------- scoring with the run's rewards


def eval_reward_name(setting: str, names: Sequence[str]) -> str:
    """`eval.reward` resolved against the run's reward function names (ConfigError if absent)."""
    if setting == "auto":
        return next((name for name in names if name in ACCURACY_LIKE), names[0])
    if setting not in names:
        raise ConfigError(f"eval.reward: {setting!r} is not one of the run's reward functions "
                          f"({', '.join(names)})")
    return setting


def check_best_metric(metric: str, names: Sequence[str]) -> None:
    """`checkpointing.keep_best` names a metric evaluation logs (ConfigError if not)."""
    known = [*EVAL_METRICS, *(f"eval/rewards/{name}/mean" for name in names)]
    if metric and metric not in known:
        raise ConfigError(f"checkpointing.keep_best: {metric!r} is not logged by evaluation "
                          f"(it logs {', '.join(known)})")


def tally(result: RewardResult | None, names: Sequence[str], chosen: str,
          threshold: float) -> list[float]:
    """[solved, problems, then per function: sum of its scores, rows it scored] (zeros for none)."""
    if result is None:
        return [0.0] * (2 + 2 * len(names))
    chosen_values = result.per_function[chosen]
    sums = [float(sum(v >= threshold for v in chosen_values if not math.isnan(v))),
            float(len(chosen_values))]
    for name in names:
        scored = [v for v in result.per_function[name] if not math.isnan(v)]
        sums += [float(sum(scored)), float(len(scored))]
    return sums


def eval_metrics(sums: Sequence[float], names: Sequence[str], chosen: str) -> dict[str, float]:
    """eval.jsonl's scores from the `tally` of every rank added up."""
    means = {name: sums[2 + 2 * i] / sums[3 + 2 * i] if sums[3 + 2 * i] else math.nan
             for i, name in enumerate(names)}
    return {"eval/accuracy": sums[0] / sums[1] if sums[1] else math.nan,
            "eval/reward": means[chosen],
            **{f"eval/rewards/{name}/mean": mean for name, mean in means.items()}}


@dataclass
class BestEvaluation:
    """The best value of `checkpointing.keep_best`'s metric so far, and its step (higher is
    better; the earliest step wins a tie, as TRL's metric_for_best_model)."""

    metric: str  # '' when keep_best is off
    value: float | None = None
    step: int = -1

    def offer(self, step: int, metrics: dict[str, float]) -> bool:
        """True when the evaluation at `step` (> 0) sets a new best: it is to be checkpointed."""
        value = metrics.get(self.metric, math.nan) if self.metric else math.nan
        if step <= 0 or math.isnan(value) or (self.value is not None and value <= self.value):
            return False
        self.value, self.step = value, step
        return True

    @property
    def kept_step(self) -> int | None:
        """The checkpoint pruning keeps: the best evaluation's, once there is one."""
        return self.step if self.step > 0 else None

    def state_dict(self) -> dict:
        return {"metric": self.metric, "value": self.value, "step": self.step}

    def load_state_dict(self, state: dict | None) -> None:
        if state and state.get("metric") == self.metric:  # none in older checkpoints
            self.value, self.step = state["value"], state["step"]
