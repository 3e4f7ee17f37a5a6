"""``torch.distributed`` collectives as a sparsifier sees them: :class:`Communicator` launches a
group's collectives asynchronously, under the contract of
:class:`~horovod_sparse.torch_core.communicator.TorchCommunicator`, over a
:class:`~horovod_sparse.distributed.process_group.ProcessGroup`. ``torch.distributed`` has no
variable-length allgather and its alltoall needs the received splits up front, so each of those
first exchanges the lengths (one small blocking collective) unless the caller knows them, then
moves the payload padded to the longest (allgather) or with explicit splits (alltoall).
Collectives carry no names here: every rank issues them in the same order, which the front end
guarantees.
"""
from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from horovod_sparse.common.communicator import Rows
from horovod_sparse.common.tiers import slice_bounds
from horovod_sparse.distributed.host_collectives import launch_allgather
from horovod_sparse.torch_core.communicator import Pending, TorchCommunicator, nbytes
from horovod_sparse.torch_core.tensor_backend import to_device


class Communicator(TorchCommunicator):
    """Launches ``torch.distributed`` collectives for one group in one step (arguments:
    :class:`~horovod_sparse.common.communicator.CommunicatorBase`, with a :class:`ProcessGroup`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Per-rank row counts of this step's allgathers, by their ``rows`` key.
        self._rows: Dict[str, List[int]] = {}

    def allgather(self, tensor: torch.Tensor, tag: str, kind: str, rows: Rows = None) -> Pending:
        """Variable-length allgather along dim 0 (tensors of rank >= 1; length 0 is allowed):
        the row counts are exchanged first (one blocking collective and a host read) unless
        ``rows`` gives them or names an earlier allgather's
        (:class:`~horovod_sparse.common.communicator.CommunicatorBase`)."""
        known = self._rows.get(rows) if isinstance(rows, str) else rows
        work, finish, lengths = launch_allgather(tensor, self.process_set,
                                                 None if known is None else [int(n) for n in known])
        if isinstance(rows, str):
            self._rows[rows] = lengths
        return self._launched((work, finish), tag, kind, sent=nbytes(tensor), own=nbytes(tensor))

    def allreduce(self, tensor: torch.Tensor, tag: str, kind: str) -> Pending:
        """In-place sum of ``tensor`` over the group."""
        work = dist.all_reduce(tensor, group=self.process_set.group, async_op=True)
        return self._launched((work, lambda: tensor), tag, kind, sent=nbytes(tensor), own=0)

    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int], tag: str, kind: str,
                 received: Optional[Sequence[int]] = None) -> Pending:
        """Alltoall of ``tensor``'s rows, ``splits[r]`` of them to rank ``r``; the output is
        ``(rows received in rank order, received splits)``. Unless the caller knows the rows
        ``received`` from each rank, they are exchanged first (a blocking collective and a host
        read)."""
        group = self.process_set.group
        if received is None:
            sending = to_device(torch.tensor(list(splits), dtype=torch.int64), self.process_set.device)
            receiving = torch.empty_like(sending)
            dist.all_to_all_single(receiving, sending, group=group)
            received = receiving.cpu().tolist()
        received = [int(n) for n in received]
        output = tensor.new_empty((sum(received), *tensor.shape[1:]))
        work = dist.all_to_all_single(output, tensor, received, list(splits), group=group, async_op=True)
        counts = torch.tensor(received, dtype=torch.int32)
        return self._alltoall_launched((work, lambda: (output, counts)), tensor, splits, tag, kind)

    def reducescatter(self, tensor: torch.Tensor, tag: str, kind: str) -> Pending:
        """Sum ``tensor`` over the group and hand rank ``r`` its slice of the sum
        (:func:`~horovod_sparse.common.tiers.slice_bounds`, Horovod's split)."""
        sizes = [hi - lo for lo, hi in (slice_bounds(tensor.shape[0], self.size, r) for r in range(self.size))]
        output = tensor.new_empty(sizes[self.rank])
        work = dist.reduce_scatter(output, list(tensor.split(sizes)), group=self.process_set.group, async_op=True)
        return self._reducescatter_launched((work, lambda: output), tensor, tag, kind)

    def _complete(self, handle: Any, timeout: Optional[float]) -> Any:
        work, finish = handle
        if timeout is None:
            work.wait()
        else:
            try:
                work.wait(datetime.timedelta(seconds=timeout))
            except RuntimeError as error:  # Gloo's "Operation timed out!"
                if "timed out" not in str(error).lower():
                    raise
                raise TimeoutError(str(error)) from error
        return finish()

    def member_ranks(self) -> List[int]:
        group = self.process_set.group
        return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
