"""What defines a run: recorded in every checkpoint, compared when the run resumes.

A checkpoint's `training_state.json` holds `run`:

    settings   every setting that changes what the run computes (`RUN_SETTINGS`, resolved: the
               precision mode, the reward weights, the clip range, LoRA's rank and targets,
               dynamic sampling's cap, chunk, replacement limit and budget when it is on: they
               change the prompt stream), and the learning-rate schedule's (`schedule`, checked
               with its horizon below)
    data       sha256 of the training rows and of the evaluation rows as encoded (token ids and
               each example's columns), and their counts
    config     the data settings (named when the rows differ) and the sampling policy, predictor
               and micro group (free to change: a resume needs to know whether they did)

A resume that changes a setting or the rows ends in one line naming each change and the way out
(a new run from `checkpoint-N/model`); everything else may change (docs/reliability.md, "A resume
continues the same run"). The settings are compared before anything loads; the rows once the
data is encoded, before the weights load and before the run's logs are rewound.

Deliberately simple: a reward function is identified by its name or `file.py:function` as
configured, not by its code; a model by its configured name or path, not by a weights hash.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from infsamp.algorithm.optim import schedule_horizon
from infsamp.choices import LR_SCHEDULERS
from infsamp.config import Config
from infsamp.config_io import flatten
from infsamp.distributed.ranks import agreed
from infsamp.errors import CheckpointError
from infsamp.planner.precisions import resolve_precision_name
from infsamp.run import checkpoint as ckpt
from infsamp.run.dynamic_sampling import max_replaced_prompts

RUN_SETTINGS = (
    "model.name_or_path", "model.lora_rank", "model.load_in_4bit",
    "rewards.functions", "rewards.weights", "rewards.format_think_block",
    "rewards.answer_extraction",
    "sampling.num_generations", "sampling.temperature", "sampling.top_p", "sampling.top_k",
    "sampling.max_new_tokens", "sampling.max_turns", "sampling.dynamic",
    "tools.functions", "tools.environment_factory",
    "training.prompts_per_step", "training.seed", "training.loss_type", "training.epsilon",
    "training.epsilon_high", "training.beta", "training.scale_rewards", "training.num_iterations",
    "training.mask_truncated_completions", "training.top_entropy_quantile",
    "training.max_grad_norm", "training.optimizer", "training.weight_decay",
    "training.adam_beta1", "training.adam_beta2", "training.precision",
    "eval.temperature", "eval.max_new_tokens",
)
LORA_SETTINGS = ("model.lora_target_modules", "model.lora_alpha", "model.lora_dropout")
# sampling.dynamic's own, resolved, recorded when it is on: they decide which prompts the stream
# hands out (replacements) and which completions a step trains on
DYNAMIC_SETTINGS = ("sampling.max_num_generations", "sampling.dynamic_chunk",
                    "sampling.max_replaced_prompts", "training.completions_per_step")
SCHEDULE_SETTINGS = ("lr_scheduler", "learning_rate", "warmup_ratio")  # training.<key>
DATA_SETTINGS = ("data.dataset", "data.dataset_config", "data.train_split", "data.eval_split",
                 "data.prompt_column", "data.answer_column", "data.answer_parser",
                 "data.system_prompt", "data.use_chat_template", "data.chat_template_kwargs",
                 "data.num_train_examples", "data.num_eval_examples", "data.max_prompt_length",
                 "data.seed", "data.eval_fraction", "data.answer_instruction", "eval.num_problems",
                 "model.name_or_path")
SAMPLER_SETTINGS = ("sampling.policy", "sampling.predictor", "sampling.micro_group")


# ---------------------------------------------------------------- what a checkpoint records


def run_identity(cfg: Config, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """`run` in training_state.json (see the module docstring); the first keys are the ones
    checkpoints have always recorded."""
    model, flat = cfg.model, flatten(cfg.to_dict())
    settings = run_settings(cfg)
    return {"model": model.name_or_path, "weights": "lora" if model.lora_rank > 0 else "full",
            "lora_rank": model.lora_rank, "lora_target_modules": list(model.lora_target_modules),
            "precision": settings["training.precision"], "settings": settings, "data": data,
            "config": {key: flat[key] for key in DATA_SETTINGS + SAMPLER_SETTINGS}}


def run_settings(cfg: Config) -> dict[str, Any]:
    """The settings that define the run, resolved, by dotted name."""
    from infsamp.models.device import resolve_device

    flat = flatten(cfg.to_dict())
    settings = {key: flat[key] for key in RUN_SETTINGS}
    settings["rewards.weights"] = cfg.rewards.weights or [1.0] * len(cfg.rewards.functions)
    settings["training.precision"] = resolve_precision_name(
        cfg.training.precision, resolve_device(cfg.model.device).type)
    if cfg.model.lora_rank > 0:
        settings.update({key: flat[key] for key in LORA_SETTINGS})
    if cfg.sampling.dynamic:  # as the run uses them (0 and -1 resolved to what they stand for)
        sampling, training = cfg.sampling, cfg.training
        settings.update(zip(DYNAMIC_SETTINGS, (sampling.generations_cap, sampling.chunk_generations,
                                               max_replaced_prompts(sampling, training),
                                               training.completions_per_step)))
    settings.update({f"training.{key}": value for key, value in
                     schedule_horizon(cfg.training).items() if key in SCHEDULE_SETTINGS})
    return settings


def data_fingerprint(train, held_out) -> dict[str, Any]:
    """sha256 of each split's encoded rows (token ids and columns) and their counts."""
    def digest(split) -> str:
        rows = [[p.index, p.token_ids, p.example] for p in split.prompts]
        return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()

    return {"train": digest(train), "eval": digest(held_out), "num_train": len(train.prompts),
            "num_eval": len(held_out.prompts)}


