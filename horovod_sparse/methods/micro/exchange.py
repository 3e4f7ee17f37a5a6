"""MiCRO (Yoon & Oh, HiPC 2023): exclusive rotating partitions, one threshold, union allreduce.

Rank ``r`` scans only the partition ``(step + r) mod n`` of the group's flat buffer
(:mod:`horovod_sparse.methods.micro.partitions`) and selects ``|x| >= threshold`` there, with the
threshold every rank derives identically (:mod:`horovod_sparse.methods.micro.controllers`). The
exchange, per group and step:

1. (``controller="histogram"`` only) allreduce of a histogram of ``|x|``, about 1 KB (in
   some steps a second one, see :mod:`horovod_sparse.methods.micro.controllers`);
2. allgather of the selected indices and of each rank's count;
3. allreduce (sum) of every rank's ``x`` at the union of the indices, so each selected
   coordinate carries the exact sum over ranks; ``update[union] = sum * scale``.

Every rank then removes its own contribution at the whole union from its residual (with
``fp16_values`` the float16 rounding stays behind), so nothing is lost and the union has exactly
``sum(counts)`` coordinates: no build-up. A rank that selects nothing sends an empty index list
and still takes part in every collective; when the union is empty on every rank, step 3 is
skipped everywhere. The threshold and partition table of a step are computed on the host from
the values gathered in that step, so a traced TensorFlow step runs the exchange on the host
(``Sparsifier.host_exchange``).

Statistics per group (``GroupStats.extra``): ``threshold``, ``counts`` (per rank),
``load_inc``, ``padding`` (elements a fixed-size allgather would have padded), ``bounds`` (the
partition table used), ``select_seconds`` (``scan``, ``histogram``, ``pick``) and, with the
histogram controller, ``histogram_rounds`` (the rounds taken: ``["histogram"]``, in some steps
followed by ``"histogram.wide"`` and/or ``"histogram.fine"``; see ``histogram_threshold``).
"""
from __future__ import annotations

from typing import Any, Generator, List, Sequence, Tuple

from horovod_sparse.common.thresholds import scan_block_size
from horovod_sparse.methods.micro.controllers import histogram_exchange, histogram_threshold, make_controller
from horovod_sparse.methods.micro.partitioned import ExDynaOptions, MicroOptions, PartitionedState, make_partitions
from horovod_sparse.methods.micro.partitions import allgather_padding, counts_by_partition, load_inc, owned_partition
from horovod_sparse.common.registry import implements
from horovod_sparse.common.timing import PhaseTimer
from horovod_sparse.methods.backend import Backend, Tensor
from horovod_sparse.methods.base import Exchange, Sparsifier
from horovod_sparse.methods.micro.candidates import Candidates


@implements("micro", MicroOptions,
            "exclusive rotating partitions, one threshold, allreduce of values at the union (no build-up)")
class Micro(Sparsifier):
    """MiCRO on the whole model's flat buffer (``groups="model"`` by default).

    Traffic per rank and step: about ``k`` indices (allgather) and ``|union|`` values
    (allreduce), plus ``n`` integers and, with the default controller, about 1 KB of histogram.
    """

    default_grouping = "model"
    host_exchange = True

    def __init__(self, options: MicroOptions, backend: Backend) -> None:
        super().__init__(options, backend)
        self.controller = make_controller(options.controller)
        self.partitions = make_partitions(options)

    def new_state(self, numel: int, world_size: int) -> PartitionedState:
        return self.partitions.new_state(numel, world_size)

    def exchange(self, x: Tensor, comm: Any, state: PartitionedState, step: int) -> Exchange:
        B = self.B
        numel = B.numel(x)
        bounds = self.partitions.bounds(state)
        owned = owned_partition(step, comm.rank, comm.size)
        timer = PhaseTimer()
        idx, threshold = yield from self._select(x, bounds, owned, comm, state, step, timer)
        comm.stats.add_time("select", timer.total)

        selected = B.size(idx)
        gathered, counts_out = yield [comm.allgather(B.wire_index(idx, numel), "indices", "indices"),
                                      self.allgather_count(selected, x, comm)]
        union, counts = B.as_index(gathered), [int(c) for c in B.to_numpy(counts_out)]
        update, residual = comm.output(x), x
        if sum(counts):
            wire = self.to_wire(B.gather(x, union))
            residual = comm.remove_delivered(x, union, wire)
            # The allreduce may write into its input (PyTorch's does), and the wire values are the
            # delivery an abandoned step puts back: it gets a copy.
            (total,) = yield [comm.allreduce(B.clone(wire), "values", "values")]
            with comm.timer("apply"):
                update = B.scatter_set(update, union, total, comm.scale)

        state.threshold.record(counts_by_partition(counts, step))
        self.partitions.observe(state, step, counts)
        comm.stats.selected = selected
        comm.stats.union = sum(counts)
        comm.stats.extra.update(threshold=threshold, counts=counts, load_inc=load_inc(counts),
                                padding=allgather_padding(counts), bounds=bounds,
                                select_seconds=timer.seconds)
        return update, residual

    def _select(self, x: Tensor, bounds: List[int], owned: int, comm: Any, state: PartitionedState, step: int,
                timer: PhaseTimer) -> Generator[Sequence[Any], List[Any], Tuple[Tensor, float]]:
        """This rank's selection ``|x| >= threshold`` over its partition ``owned`` and the
        threshold; with a histogram controller, after the allreduces of the histogram rounds
        (:func:`~horovod_sparse.methods.micro.controllers.histogram_threshold`)."""
        B = self.B
        k = self.options.count(B.numel(x), step)
        with timer("scan"):
            scanned = B.scan(x, bounds[owned], bounds[owned + 1], scan_block_size(self.options.density_at(step)))
        if self.controller.window(state.threshold) is None:  # a rule that needs no histogram
            threshold = self.controller.next_threshold(state.threshold, k, None)
            with timer("pick"):
                return B.pick(scanned, threshold), threshold
        plan = histogram_threshold(self.controller, state.threshold, k, comm.size, owned, comm.rank,
                                   lambda budget: Candidates.collect(B, scanned, budget))
        result = yield from histogram_exchange(plan, lambda r: comm.allreduce(r.local, r.tag, "meta"),
                                               B.to_numpy, timer)
        comm.stats.extra["histogram_rounds"] = result.tags
        with timer("pick"):
            return result.candidates.select(result.threshold, result.filterable), result.threshold


@implements("exdyna", ExDynaOptions,
            "MiCRO with block partitions re-balanced every step to equalise the per-rank counts")
class ExDyna(Micro):
    """ExDyna (Yoon & Oh, CCGrid 2024): MiCRO with block partitions re-balanced every step.

    The buffer is cut into ``num_blocks`` blocks (a multiple of 32 elements each, the remainder
    to the last partition); each partition is a run of blocks whose boundaries move between steps
    so that every rank selects about ``k / n`` coordinates, computed identically on every rank
    from the gathered per-rank counts (``balancer="prefix"``, the default, or ``"paper"``, the
    published pairwise rule; see :mod:`horovod_sparse.methods.micro.partitions`). Selection, threshold
    control and the exchange are MiCRO's. Its ``load_inc`` statistic is the imbalance the
    balancer works against.
    """
