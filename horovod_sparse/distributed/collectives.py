"""``torch.distributed`` collectives as a sparsifier sees them, and as the shared code sees a
process group.

:class:`ProcessGroup` gives a ``torch.distributed`` group the two questions the shared code
asks of a Horovod process set (``size()``, ``rank()``). :class:`Communicator`
launches a group's collectives asynchronously, under the contract of
:class:`~horovod_sparse.torch_core.communicator.TorchCommunicator`. ``torch.distributed`` has no
variable-length allgather and its alltoall needs the received splits up front, so each of those
first exchanges the lengths (one small blocking collective), then moves the payload padded to
the longest (allgather) or with explicit splits (alltoall). Collectives carry no names here:
every rank issues them in the same order, which the front end guarantees.
"""
from __future__ import annotations

import datetime
import os
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from horovod_sparse.common.tiers import NodeLayout, Tiers, make_tiers, slice_bounds
from horovod_sparse.common.communicator import Rows
from horovod_sparse.torch_core.communicator import Pending, TorchCommunicator, nbytes
from horovod_sparse.torch_core.tensor_backend import synchronize, to_device


class ProcessGroup:
    """A ``torch.distributed`` process group (None: the default, every process), which may be
    named before ``init_process_group`` runs: nothing here asks ``torch.distributed`` anything
    until the first collective.

    Collectives on NCCL groups take CUDA tensors: :attr:`device` is where host payloads go."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self._device: Optional[torch.device] = None

    @property
    def device(self) -> torch.device:
        """Where host payloads go: the current CUDA device on an NCCL group (until
        :meth:`place_payloads_with` says otherwise), else the CPU. Known once the group exists."""
        if self._device is None:
            if not dist.is_initialized():
                raise RuntimeError("horovod_sparse needs torch.distributed's process group at its first exchange: "
                                   "call torch.distributed.init_process_group before training")
            self._device = (torch.device("cuda", torch.cuda.current_device())
                            if dist.get_backend(self.group) == dist.Backend.NCCL else torch.device("cpu"))
        return self._device

    def place_payloads_with(self, tensor: torch.Tensor) -> None:
        """On an NCCL group, send host payloads to ``tensor``'s device from now on: the device
        DDP's model lives on, which need not be the current one when the group was built."""
        if self.device.type == "cuda":
            self._device = tensor.device

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def rank(self) -> int:
        return dist.get_rank(self.group)


#: The allgather into one tensor (``all_gather_single`` from torch 2.13, which deprecates the
#: older name): no list of outputs to allocate and concatenate.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_ints(value: int, process_group: ProcessGroup) -> List[int]:
    """Every rank's ``value``, in rank order (one blocking allgather of one int64 each, read on
    the host at once)."""
    mine = torch.tensor([value], dtype=torch.int64, device=process_group.device)
    lengths = [torch.empty_like(mine) for _ in range(process_group.size())]
    dist.all_gather(lengths, mine, group=process_group.group)
    return torch.cat(lengths).tolist()


def ranks_reporting(count: int, process_group: ProcessGroup) -> List[int]:
    """The ranks whose ``count`` is not zero (one tiny blocking allgather, :func:`gather_ints`)."""
    return [rank for rank, theirs in enumerate(gather_ints(count, process_group)) if theirs]


def launch_allgather(tensor: torch.Tensor, process_group: ProcessGroup,
                     lengths: Optional[List[int]] = None) -> Tuple[Any, Any, List[int]]:
    """Start an allgather along dim 0 of rank-dependent lengths: the lengths first (blocking,
    unless every rank's ``lengths`` are given), then every rank's rows padded to the longest.
    Returns ``(work, finish, lengths)``: ``finish()``, after ``work.wait()``, gives the rows of
    every rank, concatenated in rank order."""
    if lengths is None:
        lengths = gather_ints(tensor.shape[0], process_group)
    longest = max(max(lengths), 1)  # every rank sends at least one row, even when none has any
    if tensor.shape[0] == longest:
        padded = tensor.contiguous()
    else:
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
    gathered = padded.new_empty((len(lengths) * longest, *padded.shape[1:]))
    work = _ALL_GATHER_SINGLE(gathered, padded, group=process_group.group, async_op=True)
    if all(n == longest for n in lengths):  # a fixed count (a capacity): the rows as they came
        return work, lambda: gathered, lengths
    return work, lambda: torch.cat([chunk[:n] for chunk, n in zip(gathered.split(longest), lengths)]), lengths


def allgather_payload(numel: int, like: Optional[torch.Tensor], process_set: ProcessGroup, name: str) -> None:
    """Allgather ``numel`` float32 zeros on ``like``'s device (the group's when None) and wait
    for the result (what the alpha-beta calibration times; ``name`` is Horovod's, unused here)."""
    tensor = torch.zeros(numel, dtype=torch.float32, device=process_set.device if like is None else like.device)
    work, finish, _ = launch_allgather(tensor, process_set)
    work.wait()
    synchronize(finish())


def allgather_array(array: np.ndarray, process_set: ProcessGroup, name: str) -> np.ndarray:
    """Every rank's ``array`` concatenated along the first axis, in rank order (blocking;
    ``name`` is Horovod's, unused here)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(process_set.device)
    work, finish, _ = launch_allgather(tensor, process_set)
    work.wait()
    return finish().cpu().numpy()


def allgather_bytes(payload: bytes, name: str, process_set: ProcessGroup) -> List[bytes]:
    """Every rank's ``payload``, in rank order (blocking; for rare metadata only)."""
    gathered: List[Any] = [None] * process_set.size()
    dist.all_gather_object(gathered, pickle.dumps(payload), group=process_set.group)
    return [pickle.loads(item) for item in gathered]


def ddp_tiers(hierarchical: Optional[bool], node_size: Optional[int], process_group: ProcessGroup) -> Optional[Tiers]:
    """This rank's :class:`~horovod_sparse.common.tiers.Tiers` over ``torch.distributed``
    (:func:`~horovod_sparse.common.tiers.make_tiers`): nodes of ``node_size`` consecutive ranks
    (default ``LOCAL_WORLD_SIZE``, one node without it), one new group per node and per slice.
    Collective: every rank of the default group."""

    def find_layout() -> NodeLayout:
        if process_group.group is not None:
            raise ValueError("hierarchical=True splits the job into its nodes, so it needs the default process "
                             "group; use hierarchical=False with another process_group")
        size = node_size if node_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", process_group.size()))
        sizes = gather_ints(size, process_group)
        if len(set(sizes)) > 1 or size < 1:
            raise ValueError(f"hierarchical=True needs the same node_size >= 1 on every rank (LOCAL_WORLD_SIZE by "
                             f"default); the ranks have {sizes}")
        return NodeLayout.from_places([(rank // size, rank % size) for rank in range(process_group.size())])

    def new_group(ranks: List[int]) -> Optional[ProcessGroup]:
        group = dist.new_group(ranks)
        return ProcessGroup(group) if dist.get_rank() in ranks else None

    return make_tiers(hierarchical, dist.get_rank(), find_layout, new_group)


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
