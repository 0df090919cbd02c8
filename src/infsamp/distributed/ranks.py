"""The processes of a data-parallel run: who am I, what the launch asked for, the few collectives.

    torchrun --nproc-per-node N -m infsamp train CONFIG             # or, with a config file:
    accelerate launch --config_file examples/accelerate/ddp.yaml -m infsamp train CONFIG

`init_ranks(cfg)` (which also checks that every rank was given the same settings: `one_config.py`)
reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT; accelerate's ACCELERATE_USE_FSDP, FSDP_* and ACCELERATE_MIXED_PRECISION) and returns
`Ranks`: one process (every collective is the identity) or `ProcessRanks` over a torch.distributed
process group (gloo on CPU; NCCL for CUDA tensors plus gloo for the small CPU messages on GPU). The
trainer's collectives are few and small: JSON values gathered or broadcast as bytes (no pickles
cross the wire either), sums and maxima of a handful of floats, a barrier.

Failures: `guard()` wraps the trainer. An exception on one rank is posted to the rendezvous store
before the process exits, and `RankWatch` (rank_watch.py) on every other rank stops that process
within about a second with one line naming the failed rank, instead of leaving it in a collective.
Errors every rank reaches together (a decision taken on gathered values: a non-finite loss, a
signal, a run-folder or checkpoint outcome) carry `agreed = True` and are printed by rank 0 alone.

Deliberately simple: ranks other than 0 print nothing on stdout (their warnings and errors go to
stderr); the process group's own timeout is torch's default; an accelerate launch is used for its
launcher and config file (PartialState would pick MPI on CPUs and NCCL alone on GPUs).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from infsamp.config import Config
from infsamp.distributed.one_config import check_one_config
from infsamp.distributed.rank_watch import PEER_FAILED_EXIT, RankWatch
from infsamp.errors import InfsampError, NonFiniteError, RunStopped, first_line
from infsamp.options import ConfigError

AGREED_ERRORS = (NonFiniteError, RunStopped)  # raised on every rank after a collective decision


class PeerFailed(InfsampError):
    """Another rank failed; this one stops too (exit code PEER_FAILED_EXIT)."""

    exit_code = PEER_FAILED_EXIT


def agreed(err: BaseException) -> BaseException:
    """Mark an error every rank raises together (rank 0 alone prints it)."""
    err.agreed = True  # type: ignore[attr-defined]
    return err


def launched() -> bool:
    """True under torchrun / accelerate launch (they set RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class Ranks:
    """One process: rank 0 of 1, every collective returns its input."""

    rank, world_size, local_rank = 0, 1, 0
    strategy = "single"
    distributed = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather_json(self, value: Any) -> list[Any]:
        return [value]

    def broadcast_json(self, value: Any) -> Any:
        return value

    def gather_values(self, values):
        """Every rank's 1-D tensor of floats, concatenated in rank order (one process: its own)."""
        return values

    def sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def max(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def barrier(self) -> None:
        pass

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        yield

    def finish(self) -> None:
        pass

    def decide(self, decide_on_main) -> Any:
        """`decide_on_main()` on rank 0, its result (or its InfsampError) on every rank."""
        return decide_on_main()

    def device(self, name: str):
        from infsamp.models.device import resolve_device

        return resolve_device(name)


class ProcessRanks(Ranks):
    """A torch.distributed process group; the collectives run on CPU tensors."""

    distributed = True

    def __init__(self, strategy: str, failure_timeout_s: float, output_dir: str):
        import torch.distributed as dist

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.strategy = strategy
        # rank 0's random token, on every rank: this launch's prefix in the rendezvous store
        token = self.broadcast_json(os.urandom(8).hex() if self.is_main else None)
        self.watch = RankWatch(self.rank, self.world_size, failure_timeout_s, output_dir,
                               token).start()

    # ---- collectives
    def _gather_varying(self, data) -> list:
        """Every rank's 1-D CPU tensor (lengths may differ): the sizes first, then padded."""
        import torch
        import torch.distributed as dist

        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([data.numel()]))
        width = int(max(s.item() for s in sizes))
        padded = torch.zeros(width, dtype=data.dtype)
        padded[: data.numel()] = data
        out = [torch.zeros(width, dtype=data.dtype) for _ in range(self.world_size)]
        dist.all_gather(out, padded)
        return [t[: int(n.item())] for t, n in zip(out, sizes)]

    def gather_json(self, value: Any) -> list[Any]:
        import torch

        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        return [json.loads(bytes(t.tolist()).decode()) for t in self._gather_varying(data)]

    def gather_values(self, values):
        import torch

        return torch.cat(self._gather_varying(values.detach().float().cpu()))

    def broadcast_json(self, value: Any) -> Any:
        return self.gather_json(value if self.is_main else None)[0]

    def _reduce(self, values: Sequence[float], op: str) -> list[float]:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)  # [n]
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
        return tensor.tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, "SUM")

    def max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, "MAX")

    def barrier(self) -> None:
        self.sum([0.0])  # a gloo all-reduce: works whatever the device backend is

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (downloads, caches), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def decide(self, decide_on_main) -> Any:
        outcome: dict[str, Any] = {}
        if self.is_main:
            try:
                outcome = {"value": decide_on_main()}
            except InfsampError as err:
                outcome = {"error": str(err)}
                self.broadcast_json(outcome)
                raise agreed(err)  # noqa: B904  (err itself, marked: a re-raise)
        outcome = self.broadcast_json(outcome)
        if "error" in outcome:
            raise agreed(InfsampError(outcome["error"]))
        return outcome["value"]

    # ---- failures
    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Post this rank's failure for the others; a failure caused by a peer names the peer."""
        try:
            yield
        except BaseException as err:
            if getattr(err, "agreed", False) or isinstance(err, AGREED_ERRORS):
                self.watch.finished()  # every rank stops here: their exits are not failures
                raise agreed(err)  # noqa: B904  (err itself, marked: a re-raise)
            if isinstance(err, PeerFailed):
                raise
            # a collective that failed: most likely a peer died; give the watcher time to see it
            communication = isinstance(err, RuntimeError) and not isinstance(err, InfsampError)
            with _signals_held():  # the launcher's SIGTERM must not cut the naming short
                peer = self.watch.peer_failure(wait_s=5.0 if communication else 0.0)
            if peer is not None:
                raise PeerFailed(self.watch.describe(*peer)) from None
            self.watch.report_failure(f"{type(err).__name__}: {first_line(err, 300)}")
            raise

    def finish(self) -> None:
        """The run ended normally on every rank: from now on a rank that exits is not a failure."""
        self.barrier()
        self.watch.finished()

    def device(self, name: str):
        import torch

        if name in ("auto", "cuda") and torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return super().device(name)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM / SIGINT / SIGHUP ignored for a moment (main thread): a launcher that saw a rank die
    sends SIGTERM to the others at once, while this rank is finding out which peer failed."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    numbers = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {n: signal.signal(n, signal.SIG_IGN) for n in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


