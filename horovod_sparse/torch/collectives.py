"""Horovod collectives as a sparsifier sees them: named, counted and timed.

A sparsifier never calls Horovod directly. It asks a :class:`Communicator` to *launch* a
collective, which returns a :class:`Pending`, and yields the pendings it needs to the
optimizer, which waits for them (:meth:`Communicator.wait`) and sends the outputs back. So every
collective is named ``hs.<group>.<tag>`` (identical on every rank, unique per step), issued on
the optimizer's process set, and its payload bytes and wait time land in the group's
:class:`~horovod_sparse.common.stats.GroupStats`.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import numpy as np
import torch

from horovod_sparse.common.communicator import CommunicatorBase
from horovod_sparse.common.consensus import json_bytes
from horovod_sparse.common.stats import GroupStats


@dataclass
class Pending:
    """A launched collective: Horovod's handle plus what is needed to account for it."""

    handle: Any
    kind: str
    #: bytes of the output that this rank contributed itself (not received from others).
    own_bytes: int


def nbytes(tensor: torch.Tensor) -> int:
    """Payload size of ``tensor`` in bytes."""
    return tensor.numel() * tensor.element_size()


def allgather_bytes(payload: bytes, name: str, process_set: hvd.ProcessSet) -> List[bytes]:
    """Every rank's ``payload``, in rank order (blocking; for rare metadata only). Unlike
    ``hvd.allgather_object`` in Horovod 0.28.1 it honours ``process_set``."""
    tensor = torch.tensor(list(payload), dtype=torch.uint8)
    sizes = hvd.allgather(torch.tensor([tensor.numel()]), name=f"{name}.sizes", process_set=process_set)
    data = hvd.allgather(tensor, name=f"{name}.data", process_set=process_set)
    return [bytes(chunk.tolist()) for chunk in data.split(sizes.tolist())]


def allgather_array(array: np.ndarray, process_set: hvd.ProcessSet, name: str) -> np.ndarray:
    """Every rank's ``array`` concatenated along the first axis, in rank order (blocking)."""
    return hvd.allgather(torch.from_numpy(np.ascontiguousarray(array)), name=name, process_set=process_set).numpy()


def allgather_json(obj: Any, name: str, process_set: hvd.ProcessSet) -> List[Any]:
    """Every rank's JSON-serialisable ``obj``, in rank order (see :func:`allgather_bytes`)."""
    return [json.loads(text) for text in allgather_bytes(json_bytes(obj), name, process_set)]


def index_dtype(numel: int) -> torch.dtype:
    """int32 for buffers below 2**31 elements, int64 beyond."""
    return torch.int32 if numel < 2 ** 31 else torch.int64


class Communicator(CommunicatorBase):
    """Launches Horovod collectives for one group in one step and accounts for them (arguments:
    :class:`~horovod_sparse.common.communicator.CommunicatorBase`)."""

    def __init__(self, process_set: hvd.ProcessSet, name: str, stats: GroupStats, scale: float,
                 size: Optional[int] = None, rank: Optional[int] = None) -> None:
        super().__init__(process_set, name, stats, scale, size, rank)
        self._deliveries: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        #: The zeroed buffer :meth:`output` hands out (the front end's, reused every step).
        self.output_buffer: Optional[torch.Tensor] = None

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The zeroed buffer the aggregated update of ``x``'s group is written into."""
        return torch.zeros_like(x) if self.output_buffer is None else self.output_buffer

    def _launched(self, handle: Any, kind: str, sent: int, own: int) -> Pending:
        self._account(kind, sent)
        return Pending(handle, kind, own)

    def allgather(self, tensor: torch.Tensor, tag: str, kind: str) -> Pending:
        """Variable-length allgather along dim 0 (tensors of rank >= 1; length 0 is allowed)."""
        handle = hvd.allgather_async(tensor, name=self._name(tag), process_set=self.process_set)
        return self._launched(handle, kind, sent=nbytes(tensor), own=nbytes(tensor))

    def allreduce(self, tensor: torch.Tensor, tag: str, kind: str, op: Any = hvd.Sum,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Pending:
        """In-place allreduce of ``tensor`` (Horovod's ``allreduce_async_``)."""
        handle = hvd.allreduce_async_(tensor, name=self._name(tag), op=op, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor, process_set=self.process_set)
        return self._launched(handle, kind, sent=nbytes(tensor), own=0)

    def alltoall(self, tensor: torch.Tensor, splits: torch.Tensor, tag: str, kind: str) -> Pending:
        """Alltoall with explicit splits; a split non-zero only for one peer is a point-to-point send."""
        handle = hvd.alltoall_async(tensor, splits=splits, name=self._name(tag), process_set=self.process_set)
        row_bytes = nbytes(tensor) // tensor.shape[0] if tensor.shape[0] else 0
        own = int(splits[self.rank]) * row_bytes
        return self._launched(handle, kind, sent=nbytes(tensor) - own, own=own)

    def wait(self, pendings: Sequence[Pending]) -> List[Any]:
        """Wait for ``pendings`` and return their outputs (alltoall: ``(output, received_splits)``)."""
        outputs = []
        with self.timer("communicate"):
            for pending in pendings:
                output = hvd.synchronize(pending.handle)
                outputs.append(output)
                tensor = output[0] if isinstance(output, tuple) else output
                self.stats.received[pending.kind] += nbytes(tensor) - pending.own_bytes
        return outputs

    def remove_delivered(self, x: torch.Tensor, idx: torch.Tensor, wire_values: torch.Tensor) -> torch.Tensor:
        """Residual update: subtract from ``x`` what this rank delivered at ``idx`` (distinct
        indices). Every change a sparsifier makes to its residual goes through here.

        Subtracting the wire values (rather than zeroing) keeps float16 rounding error in the
        residual, so error feedback loses nothing even with ``fp16_values``. Deliveries are
        recorded so that :meth:`undo_deliveries` can put them back when a step is abandoned.
        Returns ``x``, changed in place.
        """
        self._deliveries.append((x, idx, wire_values))
        return x.index_add_(0, idx, wire_values.to(x.dtype), alpha=-1)

    def undo_deliveries(self) -> None:
        """Add back everything :meth:`remove_delivered` took out of the residual this step."""
        for x, idx, wire_values in reversed(self._deliveries):
            x.index_add_(0, idx, wire_values.to(x.dtype))
        self._deliveries.clear()

    @contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        """Accumulate the wall time of the enclosed block under ``phase`` in the group's stats."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stats.add_time(phase, time.perf_counter() - start)

