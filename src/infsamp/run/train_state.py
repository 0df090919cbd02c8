"""The trainer's resumable state: one object, written into a checkpoint and read back from it.

    TrainState.state_dict() -> {"run", "schedule", "optimizer", "scheduler", "rng", "generator",
                                "data", "eval_before", "last_eval", "counters", "best",
                                "predictor"}
    TrainState.load_state_dict(checkpoint)     the inverse, weights included
    TrainState.rank_state_dict()               this rank's own part (several ranks)

The trainer builds it once at start-up and changes only its fields (`step`, the last evaluation,
the step last saved); the objects it holds change themselves. Everything written is data
(tensors, numbers, strings: `state_data.py` writes it); the counters are the run's sizes
(`RunSizes`, which the out-of-memory retries halve) and the skipped updates, so a resumed run
continues with the same g and micro-batch and logs the same rows.

Deliberately simple: the on-disk layout is the one checkpoints have always had (flat keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from infsamp.config import Config
from infsamp.errors import CheckpointError
from infsamp.run.checkpoint import Checkpoint
from infsamp.run.identity import restore_predictor, restored_counters, run_identity
from infsamp.run.rank_shards import load_shards
from infsamp.run.state_data import from_data, rng_state, set_rng_state, to_data

if TYPE_CHECKING:
    from infsamp.algorithm.grpo_step import GRPOStep
    from infsamp.distributed.rank_step import RankSteps
    from infsamp.planner.sizes import RunSizes
    from infsamp.run.evaluation import BestEvaluation
    from infsamp.run.prompt_stream import PromptStream
    from infsamp.sampling.length_predictor import LengthPredictor


@dataclass
class TrainState:
    """What a resume puts back; `step` counts the optimizer steps taken."""

    cfg: Config
    data_fingerprint: dict[str, Any]
    horizon: int  # the learning-rate schedule's length, kept from the run's first start
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator
    stream: PromptStream
    best: BestEvaluation
    sizes: RunSizes
    grpo: GRPOStep  # its skipped updates
    predictor: LengthPredictor | None  # the length_aware policy's predictor
    rank_steps: RankSteps  # the assignment's cost predictor
    rank: int = 0
    world_size: int = 1
    step: int = 0
    eval_before: float | None = None
    last_eval: float | None = None
    last_eval_step: int = -1
    saved_step: int = -1  # the step of the newest checkpoint this run wrote or resumed

    def state_dict(self, optimizer: bool = True) -> dict[str, Any]:
        """`optimizer=False`: its state is sharded and saved per rank (FSDP: rank_shards.py)."""
        predictor = self.predictor
        return {"run": run_identity(self.cfg, self.data_fingerprint), "schedule": self.horizon,
                "optimizer": self.optimizer.state_dict() if optimizer else None,
                "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(), "generator": self.generator.get_state(),
                "data": self.stream.state_dict(), "eval_before": self.eval_before,
                "last_eval": [self.last_eval, self.last_eval_step],
                "counters": sampler_counters(self), "best": self.best.state_dict(),
                "predictor": predictor.state_dict() if predictor is not None else None}

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own part: its length predictor and out-of-memory counters (data)."""
        predictor = self.predictor
        tree, _ = to_data({"predictor": predictor.state_dict() if predictor is not None else None,
                           "counters": sampler_counters(self)})
        return tree

    def load_state_dict(self, found: Checkpoint) -> None:
        state = found.state
        if state["optimizer"] is None:  # FSDP: weights and optimizer state in the ranks' shards
            load_shards(self.model, self.optimizer, found, self.rank, self.world_size)
        else:
            load_weights(self.model, found, lora=self.cfg.model.lora_rank > 0)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.generator.set_state(state["generator"])
        self.stream.load_state_dict(state["data"])
        self.step, self.eval_before = found.step, state["eval_before"]
        self.last_eval, self.last_eval_step = state["last_eval"]
        self._load_sampler_state(found, state["counters"], state["predictor"])
        self.best.load_state_dict(state.get("best"))
        if state.get("ranks"):  # written by several ranks: each takes its own sampler state
            own = from_data(state["ranks"][self.rank % len(state["ranks"])], {})
            self._load_sampler_state(found, own["counters"], own["predictor"])
            self.rank_steps.load_state_dict(state.get("rank_costs"))
        self.saved_step = self.step

    def _load_sampler_state(self, found: Checkpoint, counters: dict[str, Any],
                            predictor: dict | None) -> None:
        counters = restored_counters(self.cfg, found, counters)
        self.sizes.load_state_dict(counters["sizes"])
        self.grpo.num_skipped_updates = counters["skipped_updates"]
        restore_predictor(self.predictor, predictor, found)


def load_weights(model, found: Checkpoint, lora: bool) -> None:
    """The checkpoint's weights (or LoRA adapters) into `model`; every tensor must fit a place."""
    if lora:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, found.model_tensors)
        unexpected = list(getattr(result, "unexpected_keys", []))
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    else:
        missing, unexpected = model.load_state_dict(found.model_tensors, strict=False)
        missing = [m for m in missing if "lm_head" not in m]  # tied to the embedding
        model.tie_weights()
    if unexpected or missing:
        first, more = (unexpected or missing)[0], len(unexpected) + len(missing) - 1
        raise CheckpointError(f"{found.path}: weights do not match the model ({first!r} and "
                              f"{more} more)")


def sampler_counters(state: TrainState) -> dict[str, Any]:
    """The run's sizes, the settings they were planned from (a resume that changes one plans
    afresh: `identity.restored_counters`) and the skipped updates."""
    sampling = state.cfg.sampling
    return {"sizes": state.sizes.state_dict(), "policy": sampling.policy,
            "micro_group": sampling.micro_group,
            "skipped_updates": state.grpo.num_skipped_updates}
