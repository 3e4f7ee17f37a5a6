"""MiCRO (Yoon & Oh, HiPC 2023): exclusive rotating partitions, one threshold, union allreduce.

Rank ``r`` scans only the partition ``(step + r) mod n`` of the group's flat buffer
(:mod:`horovod_sparse.common.partitions`) and selects ``|x| >= threshold`` there, with the
threshold every rank derives identically (:mod:`horovod_sparse.common.controllers`). The
exchange, per group and step:

1. (``controller="histogram"`` only) allreduce of a histogram of ``|x|``, about 1 KB (in
   some steps a second one, see :mod:`horovod_sparse.common.controllers`);
2. allgather of the selected indices and of each rank's count;
3. allreduce (sum) of every rank's ``x`` at the union of the indices, so each selected
   coordinate carries the exact sum over ranks; ``out[union] = sum * scale``.

Every rank then removes its own contribution at the whole union from its residual (with
``fp16_values`` the float16 rounding stays behind), so nothing is lost and the union has exactly
``sum(counts)`` coordinates: no build-up. A rank that selects nothing sends an empty index list
and still takes part in every collective; when the union is empty on every rank, step 3 is
skipped everywhere.

Statistics per group (``GroupStats.extra``): ``threshold``, ``counts`` (per rank),
``load_inc``, ``padding`` (elements a fixed-size allgather would have padded), ``bounds`` (the
partition table used), ``select_seconds`` (``scan``, ``histogram``, ``pick``) and, with the
histogram controller, ``histogram_rounds`` (the rounds taken: ``["histogram"]``, in some steps
followed by ``"histogram.wide"`` and/or ``"histogram.fine"``; see ``histogram_threshold``).
"""
from __future__ import annotations

from typing import Any, Generator, List, Sequence, Tuple

import torch

from horovod_sparse.common.controllers import (histogram_exchange, histogram_threshold, make_controller,
                                               scan_block_size)
from horovod_sparse.common.partitioned import MicroOptions, PartitionedState, make_partitions
from horovod_sparse.common.partitions import allgather_padding, counts_by_partition, load_inc, owned_partition
from horovod_sparse.common.registry import implements
from horovod_sparse.torch.collectives import Communicator, Pending, index_dtype
from horovod_sparse.common.timing import PhaseTimer
from horovod_sparse.torch.selection import Candidates, pick, scan
from horovod_sparse.torch.sparsifier import Exchange, Sparsifier


@implements("torch", "micro")
class Micro(Sparsifier):
    """MiCRO on the whole model's flat buffer (``groups="model"`` by default).

    Traffic per rank and step: about ``k`` indices (allgather) and ``|union|`` values
    (allreduce), plus ``n`` integers and, with the default controller, about 1 KB of histogram.
    """

    default_grouping = "model"

    def __init__(self, options: MicroOptions) -> None:
        super().__init__(options)
        self.controller = make_controller(options.controller)
        self.partitions = make_partitions(options)

    def new_state(self, numel: int, world_size: int) -> PartitionedState:
        return self.partitions.new_state(numel, world_size)

    def exchange(self, x: torch.Tensor, out: torch.Tensor, comm: Communicator, state: PartitionedState,
                 step: int) -> Exchange:
        numel, size = x.numel(), comm.size
        bounds = self.partitions.bounds(state)
        owned = owned_partition(step, comm.rank, size)
        timer = PhaseTimer()
        idx, threshold = yield from self._select(x, bounds, owned, comm, state, step, timer)
        comm.stats.add_time("select", timer.total)

        count = torch.tensor([idx.numel()], dtype=torch.int64, device=x.device)
        gathered, counts_out = yield [comm.allgather(idx.to(index_dtype(numel)), "indices", "indices"),
                                      comm.allgather(count, "counts", "meta")]
        union, counts = gathered.long(), counts_out.tolist()
        if union.numel():
            wire = self.to_wire(x[union])
            comm.remove_delivered(x, union, wire)
            (total,) = yield [comm.allreduce(wire.clone(), "values", "values")]
            with comm.timer("apply"):
                out.index_copy_(0, union, total.to(out.dtype).mul_(comm.scale))

        state.threshold.record(counts_by_partition(counts, step))
        self.partitions.observe(state, step, counts)
        comm.stats.selected = idx.numel()
        comm.stats.union = union.numel()
        comm.stats.extra.update(threshold=threshold, counts=counts, load_inc=load_inc(counts),
                                padding=allgather_padding(counts), bounds=bounds,
                                select_seconds=timer.seconds)

    def _select(self, x: torch.Tensor, bounds: List[int], owned: int, comm: Communicator,
                state: PartitionedState, step: int, timer: PhaseTimer
                ) -> Generator[Sequence[Pending], List[Any], Tuple[torch.Tensor, float]]:
        """This rank's selection ``|x| >= threshold`` over its partition ``owned`` and the
        threshold; with a histogram controller, after the allreduces of the histogram rounds
        (:func:`~horovod_sparse.common.controllers.histogram_threshold`)."""
        k = self.options.count(x.numel(), step)
        with timer("scan"):
            scanned = scan(x, bounds[owned], bounds[owned + 1], scan_block_size(self.options.density_at(step)))
        if self.controller.window(state.threshold) is None:  # a rule that needs no histogram
            threshold = self.controller.next_threshold(state.threshold, k, None)
            with timer("pick"):
                return pick(scanned, threshold), threshold
        plan = histogram_threshold(self.controller, state.threshold, k, comm.size, owned, comm.rank,
                                   lambda budget: Candidates.collect(scanned, budget))
        threshold, candidates, rounds = yield from histogram_exchange(
            plan, lambda r: comm.allreduce(torch.from_numpy(r.local).to(x.device), r.tag, "meta"),
            lambda summed: summed.cpu().numpy(), timer)
        comm.stats.extra["histogram_rounds"] = rounds
        with timer("pick"):
            return candidates.select(threshold), threshold
