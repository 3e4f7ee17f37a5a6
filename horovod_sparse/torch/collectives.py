"""Horovod collectives as a sparsifier sees them: named, counted and timed (the contract:
:mod:`horovod_sparse.torch_core.communicator`), issued on the optimizer's process set; and the
blocking host collectives for rare metadata and for the agreement on non-finite gradients.
"""
from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import numpy as np
import torch

from horovod_sparse.common.communicator import Rows
from horovod_sparse.common.horovod_tiers import level_collectives
from horovod_sparse.common.stats import StepStats
from horovod_sparse.common.tiers import Tiers
from horovod_sparse.torch_core.communicator import Pending, TorchCommunicator, nbytes
from horovod_sparse.torch_core.tensor_backend import synchronize
from horovod_sparse.torch.waiting import wait


@functools.lru_cache(maxsize=None)
def _gloo_enabled() -> bool:
    """Whether this Horovod job runs its collectives on Gloo (fixed at ``hvd.init``)."""
    return bool(hvd.gloo_enabled())


def allgather_bytes(payload: bytes, name: str, process_set: hvd.ProcessSet) -> List[bytes]:
    """Every rank's ``payload``, in rank order (blocking; for rare metadata only). Unlike
    ``hvd.allgather_object`` in Horovod 0.28.1 it honours ``process_set``."""
    tensor = torch.tensor(list(payload), dtype=torch.uint8)
    sizes = wait(hvd.allgather_async(torch.tensor([tensor.numel()]), name=f"{name}.sizes", process_set=process_set))
    data = wait(hvd.allgather_async(tensor, name=f"{name}.data", process_set=process_set))
    return [bytes(chunk.tolist()) for chunk in data.split(sizes.tolist())]


def allgather_array(array: np.ndarray, process_set: hvd.ProcessSet, name: str) -> np.ndarray:
    """Every rank's ``array`` concatenated along the first axis, in rank order (blocking)."""
    return wait(hvd.allgather_async(torch.from_numpy(np.ascontiguousarray(array)), name=name,
                                    process_set=process_set)).numpy()


def allgather_payload(numel: int, like: Optional[torch.Tensor], process_set: hvd.ProcessSet, name: str) -> None:
    """Allgather ``numel`` float32 zeros on ``like``'s device and wait for the result (what the
    alpha-beta calibration times: on CUDA, Horovod's GPU path)."""
    payload = torch.zeros(numel, dtype=torch.float32, device=None if like is None else like.device)
    synchronize(wait(hvd.allgather_async(payload, name=name, process_set=process_set)))


def launch_report(count: int, process_set: hvd.ProcessSet) -> Any:
    """Launch the allgather of every rank's ``count`` of non-finite groups (one tiny Horovod
    collective: how every rank learns which ranks saw a non-finite gradient); its handle, for
    :func:`ranks_reporting`."""
    local = torch.tensor([count], dtype=torch.int32)
    return hvd.allgather_async(local, name="hs.nonfinite", process_set=process_set)


def ranks_reporting(report: Any) -> List[int]:
    """The ranks whose count was not zero in the allgather ``report`` (:func:`launch_report`'s
    handle), once it finished."""
    counts = wait(report)
    return [rank for rank, theirs in enumerate(counts.tolist()) if theirs]


def step_reports(count: int, launched: int, process_set: hvd.ProcessSet) -> List[Tuple[int, int]]:
    """Every rank's ``(count, launched)`` in rank order: its count of non-finite groups and the
    collectives it launched this step (one tiny blocking allgather, :func:`ranks_reporting`'s
    in a two-tier step: :func:`~horovod_sparse.common.horovod_tiers.level_collectives`)."""
    local = torch.tensor([[count, launched]], dtype=torch.int64)
    rows = wait(hvd.allgather_async(local, name="hs.nonfinite", process_set=process_set))
    return [(int(theirs), int(sent)) for theirs, sent in rows.tolist()]


def pad_collectives(missing: int, process_set: hvd.ProcessSet, label: Any) -> None:
    """Launch ``missing`` one-element allreduces on ``process_set`` (every rank of it the same
    number, with the same ``label``: the step) and wait for them: Horovod handles that bring this
    rank's count of the step up to the other ranks' (:func:`~horovod_sparse.common.horovod_tiers.level_collectives`)."""
    handles = [hvd.allreduce_async_(torch.zeros(1), name=f"hs.level.{label}.{i}", op=hvd.Sum, process_set=process_set)
               for i in range(missing)]
    for handle in handles:
        wait(handle)


