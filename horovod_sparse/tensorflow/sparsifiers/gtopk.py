"""gTop-k (Shi et al., ICDCS 2019): the global top-k of the summed gradient, O(k log n) traffic.

The TensorFlow port of :mod:`horovod_sparse.torch.sparsifiers.gtopk`, with the same schedule
(:mod:`horovod_sparse.common.butterfly`: fold-in, recursive-doubling rounds, fold-out), the same
point-to-point ``alltoall`` exchanges and tags, the same merge (values added at common indices,
top-k of the candidates by magnitude, ties to the lower index:
:func:`horovod_sparse.tensorflow.selection.top_k`) and the same residual rules
(``residual="exact"`` tracks which of this rank's coordinates survive every merge). Every rank
ends with the identical global set of exactly ``k`` coordinates and returns
``update[idx_g] = val_g * scale``.

Traceable: the schedule is fixed by the world size, so the rounds unroll into the graph
(``recall_every`` needs eager mode: its extra allreduce runs on some steps only).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import tensorflow as tf

from horovod_sparse.common.butterfly import FOLD_IN, Phase, SparseSet, butterfly_schedule, round_count
from horovod_sparse.common.registry import implements
from horovod_sparse.tensorflow.collectives import Communicator, Pending, index_dtype
from horovod_sparse.tensorflow.selection import top_k
from horovod_sparse.tensorflow.sparsifier import Exchange, Sparsifier, Step


def merge(a: SparseSet, b: SparseSet, k: Union[int, tf.Tensor], dtype: tf.DType) -> SparseSet:
    """Sum two sets (at common indices), keep the top-k by magnitude, ties to the lower index.

    Symmetric: each sum has at most two terms. Sums are formed in ``dtype``; the result keeps
    the values' dtype. With ``k`` entries in each input the result has ``k``.
    """
    indices = tf.concat([a.idx, b.idx], 0)
    values = tf.cast(tf.concat([a.val, b.val], 0), dtype)
    order = tf.argsort(indices, stable=True)
    idx, position = tf.unique(tf.gather(indices, order), out_idx=tf.int64)
    summed = tf.math.unsorted_segment_sum(tf.gather(values, order), position, tf.size(idx, out_type=tf.int64))
    keep = top_k(summed, k)  # idx is ascending: ties to the lower position are to the lower index
    return SparseSet(tf.gather(idx, keep), tf.cast(tf.gather(summed, keep), a.val.dtype))


def isin(values: tf.Tensor, ascending: tf.Tensor) -> tf.Tensor:
    """Mask of the entries of ``values`` (non-negative indices) present in the ascending tensor
    ``ascending`` (a -1 sentinel keeps the lookup in range when nothing is found)."""
    position = tf.searchsorted(ascending, values, side="left", out_type=tf.int64)
    padded = tf.concat([ascending, tf.constant([-1], dtype=ascending.dtype)], 0)
    return tf.equal(tf.gather(padded, position), values)


def carried(indices: tf.Tensor, held: SparseSet) -> tf.Tensor:
    """The part of ``indices`` still present in ``held``."""
    return tf.boolean_mask(indices, isin(indices, held.idx))


@implements("tensorflow", "gtopk")
class GTopK(Sparsifier):
    """Global top-k: exactly ``k = max(1, int(density * numel))`` coordinates of the sum over
    ranks reach the model each step, with ``k * log2(n)`` (value, index) pairs sent per rank.

    Statistics (``GroupStats.extra``) as on the PyTorch side: ``rounds``, ``phases``,
    ``bytes_per_round``, ``delivered`` and, on debug steps (``recall_every``), ``recall`` and
    ``recall_mass`` (see :func:`recall`).
    """

    default_grouping = "model"

    def new_state(self, numel: int, world_size: int) -> Tuple[Phase, ...]:
        """The reduction schedule for ``world_size`` ranks."""
        return butterfly_schedule(world_size)

    def exchange(self, x: tf.Tensor, comm: Communicator, state: Tuple[Phase, ...], step: Step) -> Exchange:
        numel = int(x.shape[0])
        k = self.count(numel, step)
        with comm.timer("select"):
            local_idx = top_k(x, k)
            local = SparseSet(local_idx, self.to_wire(tf.gather(x, local_idx)))
        held = local
        # rank -> indices whose value from that rank is still in `held` (self, plus a folded rank).
        tracked: Dict[int, tf.Tensor] = {comm.rank: local.idx}
        sent_per_phase: List[object] = []
        for phase in state:
            sent_before = sum(comm.stats.sent.values())
            pendings = self._launch_phase(phase, held, tracked, numel, comm)
            sent_per_phase.append(sum(comm.stats.sent.values()) - sent_before)
            outputs = yield pendings
            source = phase.receive_from[comm.rank]
            if source is None:
                continue
            with comm.timer("merge"):
                received = SparseSet(tf.cast(outputs[1][0], tf.int64), outputs[0][0])
                if phase.adopt:
                    held = received
                    if self.options.residual == "exact":
                        tracked = {comm.rank: tf.cast(outputs[2][0], tf.int64)}
                    continue
                if phase.name == FOLD_IN:
                    tracked[source] = received.idx
                held = merge(held, received, k, x.dtype)
                tracked = {rank: carried(indices, held) for rank, indices in tracked.items()}
        if self.options.recall_every:
            if not isinstance(step, int):
                raise RuntimeError("gtopk's recall_every adds an allreduce on some steps only, which a graph "
                                   "traced once cannot do; run the step eagerly (model.compile(..., "
                                   "run_eagerly=True), or DistributedGradientTape outside tf.function) or pass "
                                   "recall_every=0")
            if step % self.options.recall_every == 0:
                (total,) = yield [comm.allreduce(x, "recall", "meta")]
                comm.stats.extra["recall"], comm.stats.extra["recall_mass"] = recall(held.idx, total, k)
        with comm.timer("apply"):
            update = tf.tensor_scatter_nd_add(tf.zeros([numel], x.dtype), tf.expand_dims(held.idx, 1),
                                              tf.cast(held.val, x.dtype) * comm.scale)
            delivered = tracked[comm.rank] if self.options.residual == "exact" else carried(local.idx, held)
            residual = self.remove_delivered(x, delivered, tf.boolean_mask(local.val, isin(local.idx, delivered)))
        comm.stats.selected = k
        comm.stats.union = tf.size(held.idx, out_type=tf.int64)
        comm.stats.extra.update(rounds=round_count(comm.size), phases=[p.name for p in state],
                                bytes_per_round=sent_per_phase, delivered=tf.size(delivered, out_type=tf.int64))
        return update, residual

    def _launch_phase(self, phase: Phase, held: SparseSet, tracked: Dict[int, tf.Tensor], numel: int,
                      comm: Communicator) -> List[Pending]:
        """Every rank launches the phase's alltoalls (idle ranks with nothing to send): values
        and indices of the held set, and at fold-out (``residual="exact"``) the folded rank's
        delivered indices."""
        target = phase.send_to[comm.rank]
        payload = held if target is not None else held.without_entries()
        wire_index = index_dtype(numel)
        pendings = [point_to_point(comm, payload.val, target, f"{phase.name}.values", "values"),
                    point_to_point(comm, tf.cast(payload.idx, wire_index), target, f"{phase.name}.indices",
                                   "indices")]
        if phase.adopt and self.options.residual == "exact":
            delivered = tracked[target] if target is not None else payload.idx
            pendings.append(point_to_point(comm, tf.cast(delivered, wire_index), target,
                                           f"{phase.name}.delivered", "meta"))
        return pendings


def point_to_point(comm: Communicator, tensor: tf.Tensor, target: Optional[int], tag: str, kind: str) -> Pending:
    """Send all of ``tensor`` to rank ``target`` (nothing when None) with one alltoall."""
    if target is None:
        return comm.alltoall(tensor, [0] * comm.size, tag, kind)
    rows = tensor.shape[0]
    if rows is not None:
        return comm.alltoall(tensor, [rows if rank == target else 0 for rank in range(comm.size)], tag, kind)
    # Traced with a scheduled k: the row count is only known when the step runs.
    return comm.alltoall(tensor, tf.one_hot(target, comm.size, dtype=tf.int32) * tf.shape(tensor)[0], tag, kind)


def recall(global_idx: tf.Tensor, total: tf.Tensor, k: int) -> Tuple[float, float]:
    """How close the global set ``global_idx`` is to the exact top-k of ``total`` (the sum over
    ranks of ``g + e``, same tie rule): the fraction of the exact top-k coordinates it contains,
    and the magnitude it covers, ``sum |total[global_idx]| / sum |total[exact top-k]|`` (1 when
    it is as good as the exact top-k even if it picks other coordinates)."""
    magnitude = tf.abs(total)
    exact = top_k(total, k)
    best = max(float(tf.reduce_sum(tf.gather(magnitude, exact))), 1e-30)
    covered = float(tf.reduce_sum(tf.gather(magnitude, global_idx))) / best
    return float(tf.reduce_sum(tf.cast(isin(exact, global_idx), tf.int64))) / k, covered
