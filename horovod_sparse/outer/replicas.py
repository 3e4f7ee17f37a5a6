"""The collectives of the outer steps' replicas: what :class:`~horovod_sparse.outer.rounds.OuterSteps`
needs from the job it runs in, on ``torch.distributed`` (:class:`ProcessGroupReplicas`) or on
Horovod (:class:`horovod_sparse.torch.outer_steps.ProcessSetReplicas`).
"""
from __future__ import annotations

from typing import IO, Any, Callable, List, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from horovod_sparse.common.stats import GroupStats
from horovod_sparse.common.tiers import Tiers
from horovod_sparse.distributed.compression import checked_sparse
from horovod_sparse.distributed.process_group import ProcessGroup
from horovod_sparse.distributed.stepping import distributed_engine, nonfinite_agreement, replicas_dense_average
from horovod_sparse.distributed.tiers import ddp_tiers
from horovod_sparse.engine.flight import Flight
from horovod_sparse.engine.step import StepEngine
from horovod_sparse.torch_core.finiteness import Finite


class Replicas(Protocol):
    """The replicas' collectives (every call collective over the replicas). ``job_rank`` and
    ``job_size``: this process's rank in the job and the job's size (a checkpoint's key);
    ``agree_at_construction``: whether the configuration check and the first replica's
    parameters belong to the construction (not in a Horovod elastic job, whose workers start
    at different times: its state's sync does both, :mod:`horovod_sparse.torch.elastic`)."""

    job_rank: int
    job_size: int
    agree_at_construction: bool

    def checked_sparse(self, compression: Any) -> bool:
        """Whether ``compression`` is a sparsifier, after checking it was built for these
        collectives (``ValueError`` naming the fix otherwise)."""

    def engine(self, compression: Any, stats_log: Optional[IO[str]]) -> StepEngine:
        """The step engine exchanging over the replicas (its model state, ``engine.model``,
        agrees configurations over them too)."""

    def tiers(self, hierarchical: bool, node_size: Optional[int]) -> Optional[Tiers]:
        """The two tiers of the exchange (nodes of ``node_size`` consecutive ranks), made now, or
        None to run flat (``hierarchical`` False, or a layout with nothing to split); a
        ``ValueError`` naming the fix when they cannot be had. Collective."""

    def dense_flight(self, engine: StepEngine, group: Any, buffer: torch.Tensor, compression: Any,
                     finite: Finite) -> Callable[[GroupStats], Flight]:
        """The dense flight :meth:`StepEngine.start` takes for ``group``: the average of
        ``buffer`` over the replicas (zeros for this rank's share when it is not ``finite``)."""

    def agreement(self, policy: Optional[str], engine: StepEngine) -> Callable[[Sequence[str]], List[int]]:
        """The agreement ``engine``'s :meth:`StepEngine.end` takes: the ranks that saw a non-finite
        pseudo-gradient (none, and no collective, without a ``policy``)."""

    def node_group(self, tiers: Tiers) -> Any:
        """This rank's node's group of ``tiers`` as the inner steps' exchange takes it (a
        ``torch.distributed`` group for DDP, a Horovod process set for Horovod's optimizer)."""

    def broadcast_from_first(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every replica takes the first replica's ``tensors``, in place."""

    def place(self, like: torch.Tensor) -> None:
        """Put the exchange's host payloads on ``like``'s device where the collectives need it (NCCL)."""


class ProcessGroupReplicas:
    """The replicas of a ``torch.distributed`` process group (None: every process)."""

    def __init__(self, process_group: Optional[dist.ProcessGroup]) -> None:
        self.process_group = ProcessGroup(process_group)
        self.job_rank, self.job_size = dist.get_rank(), dist.get_world_size()
        self.agree_at_construction = True

    def checked_sparse(self, compression: Any) -> bool:
        return checked_sparse(compression, "outer")

    def engine(self, compression: Any, stats_log: Optional[IO[str]]) -> StepEngine:
        return distributed_engine(compression, self.process_group, stats_log)

    def tiers(self, hierarchical: bool, node_size: Optional[int]) -> Optional[Tiers]:
        """:func:`~horovod_sparse.distributed.tiers.ddp_tiers`, as the DDP hook makes them (the
        default process group only; the same ``node_size`` everywhere, default ``LOCAL_WORLD_SIZE``)."""
        return ddp_tiers(hierarchical, node_size, self.process_group)

    def dense_flight(self, engine: StepEngine, group: Any, buffer: torch.Tensor, compression: Any,
                     finite: Finite) -> Callable[[GroupStats], Flight]:
        return replicas_dense_average(engine, group, buffer, compression, finite)

    def agreement(self, policy: Optional[str], engine: StepEngine) -> Callable[[Sequence[str]], List[int]]:
        return nonfinite_agreement(policy, self.process_group)

    def node_group(self, tiers: Tiers) -> dist.ProcessGroup:
        return tiers.node_set.group

    def broadcast_from_first(self, tensors: Sequence[torch.Tensor]) -> None:
        group = self.process_group.group
        source = dist.get_global_rank(group, 0) if group is not None else 0
        for t in tensors:
            dist.broadcast(t, source, group=group)

    def place(self, like: torch.Tensor) -> None:
        self.process_group.place_payloads_with(like)
