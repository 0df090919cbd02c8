"""One run folder and one checkpoint for all the ranks of a launch.

Run folder: rank 0 applies the rules of `run/folder.py` (new run, resume, damaged checkpoints),
holds the folder's lock for the run, and tells the others which checkpoint to resume, or its
error; they then verify and read it themselves (the run folder must be on a filesystem every rank
sees: one machine, or a shared one).

Checkpoint (`save_on_ranks`), still one folder written atomically by rank 0:

    checkpoint-N/
      model/, training_state.*     as in one process (rank 0; with FSDP `model/` is consolidated
                                   from the gathered weights, loadable by transformers)
      ranks/rank-R-of-W.json       FSDP only: rank R's shard of every parameter and of the
      ranks/rank-R-of-W.safetensors   optimizer state (safetensors + JSON, as training_state.*)
      manifest.json                every file above, written last

`training_state.json` gains `distributed` (strategy, number of ranks), `ranks` (each rank's own
sampler state: its length predictor and out-of-memory counters) and `rank_costs` (the assignment's
cost predictor). The ranks agree three times (folder ready, shards written, folder renamed), each
time exchanging success or the error, so a failure on any rank (a full disk) is one error on every
rank, the `.tmp` folder is removed and the previous checkpoint stays intact.

Resume: DDP (and one process) checkpoints resume on any number of ranks (rank r takes the sampler
state of rank r mod the saved number); FSDP shards need the same number of ranks.

Deliberately simple: every rank verifies the whole checkpoint it resumes (sha256 of every file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from infsamp.config import Config
from infsamp.distributed.ranks import Ranks, agreed
from infsamp.errors import CheckpointError, InfsampError
from infsamp.run import checkpoint as ckpt
from infsamp.run.folder import prepare_run_folder
from infsamp.run.progress import RunProgress
from infsamp.run.state_data import from_data, to_data

SHARDS_DIR = "ranks"
NUM_AGREEMENTS = 3  # folder ready, shards written, folder complete


class NullLogger:
    """What ranks other than 0 log: nothing (every RunLogger method is a no-op, no progress)."""

    def __init__(self) -> None:
        self.progress = RunProgress(0, 0, enabled=False)

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}"


# ---------------------------------------------------------------- the run folder


def prepare_run_folder_on_ranks(cfg: Config, ranks: Ranks) -> ckpt.Checkpoint | None:
    """Rank 0 decides (new run or which checkpoint); every rank gets the verified checkpoint."""
    def check(found: ckpt.Checkpoint) -> None:
        _check_launch(found, ranks)

    if not ranks.distributed:
        return prepare_run_folder(cfg, check)
    found: list[ckpt.Checkpoint | None] = [None]

    def on_main() -> str | None:
        found[0] = prepare_run_folder(cfg, check)
        return str(found[0].path) if found[0] is not None else None

    path = ranks.decide(on_main)
    if path is not None and not ranks.is_main:
        try:
            found[0] = ckpt.load_checkpoint(Path(path))
        except CheckpointError as err:
            raise CheckpointError(f"rank {ranks.rank}: {err}") from None
    return found[0]


def _check_launch(found: ckpt.Checkpoint, ranks: Ranks) -> None:
    saved = found.state.get("distributed") or {"strategy": "single", "world_size": 1}
    if saved["strategy"] == "fsdp" and (ranks.strategy, ranks.world_size) != \
            ("fsdp", saved["world_size"]):
        raise agreed(CheckpointError(
            f"{found.path.name} holds FSDP shards of {saved['world_size']} ranks; resume it "
            f"under the same launch (this one: {ranks.strategy} on {ranks.world_size}), or "
            f"start a new run from {found.path / ckpt.MODEL_DIR}"))


# ---------------------------------------------------------------- per-rank state


def rank_state(trainer) -> dict[str, Any]:
    """This rank's own part: its sampler's length predictor and out-of-memory counters (data)."""
    from infsamp.run.train_state import sampler_counters

    predictor = trainer.sampler.predictor
    tree, _ = to_data({"predictor": predictor.state_dict() if predictor is not None else None,
                       "counters": sampler_counters(trainer)})
    return tree


def restore_rank_state(trainer, found: ckpt.Checkpoint) -> None:
    """The per-rank parts of a multi-rank checkpoint (rank r takes entry r mod their number)."""
    from infsamp.run.identity import restore_predictor, restored_counters
    from infsamp.run.train_state import set_sampler_counters

    parts = found.state.get("ranks")
    if not parts:
        return
    own = from_data(parts[trainer.ranks.rank % len(parts)], {})
    set_sampler_counters(trainer, restored_counters(trainer.cfg, found, own["counters"]))
    restore_predictor(trainer.sampler.predictor, own["predictor"], found)
    trainer.rank_steps.load_state_dict(found.state.get("rank_costs"))


def local_shards(model: torch.nn.Module, optimizer) -> tuple[Any, dict[str, torch.Tensor]]:
    """This rank's shards of the parameters and the optimizer state, as (JSON tree, tensors)."""
    from torch.distributed.tensor import DTensor

    def local(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.to_local()
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(local(v) for v in value)
        return value

    weights = {name: p.to_local() for name, p in model.named_parameters()}
    return to_data({"weights": weights, "optimizer": local(optimizer.state_dict())}, "shard")


def load_shards(model: torch.nn.Module, optimizer, found: ckpt.Checkpoint, rank: int,
                world_size: int) -> None:
    """The inverse of `local_shards` from checkpoint-N/ranks/ (verified with the manifest)."""
    from torch.distributed.tensor import DTensor

    name = found.path / SHARDS_DIR / shard_name(rank, world_size)
    tensors = ckpt.read_tensors(name.with_suffix(".safetensors"))
    state = from_data(json.loads(name.with_suffix(".json").read_text()), tensors)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, shard in state["weights"].items():
            params[key].to_local().copy_(shard)
    order = [p for group in optimizer.param_groups for p in group["params"]]
    saved = state["optimizer"]
    for index, entry in saved["state"].items():
        param = order[int(index)]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == param.to_local().shape \
                    and key != "step":
                entry[key] = DTensor.from_local(value.to(param.device), param.device_mesh,
                                                param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())
    optimizer.load_state_dict(saved)


# ---------------------------------------------------------------- saving together


class _Agreements:
    """NUM_AGREEMENTS exchanges of (None or an error) that every rank makes whatever happens."""

    def __init__(self, ranks: Ranks):
        self.ranks, self.done = ranks, 0

    def agree(self, error: str | None) -> None:
        """Exchange; raise the first rank's error (on every rank) if any."""
        errors = self.ranks.gather_json(error)
        self.done += 1
        failed = next(((r, e) for r, e in enumerate(errors) if e), None)
        if failed is not None:
            self.finish(failed[1])
            rank, message = failed
            named = message.startswith("rank ") or self.ranks.world_size == 1
            who = "" if named else f"rank {rank}: "
            raise agreed(CheckpointError(who + message))

    def finish(self, error: str) -> None:
        while self.done < NUM_AGREEMENTS:
            self.ranks.gather_json(error)
            self.done += 1


def save_on_ranks(trainer) -> Path:
    """checkpoint-<step> written by every rank together (see the module docstring)."""
    from infsamp.run.train_state import training_state

    ranks, strategy = trainer.ranks, trainer.strategy
    parts = ranks.gather_json(rank_state(trainer))
    steps = _Agreements(ranks)
    with strategy.inference_model() as whole:  # FSDP: the whole weights, for model/
        shards = local_shards(trainer.model, trainer.optimizer) if strategy.shards_state else None
        if not ranks.is_main:
            return _follow(trainer, steps, shards)
        state = training_state(trainer, optimizer=not strategy.shards_state)
        state.update(ranks=parts, rank_costs=trainer.rank_steps.state_dict(),
                     distributed={"strategy": strategy.name, "world_size": ranks.world_size})
        try:
            path = ckpt.save_checkpoint(
                trainer.output_dir, trainer.step, model=whole, tokenizer=trainer.tokenizer,
                state=state, keep_last=trainer.cfg.checkpointing.keep_last,
                keep_step=trainer.best.kept_step,
                write_extra=lambda tmp: _write_together(tmp, steps, shards, ranks))
        except InfsampError as err:
            steps.finish(str(err))
            raise agreed(err)  # noqa: B904  (err itself, marked: a re-raise)
        except BaseException as err:
            steps.finish(f"{type(err).__name__}: {err}")
            raise
        steps.agree(None)
        return path


def _write_together(tmp: Path, steps: _Agreements, shards, ranks: Ranks) -> None:
    steps.agree(None)  # the folder exists
    steps.agree(_write_shard(tmp, shards, ranks))


def _follow(trainer, steps: _Agreements, shards) -> Path:
    final, tmp = ckpt.checkpoint_dirs(trainer.output_dir, trainer.step)
    steps.agree(None)
    steps.agree(_write_shard(tmp, shards, trainer.ranks))
    steps.agree(None)  # rank 0 renamed the folder (or says why not)
    return final


def _write_shard(tmp: Path, shards, ranks: Ranks) -> str | None:
    """This rank's shard files in tmp/ranks/ (fsynced); None, or why they could not be written."""
    if shards is None:
        return None
    from safetensors.torch import save_file

    tree, tensors = shards
    base = tmp / SHARDS_DIR / shard_name(ranks.rank, ranks.world_size)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(base.with_suffix(".safetensors")))
        base.with_suffix(".json").write_text(json.dumps(tree))
        for file in (base.with_suffix(".safetensors"), base.with_suffix(".json")):
            ckpt.fsync(file)
    except Exception as err:  # noqa: BLE001 - OSError or safetensors' own error
        why = getattr(err, "strerror", None) or err
        return f"rank {ranks.rank}: cannot write {base.name}: {why}"
    return None
