"""Horovod collectives as a sparsifier sees them: named, counted and timed (TensorFlow).

The counterpart of :mod:`horovod_sparse.torch.collectives`, with the same protocol: a sparsifier
never calls Horovod directly; it asks a :class:`Communicator` to *launch* a collective, which
returns a :class:`Pending`, and yields the pendings it needs to the driver, which waits for them
(:meth:`Communicator.wait`) and sends the outputs back. Every collective is named
``hs.<group>.<tag>`` (identical on every rank, unique per step), issued on the driver's process
set, and its payload bytes land in the group's :class:`~horovod_sparse.common.stats.GroupStats`.

TensorFlow differences: ``horovod.tensorflow``'s collectives are ops. In eager mode an op has
finished when the call returns, so "launch" does the work and "wait" only hands the outputs
over; inside a ``tf.function`` the ops are symbolic and TensorFlow runs them as their inputs
become ready. Byte counts are Python ints where shapes are static and int64 scalar tensors where
they are not (a variable-length allgather traced in a graph); the driver materialises them (see
:mod:`horovod_sparse.tensorflow.recording`). Wall times are only measured in eager mode.
"""
from __future__ import annotations

import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, List, Optional, Sequence, Tuple, Union

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_sparse.common.communicator import CommunicatorBase, Rows
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.common.tiers import slice_bounds
from horovod_sparse.common.timing import timed

#: A byte count: a Python int when the shape is static, else an int64 scalar tensor.
ByteCount = Union[int, tf.Tensor]


@dataclass
class Pending:
    """A launched collective: its output (eager or symbolic) plus what accounting needs."""

    output: Any
    kind: str
    #: bytes of the output that this rank contributed itself (not received from others).
    own_bytes: ByteCount
    #: bytes received from the other ranks where they are not the output less ``own_bytes``
    #: (a reduce-scatter: every other rank's contribution to this rank's slice).
    received: Optional[int] = None


def nbytes(tensor: tf.Tensor) -> ByteCount:
    """Payload size of ``tensor`` in bytes: an int for a static shape, else an int64 tensor."""
    count = tensor.shape.num_elements()
    if count is not None:
        return count * tensor.dtype.size
    return tf.size(tensor, out_type=tf.int64) * tensor.dtype.size


def index_dtype(numel: int) -> tf.DType:
    """int32 for buffers below 2**31 elements, int64 beyond."""
    return tf.int32 if numel < 2 ** 31 else tf.int64


def allgather_bytes(payload: bytes, name: str, process_set: hvd.ProcessSet) -> List[bytes]:
    """Every rank's ``payload``, in rank order (blocking; for rare metadata only).

    Runs eagerly even while a ``tf.function`` is being traced (``tf.init_scope``), so it can
    check something once, at trace time, on every rank. Unlike ``hvd.allgather_object`` in
    Horovod 0.28.1 it honours ``process_set``.
    """
    with tf.init_scope():
        tensor = tf.constant(np.frombuffer(payload, dtype=np.uint8))
        sizes = hvd.allgather(tf.constant([len(payload)], dtype=tf.int64), name=op_name(f"{name}.sizes"),
                              ignore_name_scope=True, process_set=process_set)
        data = hvd.allgather(tensor, name=op_name(f"{name}.data"), ignore_name_scope=True,
                             process_set=process_set).numpy()
    ends = np.cumsum(sizes.numpy())
    return [data[end - size:end].tobytes() for end, size in zip(ends, sizes.numpy())]


def allgather_array(array: np.ndarray, process_set: hvd.ProcessSet, name: str) -> np.ndarray:
    """Every rank's ``array`` concatenated along the first axis, in rank order (blocking; runs
    eagerly even while a ``tf.function`` is traced, as :func:`allgather_bytes` does)."""
    with tf.init_scope():
        return hvd.allgather(tf.constant(array), name=op_name(name), ignore_name_scope=True,
                             process_set=process_set).numpy()


def gather_places(place: Tuple[int, int]) -> List[Tuple[int, int]]:
    """Every rank's ``(cross_rank, local_rank)``, in rank order (blocking, eager, global)."""
    rows = hvd.allgather(tf.constant([list(place)], tf.int64), name="hs.tiers.places", ignore_name_scope=True)
    return [(int(node), int(local)) for node, local in rows.numpy().tolist()]