# ---------------------------------------------------------------- the launch


def launch_strategy(cfg: Config) -> str:
    """ddp or fsdp: the config's choice, else what accelerate launch's config file says."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        raise ConfigError("accelerate launch with a DeepSpeed config: not supported (infsamp's "
                          "checkpoints hold data only and its step clips and checks gradients "
                          "itself); use examples/accelerate/fsdp2_zero2.yaml for ZeRO-2's layout")
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if precision not in ("no", ""):
        raise ConfigError(f"accelerate launch with mixed_precision {precision}: infsamp sets the "
                          "weights' dtype with model.dtype; set mixed_precision: 'no' in the "
                          "accelerate config")
    uses_fsdp = env.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if uses_fsdp and env.get("FSDP_VERSION", "1") != "2":
        raise ConfigError("accelerate launch with an FSDP1 config: infsamp uses FSDP2; set "
                          "fsdp_version: 2 (see examples/accelerate/fsdp2.yaml)")
    for key in ("FSDP_OFFLOAD_PARAMS", "FSDP_ACTIVATION_CHECKPOINTING"):
        if uses_fsdp and env.get(key, "false").lower() == "true":
            raise ConfigError(f"accelerate config {key.lower()}: true is not supported (use "
                              "model.gradient_checkpointing for activation checkpointing)")
    if cfg.distributed.strategy != "auto":
        return cfg.distributed.strategy
    return "fsdp" if uses_fsdp else "ddp"


def reshard_after_forward(cfg: Config) -> bool:
    choice = cfg.distributed.reshard_after_forward
    if choice == "auto":
        choice = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
    return choice != "false"


def init_ranks(cfg: Config) -> Ranks:
    """The run's processes, before anything loads; one clear line when the launch cannot work."""
    if not launched():
        if cfg.distributed.strategy != "auto":
            raise ConfigError(f"distributed.strategy {cfg.distributed.strategy}: needs a "
                              "multi-process launch (torchrun --nproc-per-node N -m infsamp train "
                              "..., or accelerate launch -m infsamp train ...)")
        return Ranks()
    strategy = launch_strategy(cfg)
    world_size = int(os.environ["WORLD_SIZE"])
    if cfg.training.prompts_per_step < world_size:
        raise ConfigError(f"training.prompts_per_step: {cfg.training.prompts_per_step} prompts "
                          f"for {world_size} processes; each process samples whole groups, so "
                          f"give at least {world_size} prompts per step")
    _init_process_group()
    ranks = ProcessRanks(strategy, cfg.distributed.failure_timeout_s, cfg.logging.output_dir)
    check_one_config(ranks, cfg)  # every rank the same settings, before anything loads
    if not ranks.is_main:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - rank 0 speaks for the run
    import torch.distributed as dist

    sharding = f" (reshard_after_forward {str(reshard_after_forward(cfg)).lower()})" \
        if strategy == "fsdp" else ""
    print(f"{ranks.world_size} processes ({dist.get_backend()}), strategy {strategy}{sharding}, "
          f"prompts assigned to ranks by {cfg.distributed.assignment}")
    return ranks


def _init_process_group() -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if torch.cuda.is_available():  # one GPU per process, chosen before NCCL starts
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend=backend)
    except (RuntimeError, ValueError) as err:
        raise InfsampError(f"cannot join the process group (MASTER_ADDR "
                           f"{os.environ.get('MASTER_ADDR')}, MASTER_PORT "
                           f"{os.environ.get('MASTER_PORT')}): {first_line(err, 300)}") from None
