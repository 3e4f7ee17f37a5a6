"""The step engine (:mod:`horovod_sparse.engine.step`) on ``torch.distributed``, as the DDP hook,
FSDP2 and the outer steps run it: the engine over a process group, a group's dense average as
the engine starts it (flat, or in the engine's two tiers: the Horovod outer steps' too), and the
agreement on non-finite gradients at the end of a step."""
from __future__ import annotations

from typing import IO, Any, Callable, List, Optional, Sequence

import torch

from horovod_sparse.common.stats import GroupStats
from horovod_sparse.distributed import backend
from horovod_sparse.distributed.communicator import Communicator
from horovod_sparse.distributed.host_collectives import ranks_reporting
from horovod_sparse.distributed.process_group import ProcessGroup
from horovod_sparse.distributed.dense import dense_exchange, two_tier_dense_exchange
from horovod_sparse.engine.flight import ExchangeFlight
from horovod_sparse.engine.model_state import ModelState
from horovod_sparse.engine.step import StepEngine
from horovod_sparse.engine.topology import Transport
from horovod_sparse.torch_core.finiteness import Finite
from horovod_sparse.torch_core.device_figures import read_scalars


def distributed_engine(compression: Any, process_group: ProcessGroup, stats_log: Optional[IO[str]],
                       first_dense_steps: int = 0, model_state: Callable[..., ModelState] = ModelState) -> StepEngine:
    """The step engine of a front end averaging over ``process_group`` (its :class:`ModelState`
    is ``engine.model``, made by ``model_state``); ``stats_log`` and ``first_dense_steps`` as
    :class:`StepEngine` takes them."""
    model = model_state(compression, backend, process_group, None)
    return StepEngine(compression, model, Transport(Communicator, process_group, read_scalars=read_scalars),
                      stats_log, first_dense_steps)


def dense_average(engine: StepEngine, group: Any, buffer: torch.Tensor, compression: Any,
                  finite: Finite) -> Callable[[GroupStats], ExchangeFlight]:
    """The dense flight :meth:`StepEngine.start` takes for ``group``: the average of ``buffer``
    over the process group (:func:`~horovod_sparse.distributed.dense.dense_exchange`, zeros for
    this rank's share when it is not ``finite``)."""
    return lambda stats: engine.dense_flight(group, stats,
                                             lambda comm: dense_exchange(buffer, comm, compression, finite))


def two_tier_dense_average(engine: StepEngine, group: Any, buffer: torch.Tensor, compression: Any,
                           finite: Finite) -> Callable[[GroupStats], ExchangeFlight]:
    """:func:`dense_average` in the engine's two tiers (``engine.tiers``, a group of at least
    one element per rank of a node): :func:`~horovod_sparse.distributed.dense.two_tier_dense_exchange`
    over the group's communicators of the cross set and of the node."""
    def start(stats: GroupStats) -> ExchangeFlight:
        cross, node = engine.transport.communicators(group, stats, engine.tiers, engine.step)
        flight = ExchangeFlight(two_tier_dense_exchange(buffer, node, cross, compression, finite), cross, group,
                                sparse=False)
        flight.advance()
        return flight

    return start


def replicas_dense_average(engine: StepEngine, group: Any, buffer: torch.Tensor, compression: Any,
                           finite: Finite) -> Callable[[GroupStats], ExchangeFlight]:
    """The outer steps' dense average of ``group`` (any front end's transport): in the engine's
    two tiers (:func:`two_tier_dense_average`) when the group gives every rank of a node a slice,
    else flat (:func:`dense_average`). ``compression`` is this module's dense wire (``none``, ``fp16``)."""
    if engine.tiers is not None and engine.tiers.splits(group.numel):
        return two_tier_dense_average(engine, group, buffer, compression, finite)
    return dense_average(engine, group, buffer, compression, finite)


def nonfinite_agreement(policy: Optional[str], process_group: ProcessGroup) -> Callable[[Sequence[str]], List[int]]:
    """The agreement :meth:`StepEngine.end` takes: the ranks of ``process_group`` that saw a
    non-finite gradient this step, given this rank's non-finite groups (one tiny allgather).
    Under no ``nonfinite`` policy (``policy`` None, the same on every rank: nothing was checked)
    there is nothing to agree on: no ranks, and no collective."""
    return lambda groups: [] if policy is None else ranks_reporting(len(groups), process_group)