def saved_settings(found: ckpt.Checkpoint) -> dict[str, Any]:
    """The checkpoint's settings; for one written before they were recorded, what it has."""
    run, schedule = found.state.get("run", {}), found.state["schedule"]
    if "settings" in run:
        return run["settings"]
    saved = {"model.name_or_path": run.get("model"), "model.lora_rank": run.get("lora_rank"),
             **{f"training.{key}": schedule[key] for key in SCHEDULE_SETTINGS}}
    if run.get("precision") is not None:
        saved["training.precision"] = run["precision"]
    if run.get("weights") == "lora":
        saved["model.lora_target_modules"] = run.get("lora_target_modules")
    return saved


def saved_config(found: ckpt.Checkpoint) -> dict[str, Any] | None:
    """The checkpoint's `config` record, by dotted key (None: written before it was kept)."""
    return found.state.get("run", {}).get("config")


# ---------------------------------------------------------------- the checks


def check_resume(cfg: Config, found: ckpt.Checkpoint) -> None:
    """Before anything loads: one line naming every setting this resume changes."""
    saved, wanted = saved_settings(found), run_settings(cfg)
    changed = [key for key in wanted if key in saved and saved[key] != wanted[key]]
    if changed:
        listed = ", ".join(f"{key} {_show(saved[key])} (this run: {_show(wanted[key])})"
                           for key in changed)
        raise CheckpointError(f"{found.path.name} was trained with {listed}; a resume continues "
                              f"the same run: resume with its settings, or {_new_run(found)}")
    unchecked = [key for key in wanted if key not in saved]
    if unchecked:
        rows = " nor its data rows" if found.state.get("run", {}).get("data") is None else ""
        print(f"{found.path.name} was written by an older infsamp: it does not record "
              f"{len(unchecked)} of the settings that define a run ({unchecked[0]}, ...)"
              f"{rows}; they are not checked", file=sys.stderr)
    check_schedule(cfg, found)


