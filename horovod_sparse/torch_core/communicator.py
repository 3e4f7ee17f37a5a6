"""What every PyTorch front end's communicator shares, whoever runs the collectives.

A sparsifier never calls a collective library directly. It asks its ``comm`` to *launch* a
collective, which returns a :class:`Pending`, and yields the pendings it needs to the front end,
which waits for them (:meth:`TorchCommunicator.wait`) and sends the outputs back. Every
collective is named ``hs.<group>.<tag>`` (identical on every rank, unique per step) and its
payload bytes and wait time land in the group's :class:`~horovod_sparse.common.stats.GroupStats`.
Subclasses launch the collectives: Horovod's (:mod:`horovod_sparse.torch.collectives`) or
``torch.distributed``'s (:mod:`horovod_sparse.distributed.communicator`). Nothing here imports Horovod.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager, List, Optional, Sequence, Tuple

import torch

from horovod_sparse.common.communicator import CommunicatorBase
from horovod_sparse.common.stall import ExchangeStalled, stall_seconds
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.common.timing import timed
from horovod_sparse.torch_core.device_timing import cuda_timed


@dataclass
class Pending:
    """A launched collective: the subclass's handle plus what is needed to account for it."""

    handle: Any
    #: the communicator that launched it (and waits for it).
    comm: "TorchCommunicator"
    #: the collective's tag (its name is ``hs.<group>.<tag>``).
    tag: str
    kind: str
    #: bytes of the output that this rank contributed itself (not received from others).
    own_bytes: int
    #: bytes received from the other ranks where they are not the output less ``own_bytes``
    #: (a reduce-scatter: every other rank's contribution to this rank's slice).
    received: Optional[int] = None


def nbytes(tensor: torch.Tensor) -> int:
    """Payload size of ``tensor`` in bytes."""
    return tensor.numel() * tensor.element_size()


