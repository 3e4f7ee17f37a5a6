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
``sum(counts)`` coordinates: no build-up. A rank sends at most its capacity
(:func:`~horovod_sparse.methods.micro.options.share_capacity`, twice its share of ``k`` by
default): what its partition selects beyond it, its highest indices, stays in its residual. A
rank that selects nothing sends an empty index list and still takes part in every collective;
when the union is empty on every rank, step 3 is skipped everywhere.

On the host the threshold and partition table of a step are computed from the values gathered in
that step (so a traced TensorFlow step runs the exchange on the host,
``Sparsifier.host_exchange``). On an accelerator nothing is read inside the exchange: the
histogram rounds run on the device (:mod:`~horovod_sparse.methods.micro.device_rounds`), every
rank sends exactly its capacity of indices (padded), the values are allreduced at the padded
union (the padding carries +0.0 to index 0), and the per-rank counts and what the controller
decided are read with the step's other figures, when the group's state is updated
(:meth:`Micro._settle`, through ``GroupStats.when_read``) for the next step.

Statistics per group (``GroupStats.extra``): ``threshold``, ``counts`` (per rank, what each
sent), ``overflow`` (what this rank's partition selected beyond its capacity), ``load_inc``,
``padding`` (elements a fixed-size allgather would have padded), ``bounds`` (the partition table
used), ``select_seconds`` (``scan``, ``histogram``, ``pick``) and, with the histogram
controller, ``histogram_rounds`` (the rounds taken: ``["histogram"]``, in some steps followed by
``"histogram.wide"`` and/or ``"histogram.fine"``; see ``histogram_threshold``; on an accelerator
the rounds the host would have taken, the device taking both every step).
"""
from __future__ import annotations

from typing import Any, Dict, Generator, List, Sequence, Tuple

from horovod_sparse.common.thresholds import scan_block_size
from horovod_sparse.methods.comm import Comm
from horovod_sparse.methods.micro.controllers import histogram_exchange, histogram_threshold, make_controller
from horovod_sparse.methods.micro.device_rounds import RoundFlags, device_histogram_threshold, rounds_taken
from horovod_sparse.methods.micro.options import ExDynaOptions, MicroOptions, share_capacity
from horovod_sparse.methods.micro.state import PartitionedState, make_partitions
from horovod_sparse.methods.micro.partitions import allgather_padding, counts_by_partition, load_inc, owned_partition
from horovod_sparse.common.registry import implements
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.common.timing import PhaseTimer
from horovod_sparse.methods.backend import Backend, Capped, Tensor, cut
from horovod_sparse.methods.base import Exchange, Sparsifier
from horovod_sparse.methods.micro.candidates import Candidates

#: What an accelerator's histogram rounds decided, left on the device until the step's figures
#: are read (:meth:`Micro._settle`): the reading's flags (``clamped``, ``short``, ``coarse`` of
#: :class:`~horovod_sparse.methods.micro.controllers.ThresholdState`), then the
#: :class:`~horovod_sparse.methods.micro.device_rounds.RoundFlags`.
DECIDED = ("clamped", "short", "coarse") + tuple(f"rounds.{name}" for name in RoundFlags._fields)


@implements("micro", MicroOptions,
            "exclusive rotating partitions, one threshold, allreduce of values at the union (no build-up)")
class Micro(Sparsifier):
    """MiCRO on the whole model's flat buffer (``groups="model"`` by default).

    Traffic per rank and step: about ``k`` indices (allgather) and ``|union|`` values
    (allreduce), plus ``n`` integers and, with the default controller, about 1 KB of histogram;
    on an accelerator ``n`` times the capacity of each (padded payloads) and two histogram
    allreduces of about 2 KB.
    """

    default_grouping = "model"
    host_exchange = True

    def __init__(self, options: MicroOptions, backend: Backend) -> None:
        super().__init__(options, backend)
        self.controller = make_controller(options.controller)
        self.partitions = make_partitions(options)

    def new_state(self, numel: int, world_size: int) -> PartitionedState:
        return self.partitions.new_state(numel, world_size)

    def exchange(self, x: Tensor, comm: Comm, state: PartitionedState, step: int) -> Exchange:
        B = self.B
        numel = B.numel(x)
        bounds = self.partitions.bounds(state)
        owned = owned_partition(step, comm.rank, comm.size)
        k = self.options.count(numel, step)
        timer = PhaseTimer()
        with timer("scan"):
            scanned = B.scan(x, bounds[owned], bounds[owned + 1], scan_block_size(self.options.density_at(step)))
        capped, decided = yield from self._select(scanned, k, share_capacity(self.options, k, comm.size, numel),
                                                  owned, comm, state, timer)
        comm.stats.add_time("select", timer.total)
        comm.stats.note("overflow", capped.overflow)
        comm.stats.selected = capped.sent
        padded = {"rows": [B.numel(capped.idx)] * comm.size} if capped.padded else {}
        gathered, counts = yield [comm.allgather(B.wire_index(capped.idx, numel), "indices", "indices", **padded),
                                  self.allgather_count(capped.sent, x, comm)]
        union, update, residual = gathered, comm.output(x), x
        if not capped.padded:
            counts = [int(c) for c in B.to_numpy(counts)]
        if capped.padded or sum(counts):
            index, values = B.delivered(x, Capped(union, 0, 0, capped.padded))
            wire = self.to_wire(values)
            residual = comm.remove_delivered(x, index, wire)
            # The allreduce may write into its input (PyTorch's does), and the wire values are the
            # delivery an abandoned step puts back: it gets a copy.
            (total,) = yield [comm.allreduce(B.clone(wire), "values", "values")]
            with comm.timer("apply"):
                # Padded rows add +0.0 at index 0 (to an update of zeros: the same as setting).
                update = (B.scatter_chunks(update, index, total, [B.numel(index)], comm.scale) if capped.padded
                          else B.scatter_set(update, union, total, comm.scale))
        comm.stats.extra.update(bounds=bounds, select_seconds=timer.seconds)
        if capped.padded:  # the counts, and what the controller decided, are read with the step's figures
            for name, value in {"counts": counts, **decided}.items():
                comm.stats.note(name, value)
            comm.stats.when_read(lambda group: self._settle(state, step, group))
        else:
            comm.stats.extra.update(counts=counts, **decided)
            self._settle(state, step, comm.stats)
        return update, residual

    def _settle(self, state: PartitionedState, step: int, stats: GroupStats) -> None:
        """Update ``state`` after ``step`` from the group's read figures (``stats.extra``: the
        per-rank ``counts`` and, where an accelerator decided the histogram threshold, that
        reading's threshold, flags and rounds, left there as :data:`DECIDED` entries, taken out
        here); add the union and the imbalance figures."""
        figures = stats.extra
        if DECIDED[0] in figures:
            threshold = state.threshold
            threshold.clamped, threshold.short, threshold.coarse, *flags = (bool(figures.pop(name))
                                                                            for name in DECIDED)
            threshold.threshold = figures["threshold"]
            figures["histogram_rounds"] = rounds_taken(RoundFlags(*flags))
        counts = figures["counts"]
        stats.union = sum(counts)
        state.threshold.record(counts_by_partition(counts, step))
        self.partitions.observe(state, step, counts)
        figures.update(load_inc=load_inc(counts), padding=allgather_padding(counts))

    def _select(self, scanned: Any, k: int, capacity: int, owned: int, comm: Comm, state: PartitionedState,
                timer: PhaseTimer) -> Generator[Sequence[Any], List[Any], Tuple[Capped, Dict[str, Any]]]:
        """This rank's selection ``|x| >= threshold`` over its partition ``owned`` (``scanned``),
        cut to ``capacity``, and the figures that decided it (``threshold``; the histogram's
        rounds, or on an accelerator the :data:`DECIDED` flags they follow from), after the
        allreduces of the histogram rounds with a histogram controller
        (:mod:`~horovod_sparse.methods.micro.controllers`; on an accelerator
        :mod:`~horovod_sparse.methods.micro.device_rounds`)."""
        B = self.B
        allreduce = lambda round_: comm.allreduce(round_.local, round_.tag, "meta")  # noqa: E731
        if self.controller.window(state.threshold) is None:  # a rule that needs no histogram
            threshold = self.controller.next_threshold(state.threshold, k, None)
            with timer("pick"):
                return B.pick_capped(scanned, threshold, capacity), {"threshold": threshold}
        if B.decides_on_device(scanned.x):
            plan = device_histogram_threshold(B, self.controller, state.threshold, k, comm.size, owned, comm.rank,
                                              scanned)
            reading, flags = yield from histogram_exchange(plan, allreduce, lambda summed: summed, timer)
            with timer("pick"):
                capped = B.pick_capped(scanned, reading.threshold, capacity)
            return capped, {"threshold": reading.threshold,
                            **dict(zip(DECIDED, (reading.outside, reading.short, reading.coarse, *flags)))}
        plan = histogram_threshold(self.controller, state.threshold, k, comm.size, owned, comm.rank,
                                   lambda budget: Candidates.collect(B, scanned, budget))
        result = yield from histogram_exchange(plan, allreduce, B.to_numpy, timer)
        with timer("pick"):
            idx = result.candidates.select(result.threshold, result.filterable)
            return cut(idx, B.size(idx), capacity), {"threshold": result.threshold, "histogram_rounds": result.tags}


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
