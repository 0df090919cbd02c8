"""A local sequence-classification model used as a reward function (TRL's `reward_funcs="path"`).

`rewards.functions: [path/to/reward_model]` names a directory that
`AutoModelForSequenceClassification` loads with `num_labels=1`. Each completion is scored on prompt
plus completion, tokenized by the reward model's own tokenizer: through its chat template when it
has one (the prompt as the user turn or the prompt's messages, the completion as the assistant
turn), else the prompt text followed by the completion text, without special tokens added (as
TRL). The score is the model's single logit. Texts are scored in right-padded batches whose padded
size stays under a token budget (the training micro-batch budget, packed by the same rule as the
training step: `planner/micro_batches.py`), on the run's device, without grad.

Deliberately simple: the model stays on the device for the whole run; texts longer than its
context are not truncated (the model decides); TRL applies the chat template only to
conversational prompts, here it is applied whenever the reward tokenizer has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from infsamp.errors import RewardError
from infsamp.models.source import load_error
from infsamp.planner.micro_batches import plan_micro_batches
from infsamp.rewards.builtin import completion_text

DEFAULT_MAX_TOKENS = 8192


def _messages(turn: Any, role: str) -> list[dict[str, Any]]:
    return [{"role": role, "content": turn}] if isinstance(turn, str) else list(turn)


class RewardModel:
    """Callable with the reward-function signature: `rm(prompts, completions, **kw) -> [float]`."""

    runs_in_process = True  # on the run's device, never in a reward worker process

    def __init__(self, model, tokenizer, *, device: torch.device | str = "cpu",
                 max_tokens: int = DEFAULT_MAX_TOKENS):
        self.model = model.to(device).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_tokens = max_tokens

    def text(self, prompt: Any, completion: Any) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            messages = _messages(prompt, "user") + _messages(completion, "assistant")
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return completion_text(prompt) + completion_text(completion)

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any],
                 **kwargs: Any) -> list[float]:
        ids = [self.tokenizer(self.text(p, c), add_special_tokens=False).input_ids
               for p, c in zip(prompts, completions)]
        scores = [0.0] * len(ids)
        for batch in plan_micro_batches([len(i) for i in ids], self.max_tokens):
            width = max(len(ids[i]) for i in batch)
            pad = self.tokenizer.pad_token_id
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [b, T]
            attention_mask = torch.zeros_like(input_ids)  # [b, T]
            for row, index in enumerate(batch):
                input_ids[row, : len(ids[index])] = torch.as_tensor(ids[index])
                attention_mask[row, : len(ids[index])] = 1
            logits = self.model(input_ids=input_ids.to(self.device),
                                attention_mask=attention_mask.to(self.device)).logits  # [b, 1]
            for row, index in enumerate(batch):
                scores[index] = float(logits[row, 0])
        return scores


def load_reward_model(path: str, *, device: torch.device | str = "cpu",
                      dtype: torch.dtype | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                      trust_remote_code: bool = False) -> RewardModel:
    """Load `path` as a 1-label sequence classifier with its tokenizer (one-line RewardError);
    the folder's own code runs only with `trust_remote_code` (`model.trust_remote_code`)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    where = f"rewards.functions {path!r}"
    if not (Path(path) / "config.json").exists():
        raise RewardError(f"{where}: a directory without config.json is not a reward model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a bad directory
        raise RewardError(str(load_error(where, "a sequence-classification reward model",
                                         err))) from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise RewardError(f"{where}: the reward model's tokenizer has no pad or eos token")
        tokenizer.pad_token = tokenizer.eos_token
    # the model pools at the last non-pad token
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    return RewardModel(model, tokenizer, device=device, max_tokens=max_tokens)