class TorchCommunicator(CommunicatorBase):
    """Launches one group's collectives in one step and accounts for them (arguments:
    :class:`~horovod_sparse.common.communicator.CommunicatorBase`). Subclasses provide
    ``allgather(tensor, tag, kind)`` (variable length along dim 0), ``allreduce(tensor, tag,
    kind)`` (a sum, in place), ``alltoall(tensor, splits, tag, kind)`` (output and received
    splits), ``reducescatter(tensor, tag, kind)`` (a sum of 1-D tensors, this rank's slice of
    :func:`~horovod_sparse.common.tiers.slice_bounds`), :meth:`_complete` and
    :meth:`member_ranks`. ``device``: where the group's tensors live (its phases are timed with
    CUDA events there, see :meth:`timer`); ``step``: the front end's step counter (named when the
    exchange stalls, see :meth:`wait`)."""

    def __init__(self, process_set: Any, name: str, stats: GroupStats, scale: float,
                 size: Optional[int] = None, rank: Optional[int] = None,
                 device: Optional[torch.device] = None, step: Optional[int] = None) -> None:
        super().__init__(process_set, name, stats, scale, size, rank)
        self.device = device
        self.step = step
        #: Seconds a wait may take once the exchange is under way (None: no limit), and whether
        #: it is (a wait of this communicator has completed).
        self._stall_seconds = stall_seconds(gloo=self.runs_on_gloo())
        self._under_way = False
        self._deliveries: List[Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]] = []
        #: The zeroed buffer :meth:`output` hands out (the front end's, reused every step).
        self.output_buffer: Optional[torch.Tensor] = None

    @property
    def stall_limit(self) -> Optional[float]:
        """Seconds a wait may take once the exchange is under way (None: no limit)."""
        return self._stall_seconds

    def runs_on_gloo(self) -> bool:
        """Whether the transport's collectives run on Horovod's Gloo, whose timeout aborts every
        rank (:mod:`horovod_sparse.common.stall`); not here."""
        return False

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The zeroed buffer the aggregated update of ``x``'s group is written into."""
        return torch.zeros_like(x) if self.output_buffer is None else self.output_buffer

    def _launched(self, handle: Any, tag: str, kind: str, sent: int, own: int,
                  received: Optional[int] = None) -> Pending:
        self._account(kind, sent)
        return Pending(handle, self, tag, kind, own, received)

    def _alltoall_launched(self, handle: Any, tensor: torch.Tensor, splits: Sequence[int], tag: str,
                           kind: str) -> Pending:
        """Account for an alltoall of ``tensor``'s rows, ``splits[r]`` of them to rank ``r``
        (what this rank sends itself stays off the wire)."""
        row_bytes = nbytes(tensor) // tensor.shape[0] if tensor.shape[0] else 0
        own = splits[self.rank] * row_bytes
        return self._launched(handle, tag, kind, sent=nbytes(tensor) - own, own=own)

    def _reducescatter_launched(self, handle: Any, tensor: torch.Tensor, tag: str, kind: str) -> Pending:
        """Account for a reduce-scatter of the 1-D ``tensor`` (:meth:`_slice_bytes`)."""
        sent, own, received = self._slice_bytes(tensor.numel(), tensor.element_size())
        return self._launched(handle, tag, kind, sent, own, received)

    def _complete(self, handle: Any, timeout: Optional[float]) -> Any:
        """Wait for one launched collective; its output (alltoall: ``(output, received_splits)``).
        ``TimeoutError`` when it has not completed within ``timeout`` seconds (None: no limit)."""
        raise NotImplementedError

    def member_ranks(self) -> List[int]:
        """The global ranks of the process set, in its rank order."""
        raise NotImplementedError

    def wait(self, pendings: Sequence[Pending]) -> List[Any]:
        """Wait for ``pendings`` and return their outputs (alltoall: ``(output, received_splits)``),
        each through the communicator that launched it (a two-tier exchange yields the node's and
        the cross set's).

        Once a wait of a communicator has completed, every rank of its process set has joined the
        group's exchange, and a later collective of it that does not complete within Horovod's
        stall-check time raises :class:`~horovod_sparse.common.stall.ExchangeStalled`
        (:mod:`horovod_sparse.common.stall`)."""
        with self.timer("communicate"):
            outputs = [pending.comm._finish(pending) for pending in pendings]
        for pending in pendings:
            pending.comm._under_way = True
        return outputs

    def _finish(self, pending: Pending) -> Any:
        """Wait for one collective this communicator launched, account for what it received and
        return its output."""
        limit = self._stall_seconds if self._under_way else None
        try:
            output = self._complete(pending.handle, limit)
        except TimeoutError:
            ranks = self.member_ranks()
            raise ExchangeStalled(self.name, self.step, ranks[self.rank], ranks, self._name(pending.tag),
                                  float(limit or 0)) from None
        tensor = output[0] if isinstance(output, tuple) else output
        self.stats.received[pending.kind] += (nbytes(tensor) - pending.own_bytes if pending.received is None
                                              else pending.received)
        return output

    def remove_delivered(self, x: torch.Tensor, idx: Optional[torch.Tensor],
                         wire_values: torch.Tensor) -> torch.Tensor:
        """Residual update: subtract from ``x`` what this rank delivered at ``idx`` (distinct
        indices; None: every coordinate, ``wire_values`` of ``x``'s length with +0.0 where nothing
        was sent). Every change a sparsifier makes to its residual goes through here.

        Subtracting the wire values (rather than zeroing) keeps float16 rounding error in the
        residual, so error feedback loses nothing even with ``fp16_values``. Deliveries are
        recorded so that :meth:`undo_deliveries` can put them back when a step is abandoned.
        Returns ``x``, changed in place.
        """
        self._deliveries.append((x, idx, wire_values))
        if idx is None:
            return x.sub_(wire_values.to(x.dtype))
        return x.index_add_(0, idx, wire_values.to(x.dtype), alpha=-1)

    def undo_deliveries(self) -> None:
        """Add back everything :meth:`remove_delivered` took out of the residual this step."""
        for x, idx, wire_values in reversed(self._deliveries):
            if idx is None:
                x.add_(wire_values.to(x.dtype))
            else:
                x.index_add_(0, idx, wire_values.to(x.dtype))
        self._deliveries.clear()

    def timer(self, phase: str) -> ContextManager[None]:
        """Accumulate the time of the enclosed block under ``phase`` in the group's stats: the
        wall time on the host, the device's time between CUDA events on a GPU (:func:`cuda_timed`)."""
        if self.device is not None and self.device.type == "cuda":
            return cuda_timed(self.stats, phase, self.device)
        return timed(self.stats.add_time, phase)
