"""How the model is spread over the ranks: a registry of strategies (one process, DDP, FSDP2).

A strategy answers the few questions the trainer and the GRPO step ask:

    wrap(model)            the module the training forward and backward run through
    inference_model()      a context giving a module with whole weights for sampling, evaluation
                           and the no-grad log-prob passes (it runs on this rank alone)
    backward_sync(last)    a context around one micro-batch's backward: gradients reduced or not
    padding_batches(n)     extra zero-weight micro-batches so every rank runs as many as the others

- `single`: the model itself; nothing to reduce.
- `ddp`: torch DistributedDataParallel over the model (buffers are not re-broadcast: the sampler's
  and the no-grad passes' forwards stay local). Micro-batches accumulate under `no_sync` and only
  each rank's last backward all-reduces; the comm hook SUMS instead of averaging, because every
  rank's loss is already normalised by the whole step's totals (`BatchTotals`), so the reduced
  gradient is the one-process gradient. Ranks may run different numbers of micro-batches.
- `fsdp`: FSDP2 (`fully_shard` on every decoder layer, then the root) with a gradient divide factor
  of 1 (a sum, as above). A sharded forward is a collective, so (1) every rank runs the same number
  of training micro-batches (the shorter ranks add zero-weight ones) and each backward
  reduce-scatters (gradients stay sharded), and (2) sampling never runs the sharded model: the
  ranks decode different numbers of steps. `inference_model()` gathers the whole weights into a
  copy that lives only inside the context (a skeleton on the meta device otherwise): during
  sampling each rank holds the full weights once more besides its shards (the planner counts it).

Deliberately simple: FSDP2 without CPU offload or mixed precision (the weights' dtype is
model.dtype); a reference model (beta > 0) stays whole on every rank.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from infsamp.distributed.ranks import Ranks


class Strategy:
    """One process: the model as it is."""

    name = "single"
    can_split_micro_batches = True  # an out-of-memory micro-batch may be split in two
    shards_state = False  # weights and optimizer states are sharded (checkpoints per rank)

    def __init__(self, ranks: Ranks, reshard_after_forward: bool = True):
        self.ranks = ranks
        self.reshard_after_forward = reshard_after_forward
        self.model: torch.nn.Module | None = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.model = model
        return model

    def sampling_model(self) -> torch.nn.Module:
        """The module the sampler and evaluation hold (whole inside `inference_model`)."""
        return self.model

    @contextlib.contextmanager
    def inference_model(self) -> Iterator[torch.nn.Module]:
        yield self.model

    def backward_sync(self, last: bool):
        return contextlib.nullcontext()

    def padding_batches(self, num_local: int) -> int:
        return 0


def _sum_hook(_state, bucket):  # DDP checks annotations literally: none given
    """DDP communication hook: all-reduce SUM (DDP's default divides by the world size)."""
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        self.model = model
        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        self.wrapper = DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False,
                                               gradient_as_bucket_view=True)
        self.wrapper.register_comm_hook(None, _sum_hook)
        return self.wrapper

    def backward_sync(self, last: bool):
        return contextlib.nullcontext() if last else self.wrapper.no_sync()


class FSDPStrategy(Strategy):
    name = "fsdp"
    can_split_micro_batches = False  # a split would change this rank's count of collectives
    shards_state = True

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.full = _meta_copy(model)
        self._aliases = _parameter_aliases(model)
        layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, reshard_after_forward=self.reshard_after_forward)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # a plain SUM (no PREMUL_SUM: gloo has none)
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)
        self.model = model
        self._depth = 0
        return model

    def sampling_model(self) -> torch.nn.Module:
        return self.full

    @contextlib.contextmanager
    def inference_model(self) -> Iterator[torch.nn.Module]:
        """Whole weights gathered from the shards (a collective: every rank enters together)."""
        if self._depth == 0:
            self._gather()
        self._depth += 1
        try:
            yield self.full
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._release()

    def _gather(self) -> None:
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                whole = torch.nn.Parameter(param.full_tensor(), requires_grad=False)
                for alias in self._aliases[name]:
                    _set(self.full, alias, whole)
            for name, buffer in self.model.named_buffers():
                _set(self.full, name, buffer, parameter=False)

    def _release(self) -> None:
        for name, param in self.model.named_parameters():
            empty = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype,
                                                   device="meta"), requires_grad=False)
            for alias in self._aliases[name]:
                _set(self.full, alias, empty)

    def padding_batches(self, num_local: int) -> int:
        return int(self.ranks.max([num_local])[0]) - num_local


STRATEGIES: dict[str, type[Strategy]] = {
    "single": Strategy, "ddp": DDPStrategy, "fsdp": FSDPStrategy}


def make_strategy(ranks: Ranks, reshard_after_forward: bool = True) -> Strategy:
    return STRATEGIES[ranks.strategy](ranks, reshard_after_forward)


# ---------------------------------------------------------------- the whole-weights copy


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy whose parameters live on the meta device (no memory); buffers are copied."""
    memo = {id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                      requires_grad=False) for p in model.parameters()}
    return copy.deepcopy(model, memo).eval()


def _parameter_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each parameter's canonical name -> every name it has (tied weights have two)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return {names[0]: names for names in by_id.values()}


def _set(root: torch.nn.Module, name: str, tensor: torch.Tensor, parameter: bool = True) -> None:
    path, _, leaf = name.rpartition(".")
    module = root.get_submodule(path) if path else root
    if parameter:
        module._parameters[leaf] = tensor
    else:
        module._buffers[leaf] = tensor
