"""What a checkpoint holds besides the weights, gathered from the trainer and put back on resume.

    training_state(trainer) -> {"run", "schedule", "optimizer", "scheduler", "rng", "generator",
                                "data", "eval_before", "last_eval", "counters", "best",
                                "predictor"}
    restore_training_state(trainer, checkpoint)   the inverse, weights included

Everything here is data (tensors, numbers, strings: `state_data.py` writes it); the counters are
the run's sizes (`RunSizes`, which the out-of-memory retries halve) and the skipped updates, so a
resumed run continues with the same g and micro-batch and logs the same rows. A checkpoint
written before the sizes had their own object (its counters name `micro_group`, `policy` and
`micro_batch_tokens`) resumes: its values are read into the sizes.

Deliberately simple: it reads and sets the trainer's attributes directly (one caller).
"""

from __future__ import annotations

from typing import Any

from infsamp.errors import CheckpointError
from infsamp.run.checkpoint import Checkpoint
from infsamp.run.identity import restore_predictor, restored_counters, run_identity
from infsamp.run.state_data import rng_state, set_rng_state


def training_state(trainer, optimizer: bool = True) -> dict[str, Any]:
    """`optimizer=False`: its state is sharded and saved per rank (FSDP: rank_checkpoint.py)."""
    predictor = trainer.sampler.predictor
    return {"run": run_identity(trainer.cfg, trainer.data_fingerprint), "schedule": trainer.horizon,
            "optimizer": trainer.optimizer.state_dict() if optimizer else None,
            "scheduler": trainer.scheduler.state_dict(),
            "rng": rng_state(), "generator": trainer.generator.get_state(),
            "data": trainer.stream.state_dict(), "eval_before": trainer.eval_before,
            "last_eval": [trainer._last_eval, trainer._last_eval_step],
            "counters": sampler_counters(trainer), "best": trainer.best.state_dict(),
            "predictor": predictor.state_dict() if predictor is not None else None}


def restore_training_state(trainer, found: Checkpoint) -> None:
    state = found.state
    if state["optimizer"] is None:  # FSDP: weights and optimizer state in the ranks' shards
        from infsamp.run.rank_checkpoint import load_shards

        load_shards(trainer.model, trainer.optimizer, found, trainer.ranks.rank,
                    trainer.ranks.world_size)
    else:
        load_weights(trainer.model, found, lora=trainer.cfg.model.lora_rank > 0)
        trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    trainer.generator.set_state(state["generator"])
    trainer.stream.load_state_dict(state["data"])
    trainer.step, trainer.eval_before = found.step, state["eval_before"]
    trainer._last_eval, trainer._last_eval_step = state["last_eval"]
    set_sampler_counters(trainer, restored_counters(trainer.cfg, found, state["counters"]))
    restore_predictor(trainer.sampler.predictor, state["predictor"], found)
    trainer.best.load_state_dict(state.get("best"))
    if "ranks" in state:  # written by several ranks: each takes its own sampler state
        from infsamp.run.rank_checkpoint import restore_rank_state

        restore_rank_state(trainer, found)


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


def sampler_counters(trainer) -> dict[str, Any]:
    """The run's sizes, the settings they were planned from (a resume that changes one plans
    afresh: `identity.restored_counters`) and the skipped updates."""
    sampling = trainer.cfg.sampling
    return {"sizes": trainer.sizes.state_dict(), "policy": sampling.policy,
            "micro_group": sampling.micro_group,
            "skipped_updates": trainer.grpo.num_skipped_updates}


def set_sampler_counters(trainer, counters: dict[str, Any]) -> None:
    trainer.sizes.load_state_dict(counters["sizes"] if "sizes" in counters
                                  else sizes_of_old_counters(trainer.sizes, counters))
    trainer.grpo.num_skipped_updates = counters["skipped_updates"]


def sizes_of_old_counters(planned, counters: dict[str, Any]) -> dict[str, Any]:
    """The sizes a checkpoint of before `RunSizes` held: its (halved) micro_group, 0 when no
    retry changed the configured one (then the planned g), and its micro-batch."""
    return {"micro_group": counters["micro_group"] or planned.micro_group,
            "train_micro_batch_tokens": counters["micro_batch_tokens"],
            "oom_retries": {"sampling": counters["sampling_oom_retries"],
                            "training": counters["train_oom_retries"]}}