def check_data(found: ckpt.Checkpoint | None, cfg: Config, fingerprint: dict[str, Any]) -> None:
    """Once the data is encoded: the rows are the ones the checkpoint was trained on."""
    saved = found.state.get("run", {}).get("data") if found is not None else None
    if saved is None or saved == fingerprint:
        return
    parts = [f"{name} rows ({saved[f'num_{key}']} then, {fingerprint[f'num_{key}']} now)"
             for key, name in (("train", "training"), ("eval", "evaluation"))
             if saved[key] != fingerprint[key]]
    then, now = saved_config(found) or {}, flatten(cfg.to_dict())
    changed = [f"{key} {_show(then[key])} (this run: {_show(now[key])})"
               for key in DATA_SETTINGS if key in then and then[key] != now[key]]
    why = ", ".join(changed) if changed else "with the same data settings: the data's files " \
        "changed"
    raise agreed(CheckpointError(
        f"{found.path.name} was trained on other {' and '.join(parts)}: {why}; a resume continues "
        f"the same run on the same rows: resume with its data, or {_new_run(found)}"))


def check_schedule(cfg: Config, found: ckpt.Checkpoint) -> None:
    """The schedule belongs to the run: a resume rebuilds it from the checkpoint's horizon. Past
    that horizon a constant (or inverse-sqrt) schedule simply continues; a decaying one would start
    over (transformers' cosine rises again) or stay at 0, so extending it is refused."""
    saved, name, max_steps = found.state["schedule"], found.path.name, cfg.training.max_steps
    if found.step > max_steps:
        raise CheckpointError(f"{name} is at step {found.step}, past training.max_steps "
                              f"{max_steps}")
    if max_steps <= saved["num_training_steps"]:
        return
    if LR_SCHEDULERS[saved["lr_scheduler"]]:
        raise CheckpointError(
            f"training.max_steps {max_steps}: this run's {saved['lr_scheduler']} schedule was "
            f"built for {saved['num_training_steps']} steps and cannot be extended (it would "
            f"restart); {_new_run(found)}, or use a constant schedule")
    print(f"extending the run from {saved['num_training_steps']} to {max_steps} steps: the "
          f"{saved['lr_scheduler']} schedule continues as started")


# ---------------------------------------------------------------- the sampler's saved state


def restored_counters(cfg: Config, found: ckpt.Checkpoint, counters: dict[str, Any]):
    """The sampler's saved counters, except where this resume configures its own sampling policy
    or micro group (free to change): an out-of-memory retry's changes are kept only while the
    setting it changed is still the one the run was started with."""
    then = saved_config(found) or {"sampling.policy": counters["policy"],
                                   "sampling.micro_group": counters["micro_group"]}
    kept = dict(counters)
    for key, name in (("sampling.policy", "policy"), ("sampling.micro_group", "micro_group")):
        now = getattr(cfg.sampling, key.split(".")[1])
        if then.get(key) != now:
            kept[name] = now
            kept["sizes"] = {**kept["sizes"], "micro_group": 0}  # g as planned now
    return kept


def restore_predictor(predictor, state: dict | None, found: ckpt.Checkpoint) -> None:
    """The length predictor's learned state, when the checkpoint's run used the same one (under a
    policy that takes one: it learnt from the same completions); another predictor, or a policy
    without one, starts it fresh."""
    from infsamp.sampling.policies import uses_predictor

    if predictor is None or state is None:
        return
    then = saved_config(found)
    if then is not None and (not uses_predictor(then["sampling.policy"])
                             or then["sampling.predictor"] != predictor.name):
        return
    try:
        predictor.load_state_dict(state)
    except (KeyError, TypeError, ValueError):  # an older checkpoint's other predictor
        print(f"{found.path.name}: its length predictor state does not fit "
              f"sampling.predictor {predictor.name}: it starts fresh", file=sys.stderr)


def _new_run(found: ckpt.Checkpoint) -> str:
    return f"start a new run from {found.path / ckpt.MODEL_DIR} (model.name_or_path)"


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "[]"
    return repr(value) if isinstance(value, str) and not value else str(value)
