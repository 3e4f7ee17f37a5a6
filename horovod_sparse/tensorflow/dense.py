"""Horovod's own dense allreduce in a TensorFlow exchange: the whole exchange with Horovod's
``Compression.none`` / ``Compression.fp16`` (exactly ``horovod.tensorflow``'s gradient-allreduce
function: same ops, names and grouping), and with a sparsifier the groups planned dense
(warm-up, ``min_numel``, ``dense=``); with the statistics of both."""
from __future__ import annotations

from typing import Any, List, NamedTuple, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_sparse.common.grouping import Buckets, MergeBySize
from horovod_sparse.common.mergecomp import MergeCompOptions
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.tensorflow import recording
from horovod_sparse.tensorflow.buffers import FlatGroup
from horovod_sparse.tensorflow.collectives import eager_capable, nbytes


def horovod_groups(groups: Any) -> Any:
    """``groups=`` for Horovod's own dense reduction: its int and lists of variables as they are,
    ``"tensor"`` as no grouping and ``"model"`` as one group; other strategies only shape the
    flat buffers of a sparsifier."""
    mergecomp = MergeCompOptions.from_spec(groups) is not None
    if isinstance(groups, str) and groups in ("tensor", "model"):
        return None if groups == "tensor" else 1
    if not isinstance(groups, (str, Buckets, MergeBySize)) and not mergecomp:
        return groups
    named = "groups='mergecomp' (MergeComp)" if mergecomp else f"groups={str(groups)!r}"
    raise ValueError(f"{named} sets the flat buffers of a sparsifier; with Horovod's dense compressors "
                     "pass an int, lists of variables, 'tensor' or 'model'")


class PlannedDense(NamedTuple):
    """A group the step engine planned dense this step: a
    :class:`~horovod_sparse.engine.flight.Flight` whose allreduce runs with the step's other
    dense groups, in one Horovod call (:meth:`DenseExchange._exchange_dense_groups`)."""

    group: FlatGroup
    stats: GroupStats
    sparse: bool = False

    def finish(self) -> None:
        """Nothing to wait for here: the step's dense groups are reduced together."""


class DenseExchange:
    """The dense exchanges of :class:`~horovod_sparse.tensorflow.exchanger.GradientExchanger` (a
    base of it): it reads the exchanger's ``_horovod_reduce`` (Horovod's allreduce function),
    ``compression``, ``sparse``, ``process_set`` and layouts."""

    @tf.autograph.experimental.do_not_convert
    def _exchange_dense(self, grads: Sequence[Any], sources: Sequence[Any], use_generic_names: bool) -> List[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        layout = None
        # Horovod's reduction needs nothing of ours; the layout only feeds the statistics, which
        # a TF1-style graph (no eager collectives, even at trace time) goes without.
        if present and self.process_set.included() and eager_capable():
            layout = self._layout([grads[i] for i in present], [sources[i] for i in present])
        reduced = self._horovod_reduce(list(grads), list(sources), use_generic_names)
        if layout is not None:
            counter = layout.step_counter()
            engine = layout.engine
            engine.begin(counter.read_value())
            for group in layout.groups:
                _, stats = engine.plan(group.name, group.numel, True, group.kept_dense)
                self._account_dense(stats, [grads[present[i]] for i in group.positions])
            counter.assign_add(1)
            recording.publish(engine.stats, self._record)
        return reduced

    def _account_dense(self, stats: GroupStats, grads: Sequence[Any]) -> None:
        """Fill a dense group's ``stats`` as Horovod's allreduce moves its ``grads`` (one collective
        per gradient)."""
        stats.selected = stats.union = stats.numel
        stats.collectives = len(grads)
        for grad in grads:
            if isinstance(grad, tf.IndexedSlices):
                stats.sent["values"] += nbytes(grad.values)
                stats.sent["indices"] += nbytes(grad.indices)
            else:
                wire_bytes = nbytes(grad) // grad.dtype.size * self._dense_wire_itemsize(grad.dtype)
                stats.sent["values"] += wire_bytes
                stats.received["values"] += wire_bytes

    def _dense_wire_itemsize(self, dtype: tf.DType) -> int:
        """Bytes per element of a dense allreduce: 2 for floats under ``Compression.fp16``."""
        fp16 = not self.sparse and self.compression is hvd.Compression.fp16
        return tf.float16.size if fp16 and dtype.is_floating else dtype.size

    def _exchange_dense_groups(self, planned: Sequence[PlannedDense], kept: List[Any], results: List[Any]) -> None:
        """Horovod's dense allreduce for the step's groups ``planned`` dense, in one call, with
        their statistics."""
        if not planned:
            return
        positions = [p for each in planned for p in each.group.positions]
        # Horovod's TensorFlow allreduce does not take bfloat16: such gradients travel as float32.
        wire = [tf.cast(kept[p], tf.float32) if kept[p].dtype == tf.bfloat16 else kept[p] for p in positions]
        for position, value in zip(positions, self._horovod_reduce(wire)):
            results[position] = tf.cast(value, kept[position].dtype)
        for each in planned:
            self._account_dense(each.stats, [kept[p] for p in each.group.positions])
