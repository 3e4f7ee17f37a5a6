"""The communicator protocol: the collectives every method is written against, beside
:class:`~horovod_sparse.methods.backend.Backend`'s tensor primitives.

A method never calls a collective library. Its exchange receives a ``comm`` for one group in one
step (each front end's subclass of :class:`~horovod_sparse.common.communicator.CommunicatorBase`:
Horovod's for PyTorch and TensorFlow, ``torch.distributed``'s), asks it to *launch* collectives,
yields the pendings it needs and, resumed with their outputs, goes on.

Contracts shared by every collective:
    * every rank of the process set launches the same collectives of a group in the same order,
      with the same ``tag`` (the collective's name is ``hs.<group>.<tag>``);
    * ``kind`` names what the payload is (``"values"``, ``"indices"``, ...): its bytes are
      accounted under it in :attr:`Comm.stats`;
    * a launch returns a pending that only :meth:`Comm.wait` resolves.
"""
from __future__ import annotations

from typing import Any, ContextManager, List, Optional, Protocol, Sequence, Tuple

from horovod_sparse.common.stats import GroupStats

Tensor = Any


class Comm(Protocol):
    """One group's collectives in one step, as a method's exchange sees them."""

    #: The ranks of the process set the method runs over, and this one's rank in it.
    size: int
    rank: int
    #: The factor the summed update is multiplied by (``1 / size`` of the job for an average).
    scale: float
    #: The group's statistics record for this step.
    stats: GroupStats
    #: The zeroed buffer :meth:`output` hands out (the front end's, reused every step), or None.
    output_buffer: Optional[Tensor]
    #: The shapes of the group's parameters, in the order its buffer holds them, where the buffer
    #: is those whole parameters (None: a node's slice in two tiers, FSDP2's shards, TensorFlow).
    shapes: Optional[Sequence[Tuple[int, ...]]]

    def allgather(self, tensor: Tensor, tag: str, kind: str, rows: Any = None) -> Any:
        """Launch a variable-length allgather along dim 0 (``rows``: what every rank knows of the
        per-rank row counts, :data:`~horovod_sparse.common.communicator.Rows`)."""

    def allreduce(self, tensor: Tensor, tag: str, kind: str) -> Any:
        """Launch a sum of ``tensor`` over the ranks."""

    def alltoall(self, tensor: Tensor, splits: Sequence[int], tag: str, kind: str) -> Any:
        """Launch an alltoall of ``tensor``'s rows, ``splits[r]`` of them to rank ``r``; its output
        is ``(output, received_splits)``."""

    def reducescatter(self, tensor: Tensor, tag: str, kind: str) -> Any:
        """Launch a sum of the 1-D ``tensor`` of which this rank receives its slice
        (:func:`~horovod_sparse.common.tiers.slice_bounds`)."""

    def wait(self, pendings: Sequence[Any]) -> List[Any]:
        """Wait for ``pendings`` and return their outputs, in order."""

    def output(self, x: Tensor) -> Tensor:
        """The zeroed buffer the aggregated update of ``x``'s group is written into."""

    def remove_delivered(self, x: Tensor, idx: Optional[Tensor], wire_values: Tensor) -> Tensor:
        """Subtract from the residual ``x`` what this rank delivered at ``idx`` (as it went on the
        wire; ``idx`` None, on an accelerator only: every coordinate, a masked payload of ``x``'s
        length); every change a method makes to its residual goes through here. Returns ``x``."""

    def timer(self, phase: str) -> ContextManager[None]:
        """Accumulate the time of the enclosed block under ``phase`` in :attr:`stats`."""
