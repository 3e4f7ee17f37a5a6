"""MiCRO (Yoon & Oh, HiPC 2023), TensorFlow: exclusive rotating partitions, one threshold, union
allreduce.

The port of :mod:`horovod_sparse.torch.sparsifiers.micro`, step for step: rank ``r`` scans the
partition ``(step + r) mod n`` of the group's flat buffer, selects ``|x| >= threshold`` there
with the threshold every rank derives identically (:mod:`horovod_sparse.common.controllers`; the
default histogram controller first allreduces a small histogram), allgathers the selected
indices and counts, and allreduces (sum) every rank's ``x`` at the union; every rank then
removes its own contribution at the whole union from its residual. Partition tables, thresholds
and the ExDyna balancers are the shared framework-free code, so both frameworks decide the same.

Eager mode only (``traceable = False``): the threshold and partition table of a step are
computed in Python from the values gathered in that step, and the values allreduce is skipped on
every rank when the union is empty.

Statistics per group (``GroupStats.extra``): ``threshold``, ``counts`` (per rank), ``load_inc``,
``padding``, ``bounds`` (the partition table used), ``select_seconds`` and, with the histogram
controller, ``histogram_rounds``.
"""
from __future__ import annotations

from typing import Any, Generator, List, Sequence, Tuple

import tensorflow as tf

from horovod_sparse.common.controllers import (histogram_exchange, histogram_threshold, make_controller,
                                               scan_block_size)
from horovod_sparse.common.partitioned import MicroOptions, PartitionedState, make_partitions
from horovod_sparse.common.partitions import allgather_padding, counts_by_partition, load_inc, owned_partition
from horovod_sparse.common.registry import implements
from horovod_sparse.common.timing import PhaseTimer
from horovod_sparse.tensorflow.collectives import Communicator, Pending, index_dtype
from horovod_sparse.tensorflow.selection import Candidates, pick, scan
from horovod_sparse.tensorflow.sparsifier import Exchange, Sparsifier


@implements("tensorflow", "micro")
class Micro(Sparsifier):
    """MiCRO on the whole model's flat buffer (``groups="model"`` by default)."""

    default_grouping = "model"
    traceable = False

    def __init__(self, options: MicroOptions) -> None:
        super().__init__(options)
        self.controller = make_controller(options.controller)
        self.partitions = make_partitions(options)

    def new_state(self, numel: int, world_size: int) -> PartitionedState:
        return self.partitions.new_state(numel, world_size)

    def exchange(self, x: tf.Tensor, comm: Communicator, state: PartitionedState, step: int) -> Exchange:
        numel, size = int(x.shape[0]), comm.size
        bounds = self.partitions.bounds(state)
        owned = owned_partition(step, comm.rank, size)
        timer = PhaseTimer()
        idx, threshold = yield from self._select(x, bounds, owned, comm, state, step, timer)
        comm.stats.add_time("select", timer.total)

        selected = int(tf.size(idx))
        count = tf.constant([selected], dtype=tf.int64)
        gathered, counts_out = yield [comm.allgather(tf.cast(idx, index_dtype(numel)), "indices", "indices"),
                                      comm.allgather(count, "counts", "meta")]
        union, counts = tf.cast(gathered, tf.int64), [int(c) for c in counts_out.numpy()]
        update, residual = tf.zeros_like(x), x
        if int(tf.size(union)):
            wire = self.to_wire(tf.gather(x, union))
            residual = self.remove_delivered(x, union, wire)
            (total,) = yield [comm.allreduce(wire, "values", "values")]
            with comm.timer("apply"):
                update = tf.tensor_scatter_nd_update(update, tf.expand_dims(union, 1),
                                                     tf.cast(total, x.dtype) * comm.scale)

        state.threshold.record(counts_by_partition(counts, step))
        self.partitions.observe(state, step, counts)
        comm.stats.selected = selected
        comm.stats.union = int(tf.size(union))
        comm.stats.extra.update(threshold=threshold, counts=counts, load_inc=load_inc(counts),
                                padding=allgather_padding(counts), bounds=bounds,
                                select_seconds=timer.seconds)
        return update, residual

    def _select(self, x: tf.Tensor, bounds: List[int], owned: int, comm: Communicator,
                state: PartitionedState, step: int, timer: PhaseTimer
                ) -> Generator[Sequence[Pending], List[Any], Tuple[tf.Tensor, float]]:
        """This rank's selection ``|x| >= threshold`` over its partition ``owned`` and the
        threshold; with a histogram controller, after the allreduces of the histogram rounds
        (:func:`~horovod_sparse.common.controllers.histogram_threshold`)."""
        k = self.options.count(int(x.shape[0]), step)
        with timer("scan"):
            scanned = scan(x, bounds[owned], bounds[owned + 1], scan_block_size(self.options.density_at(step)))
        if self.controller.window(state.threshold) is None:  # a rule that needs no histogram
            threshold = self.controller.next_threshold(state.threshold, k, None)
            with timer("pick"):
                return pick(scanned, threshold), threshold
        plan = histogram_threshold(self.controller, state.threshold, k, comm.size, owned, comm.rank,
                                   lambda budget: Candidates.collect(scanned, budget))
        threshold, candidates, rounds = yield from histogram_exchange(
            plan, lambda r: comm.allreduce(tf.constant(r.local), r.tag, "meta"), lambda summed: summed.numpy(), timer)
        comm.stats.extra["histogram_rounds"] = rounds
        with timer("pick"):
            return candidates.select(threshold), threshold
