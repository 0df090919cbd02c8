"""One run folder and one checkpoint for all the ranks of a launch (docs/distributed.md, "Logs
and checkpoints").

Run folder: rank 0 applies the rules of `run/folder.py` (new run, resume, damaged checkpoints),
holds the folder's lock for the run, and tells the others which checkpoint to resume, or its
error; they then verify and read it themselves (the run folder must be on a filesystem every rank
sees: one machine, or a shared one).

Checkpoint (`save_checkpoint`, the one save path, one process included): one folder written
atomically by rank 0 from the trainer's `TrainState`; with several ranks `training_state.json`
gains `distributed`, `ranks` (each rank's own sampler state) and `rank_costs`, and with FSDP each
rank adds its shard files (`ranks/rank-R-of-W.*`: `rank_shards.py`) before the manifest. The ranks
agree `NUM_AGREEMENTS` times, each time exchanging success or the error, so a failure on any rank
(a full disk) is one error on every rank and the previous checkpoint stays intact. DDP (and one
process) checkpoints resume on any number of ranks (rank r takes the sampler state of rank r mod
the saved number); FSDP shards need the same number of ranks.

Deliberately simple: every rank verifies the whole checkpoint it resumes (sha256 of every file).
"""

from __future__ import annotations

from pathlib import Path

from infsamp.config import Config
from infsamp.distributed.ranks import Ranks, agreed
from infsamp.errors import CheckpointError, InfsampError
from infsamp.run import checkpoint as ckpt
from infsamp.run.folder import prepare_run_folder
from infsamp.run.ownership import check_still_held
from infsamp.run.rank_shards import local_shards, write_shard
from infsamp.run.train_state import TrainState

NUM_AGREEMENTS = 3  # folder ready, shards written, folder complete


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


def save_checkpoint(state: TrainState, ranks: Ranks, strategy, tokenizer) -> Path:
    """checkpoint-<step> of the run, once per step (a signal right after a periodic save adds
    nothing), written by every rank together (one process: alone; see the module docstring)."""
    output_dir = Path(state.cfg.logging.output_dir)
    path, _ = ckpt.checkpoint_dirs(output_dir, state.step)
    if state.saved_step == state.step and ranks.broadcast_json(
            (path / ckpt.MANIFEST).is_file() if ranks.is_main else None):
        return path
    path = _save_together(state, ranks, strategy, tokenizer)
    state.saved_step = state.step
    return path


def _save_together(state: TrainState, ranks: Ranks, strategy, tokenizer) -> Path:
    output_dir = Path(state.cfg.logging.output_dir)
    parts = ranks.gather_json(state.rank_state_dict()) if ranks.distributed else None
    steps = _Agreements(ranks)
    with strategy.inference_model() as whole:  # FSDP: the whole weights, for model/
        shards = local_shards(state.model, state.optimizer) if strategy.shards_state else None
        if not ranks.is_main:
            return _follow(output_dir, state.step, steps, shards, ranks)
        saved = state.state_dict(optimizer=not strategy.shards_state)
        if ranks.distributed:
            saved.update(ranks=parts, rank_costs=state.rank_steps.state_dict(),
                         distributed={"strategy": strategy.name, "world_size": ranks.world_size})
        try:
            check_still_held(output_dir)  # never write nor prune in a folder replaced meanwhile
            path = ckpt.save_checkpoint(
                output_dir, state.step, model=whole, tokenizer=tokenizer, state=saved,
                keep_last=state.cfg.checkpointing.keep_last, keep_step=state.best.kept_step,
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
    steps.agree(write_shard(tmp, shards, ranks.rank, ranks.world_size))


def _follow(output_dir: Path, step: int, steps: _Agreements, shards, ranks: Ranks) -> Path:
    final, tmp = ckpt.checkpoint_dirs(output_dir, step)
    _write_together(tmp, steps, shards, ranks)  # while rank 0 writes the folder
    steps.agree(None)  # rank 0 renamed the folder (or says why not)
    return final