def allgather_payload(numel: int, like: Optional[tf.Tensor], process_set: hvd.ProcessSet, name: str) -> None:
    """Allgather ``numel`` float32 zeros on ``like``'s device (the default one when None) and
    wait for the result (what the alpha-beta calibration times)."""
    with tf.init_scope(), tf.device(None if like is None else like.device):
        hvd.allgather(tf.zeros([numel], tf.float32), name=op_name(name), ignore_name_scope=True,
                      process_set=process_set).numpy()


def eager_capable() -> bool:
    """Whether collectives can run eagerly here: in eager mode, or inside a ``tf.function``
    (lifted out by ``tf.init_scope``), but not in a TF1-style graph (``tf.compat.v1`` sessions)."""
    with tf.init_scope():
        return tf.executing_eagerly()


def op_name(text: str) -> str:
    """``text`` made a valid TensorFlow op name (Horovod matches collectives by this name)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", text)


class Communicator(CommunicatorBase):
    """Launches Horovod collectives for one group in one step and accounts for them.

    When traced, every collective is made to run after the previous one of the same group
    (after ``anchor`` for the first). Horovod's ops are not marked stateful, so a graph
    optimiser may merge two collectives whose inputs are equal (say two empty payloads of an idle
    rank) or drop one whose output is unused, and then that rank never takes part in the other
    ranks' collective. The chain of control dependencies gives every collective distinct inputs
    and the same order on every rank, as in eager mode; the driver makes the update depend on all
    of them (:attr:`launched`).

    Arguments as :class:`~horovod_sparse.common.communicator.CommunicatorBase` (collective names
    made op-name safe); the step engine's ``device`` and ``step`` are not used. The first
    collective waits, when traced, for the tensor of this group and step given to :meth:`order_after`
    (its flat buffer).
    """

    def __init__(self, process_set: hvd.ProcessSet, name: str, stats: GroupStats, scale: float,
                 size: Optional[int] = None, rank: Optional[int] = None, device: Any = None, step: Any = None) -> None:
        super().__init__(process_set, name, stats, scale, size, rank)
        #: The output tensors of every collective launched, in order.
        self.launched: List[tf.Tensor] = []
        self._after: List[tf.Tensor] = []
        #: Unused: TensorFlow's exchanges start from :meth:`output`'s zeros.
        self.output_buffer: Optional[tf.Tensor] = None

    def order_after(self, x: tf.Tensor) -> None:
        """Make the first collective wait for ``x`` when traced (see the class docstring)."""
        self._after = [x]

    def _name(self, tag: str) -> str:
        return op_name(super()._name(tag))

    @contextmanager
    def _in_order(self) -> Iterator[None]:
        """Traced: run the enclosed collective after the previous one (see the class docstring)."""
        if tf.executing_eagerly():
            yield
            return
        with tf.control_dependencies(self._after):
            yield

    def _launched(self, output: Any, kind: str, sent: ByteCount, own: ByteCount,
                  received: Optional[int] = None) -> Pending:
        outputs = output if isinstance(output, tuple) else (output,)
        self.launched.extend(outputs)
        self._after = [outputs[0]]
        self._account(kind, sent)
        return Pending(output, kind, own, received)

    def allgather(self, tensor: tf.Tensor, tag: str, kind: str, rows: Rows = None) -> Pending:
        """Variable-length allgather along dim 0 (tensors of rank >= 1; length 0 is allowed;
        ``rows``: see :class:`~horovod_sparse.common.communicator.CommunicatorBase`, unused)."""
        with self.timer("communicate"), self._in_order():
            output = hvd.allgather(tensor, name=self._name(tag), ignore_name_scope=True,
                                   process_set=self.process_set)
        return self._launched(output, kind, sent=nbytes(tensor), own=nbytes(tensor))

    def allreduce(self, tensor: tf.Tensor, tag: str, kind: str, op: Any = hvd.Sum,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Pending:
        """Allreduce of ``tensor`` (Horovod's ``_allreduce``: no compression, no averaging
        beyond ``op``)."""
        with self.timer("communicate"), self._in_order():
            output = hvd._allreduce(tensor, name=self._name(tag), op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, ignore_name_scope=True,
                                    process_set=self.process_set)
        return self._launched(output, kind, sent=nbytes(tensor), own=0)

    def reducescatter(self, tensor: tf.Tensor, tag: str, kind: str) -> Pending:
        """Sum ``tensor`` (static length) over the process set and hand rank ``r`` its slice of
        the sum (:func:`~horovod_sparse.common.tiers.slice_bounds`, Horovod's split)."""
        numel = tensor.shape.num_elements()
        lo, hi = slice_bounds(numel, self.size, self.rank)
        with self.timer("communicate"), self._in_order():
            output = hvd._reducescatter(tensor, name=self._name(tag), op=hvd.Sum, ignore_name_scope=True,
                                        process_set=self.process_set)
        output = tf.reshape(output, [hi - lo])  # the length a traced op cannot infer
        sent, own, received = self._slice_bytes(numel, tensor.dtype.size)
        return self._launched(output, kind, sent, own, received)

    def alltoall(self, tensor: tf.Tensor, splits: Union[Sequence[int], tf.Tensor], tag: str, kind: str,
                 received: Optional[Sequence[Any]] = None) -> Pending:
        """Alltoall with explicit splits (rows for each rank, a list of ints or an int32 tensor);
        a split non-zero only for one peer is a point-to-point send. The output is
        ``(tensor, received_splits)``. ``received`` (the rows from each rank, when the caller
        knows them) is unused: Horovod negotiates sizes itself."""
        with self.timer("communicate"), self._in_order():
            output = hvd.alltoall(tensor, splits=tf.constant(splits, dtype=tf.int32)
                                  if isinstance(splits, (list, tuple)) else splits,
                                  name=self._name(tag), ignore_name_scope=True, process_set=self.process_set)
        row_bytes = tensor.shape[1:].num_elements() * tensor.dtype.size
        if isinstance(splits, (list, tuple)):
            own: ByteCount = int(splits[self.rank]) * row_bytes
        else:
            own = tf.cast(splits[self.rank], tf.int64) * row_bytes
            if tf.executing_eagerly():
                own = int(own)
        return self._launched(output, kind, sent=nbytes(tensor) - own, own=own)

    @staticmethod
    def output(x: tf.Tensor) -> tf.Tensor:
        """Zeros of ``x``'s shape: the start of the aggregated update of ``x``'s group."""
        return tf.zeros_like(x)

    @staticmethod
    def remove_delivered(x: tf.Tensor, idx: tf.Tensor, wire_values: tf.Tensor) -> tf.Tensor:
        """Residual update: ``x`` minus what was delivered at ``idx`` (distinct indices).

        Subtracting the wire values (rather than zeroing) keeps the float16 rounding error in
        the residual, so error feedback loses nothing even with ``fp16_values``. An abandoned
        step needs no undo here: the driver keeps the old residual.
        """
        return tf.tensor_scatter_nd_sub(x, tf.expand_dims(idx, 1), tf.cast(wire_values, x.dtype))

    def wait(self, pendings: Sequence[Pending]) -> List[Any]:
        """The outputs of ``pendings`` (alltoall: ``(output, received_splits)``), with the bytes
        received from other ranks accounted."""
        outputs = []
        for pending in pendings:
            outputs.append(pending.output)
            tensor = pending.output[0] if isinstance(pending.output, tuple) else pending.output
            self.stats.received[pending.kind] += (nbytes(tensor) - pending.own_bytes if pending.received is None
                                                  else pending.received)
        return outputs

    def timer(self, phase: str) -> ContextManager[None]:
        """Accumulate the wall time of the enclosed block under ``phase`` in the group's stats
        (eager mode only; see :func:`phase_timer`)."""
        return phase_timer(self.stats, phase)


def phase_timer(stats: GroupStats, phase: str) -> ContextManager[None]:
    """Accumulate the wall time of the enclosed block under ``phase`` in ``stats``, in eager
    mode only: while tracing, Python time says nothing about the step."""
    return timed(stats.add_time, phase) if tf.executing_eagerly() else nullcontext()