def agree_at_step_end(policy: Optional[str], nonfinite_groups: Sequence[str], process_set: hvd.ProcessSet,
                      rank: int, tiers: Optional[Tiers], stats: StepStats, report: Any = None) -> List[int]:
    """The ranks that saw a non-finite gradient this step (none without a ``policy``; this rank's
    non-finite groups ``nonfinite_groups``), from ``report`` where the front end launched the
    allgather of the counts already (:func:`launch_report`, flat steps only); in two ``tiers``, in
    the same allgather, every rank's collectives of the step (``stats``) leveled
    (:func:`~horovod_sparse.common.horovod_tiers.level_collectives`), so that the training loop's
    own unnamed collectives get the same name on every rank."""
    if tiers is None:
        if policy is None:
            return []
        return ranks_reporting(launch_report(len(nonfinite_groups), process_set) if report is None else report)
    launched = sum(group.collectives for group in stats.groups)
    reports = step_reports(len(nonfinite_groups), launched, process_set)
    level_collectives([sent for _, sent in reports], rank,
                      lambda missing: pad_collectives(missing, tiers.cross_set, stats.step))
    return [] if policy is None else [member for member, (theirs, _) in enumerate(reports) if theirs]


def gather_places(place: Tuple[int, int]) -> List[Tuple[int, int]]:
    """Every rank's ``(cross_rank, local_rank)``, in rank order (blocking, global)."""
    rows = wait(hvd.allgather_async(torch.tensor([list(place)], dtype=torch.int64), name="hs.tiers.places"))
    return [(int(node), int(local)) for node, local in rows.tolist()]


class Communicator(TorchCommunicator):
    """Launches Horovod collectives for one group in one step (arguments:
    :class:`~horovod_sparse.common.communicator.CommunicatorBase`)."""

    def allgather(self, tensor: torch.Tensor, tag: str, kind: str, rows: Rows = None) -> Pending:
        """Variable-length allgather along dim 0 (tensors of rank >= 1; length 0 is allowed;
        ``rows``: see :class:`~horovod_sparse.common.communicator.CommunicatorBase`, unused)."""
        handle = hvd.allgather_async(tensor, name=self._name(tag), process_set=self.process_set)
        return self._launched(handle, tag, kind, sent=nbytes(tensor), own=nbytes(tensor))

    def allreduce(self, tensor: torch.Tensor, tag: str, kind: str, op: Any = hvd.Sum,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Pending:
        """In-place allreduce of ``tensor`` (Horovod's ``allreduce_async_``)."""
        handle = hvd.allreduce_async_(tensor, name=self._name(tag), op=op, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor, process_set=self.process_set)
        return self._launched(handle, tag, kind, sent=nbytes(tensor), own=0)

    def reducescatter(self, tensor: torch.Tensor, tag: str, kind: str) -> Pending:
        """Sum ``tensor`` over the process set and hand rank ``r`` the ``r``-th of ``size`` slices
        of the sum along dim 0 (Horovod's split: the first ``numel % size`` one element longer)."""
        handle = hvd.reducescatter_async(tensor, name=self._name(tag), op=hvd.Sum, process_set=self.process_set)
        return self._reducescatter_launched(handle, tensor, tag, kind)

    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int], tag: str, kind: str,
                 received: Optional[Sequence[int]] = None) -> Pending:
        """Alltoall with explicit splits (rows for each rank); a split non-zero only for one peer
        is a point-to-point send. ``received`` (the rows from each rank, when the caller knows
        them) is unused: Horovod negotiates sizes itself."""
        handle = hvd.alltoall_async(tensor, splits=torch.tensor(splits, dtype=torch.int32), name=self._name(tag),
                                    process_set=self.process_set)
        return self._alltoall_launched(handle, tensor, splits, tag, kind)

    def _complete(self, handle: Any, timeout: Optional[float]) -> Any:
        return wait(handle, timeout)

    def runs_on_gloo(self) -> bool:
        return _gloo_enabled()

    def member_ranks(self) -> List[int]:
        return list(self.process_set.ranks) if self.process_set.ranks else list(range(hvd.size()))
