"""gTop-k (Shi et al., ICDCS 2019): the global top-k of the summed gradient, O(k log n) traffic.

Each rank selects its local top-k of ``x = g + e``; the sets are then reduced pairwise along the
schedule of :mod:`horovod_sparse.methods.gtopk.butterfly` (fold-in, recursive-doubling rounds, fold-out).
In a round the two partners exchange their sets, each with one ``alltoall`` whose splits are
non-zero only for the partner (a point-to-point exchange over whatever Horovod's alltoall runs
on), and both compute the same merge (:func:`merge`). After the rounds every rank holds the
identical global set ``(idx_g, val_g)`` of exactly ``k`` coordinates and the update is
``idx_g, val_g / n``.

Residual (``residual="exact"``): each rank tracks which of its own coordinates still carry its
value through the merges (a mask over its local set: a fixed size, so nothing is read on the
host) and removes exactly those; a host also tracks the rank folded into it and sends it that
mask at fold-out (a byte per coordinate). So nothing is lost, unlike the reference's rule
(``residual="paper"``), which also removes local values that a merge dropped on the way.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from horovod_sparse.methods.comm import Comm
from horovod_sparse.methods.gtopk.butterfly import (FOLD_IN, GTopKOptions, Phase, SparseSet, butterfly_schedule,
                                                   round_count)
from horovod_sparse.common.registry import implements
from horovod_sparse.methods.backend import Backend, Tensor
from horovod_sparse.methods.base import Exchange, Sparsifier, Step


def merge(B: Backend, a: SparseSet, b: SparseSet, k: Any) -> SparseSet:
    """Sum two sets (at common indices), keep the top-k by magnitude, ties to the lower index.

    Symmetric and deterministic: ``merge(a, b)`` and ``merge(b, a)`` are bitwise equal on every
    device (each sum has at most two terms, added to zero), in the values' dtype (the wire
    dtype). With ``k`` entries in each input the result has ``k``: at least ``k`` distinct
    indices come first out of ``coalesce``, so its padding on an accelerator (after them, sums
    of +0.0) never wins a place (ties go to the lower position).
    """
    idx, summed = B.coalesce(B.concat([a.idx, b.idx]), B.concat([a.val, b.val]))
    keep = B.top_k(summed, k)  # idx is ascending: ties to the lower position are to the lower index
    return SparseSet(B.gather(idx, keep), B.gather(summed, keep))


#: A rank's own coordinates (its local set's ascending indices) and which of them still carry
#: its value (a boolean mask over them; None: all of them).
Tracked = Tuple[Tensor, Optional[Tensor]]


def carried(B: Backend, tracked: Tracked, held: SparseSet) -> Tracked:
    """``tracked`` with what is no longer present in ``held`` no longer carried (a mask of the
    same, fixed size: nothing is read on the host)."""
    indices, keep = tracked
    present = B.isin(indices, held.idx)
    return indices, present if keep is None else B.both(keep, present)


@implements("gtopk", GTopKOptions,
            "global top-k of the sum over ranks: pairwise merges on a butterfly, k*log2(n) pairs sent per rank")
class GTopK(Sparsifier):
    """Global top-k: exactly ``k = max(1, int(density * numel))`` coordinates of the sum over
    ranks reach the model each step, with ``k * log2(n)`` (value, index) pairs sent per rank.
    Traced into the graph in TensorFlow, but with ``recall_every`` (an allreduce on some steps
    only), whose exchange a traced step runs on the host.

    Statistics (``GroupStats.extra``): ``rounds`` (recursive-doubling rounds), ``phases`` and
    ``bytes_per_round`` (payload bytes this rank sent in each phase, folds included),
    ``delivered`` (this rank's coordinates that reached the model) and, on debug steps
    (``recall_every``), ``recall`` and ``recall_mass`` (see :func:`recall`).
    """

    options: GTopKOptions
    default_grouping = "model"

    @property  # type: ignore[override]
    def host_exchange(self) -> bool:
        """With ``recall_every`` (a debug allreduce on some steps only) a traced step runs the
        exchange on the host."""
        return bool(self.options.recall_every)

    def new_state(self, numel: int, world_size: int) -> Tuple[Phase, ...]:
        """The reduction schedule for ``world_size`` ranks (rebuilt when the size changes)."""
        return butterfly_schedule(world_size)

    def exchange(self, x: Tensor, comm: Comm, state: Tuple[Phase, ...], step: Step) -> Exchange:
        B, exact = self.B, self.options.residual == "exact"
        numel = B.numel(x)
        k = self.count(numel, step)
        with comm.timer("select"):
            local_idx = B.top_k(x, k)
            local = SparseSet(local_idx, self.to_wire(B.gather(x, local_idx)))
        held = local
        # rank -> its coordinates and which of them still carry its value into `held` (self, plus a
        # folded rank).
        tracked: Dict[int, Tracked] = {comm.rank: (local.idx, None)}
        sent_per_phase: List[Any] = []
        for phase in state:
            sent_before = sum(comm.stats.sent.values())
            pendings = self._launch_phase(phase, held, tracked, numel, comm)
            sent_per_phase.append(sum(comm.stats.sent.values()) - sent_before)
            outputs = yield pendings
            source = phase.receive_from[comm.rank]
            if source is None:
                continue
            with comm.timer("merge"):
                received = SparseSet(B.as_index(outputs[1][0]), outputs[0][0])
                if phase.adopt:
                    held = received
                    if exact:  # which of this rank's own coordinates its host delivered
                        tracked = {comm.rank: (local.idx, B.from_wire_mask(outputs[2][0]))}
                    continue
                if phase.name == FOLD_IN:
                    tracked[source] = (received.idx, None)
                held = merge(B, held, received, k)
                tracked = {rank: carried(B, coordinates, held) for rank, coordinates in tracked.items()}
        if self.options.recall_every:
            if step % self.options.recall_every == 0:
                (total,) = yield [comm.allreduce(B.clone(x), "recall", "meta")]
                comm.stats.extra["recall"], comm.stats.extra["recall_mass"] = recall(
                    B.to_numpy(held.idx), B.to_numpy(total), B.to_numpy(B.top_k(total, k)))
        with comm.timer("apply"):
            update = B.scatter_set(comm.output(x), held.idx, held.val, comm.scale)
            # What this rank delivered leaves its residual: its local values where they were
            # carried, +0.0 (which changes nothing) where a merge dropped them.
            _, delivered = tracked[comm.rank] if exact else carried(B, (local.idx, None), held)
            residual = comm.remove_delivered(x, local.idx, B.kept(local.val, delivered))
        comm.stats.selected = k
        comm.stats.union = B.size(held.idx)
        comm.stats.extra.update(rounds=round_count(comm.size), phases=[p.name for p in state],
                                bytes_per_round=sent_per_phase)
        comm.stats.note("delivered", B.count_true(delivered, k))
        return update, residual

    def _launch_phase(self, phase: Phase, held: SparseSet, tracked: Dict[int, Tensor], numel: int,
                      comm: Comm) -> List[Any]:
        """Every rank launches the phase's alltoalls (idle ranks with nothing to send): values
        and indices of the held set, and at fold-out (``residual="exact"``) the folded rank's
        delivered indices."""
        B = self.B
        target, source = phase.send_to[comm.rank], phase.receive_from[comm.rank]
        payload = held if target is not None else held.without_entries()
        # A held set has k entries: what arrives is known (a communicator need not ask first).
        received = [B.size(held.idx) if rank == source else 0 for rank in range(comm.size)]
        pendings = [self._point_to_point(comm, payload.val, target, f"{phase.name}.values", "values", received),
                    self._point_to_point(comm, B.wire_index(payload.idx, numel), target, f"{phase.name}.indices",
                                         "indices", received)]
        if phase.adopt and self.options.residual == "exact":
            # The folded rank's delivered coordinates, as a mask over its own set (k entries, in
            # the order it sent them at fold-in); an idle rank sends none.
            indices, keep = tracked[target] if target is not None else (payload.idx, None)
            pendings.append(self._point_to_point(comm, B.to_wire_mask(keep, indices), target,
                                                 f"{phase.name}.delivered", "meta", received))
        return pendings

    def _point_to_point(self, comm: Comm, tensor: Tensor, target: Optional[int], tag: str, kind: str,
                        received: Optional[List[int]] = None) -> Any:
        """Send all of ``tensor`` to rank ``target`` (nothing when None) with one alltoall;
        ``received``: the rows every rank receives, when the schedule tells them."""
        return comm.alltoall(tensor, self.B.splits_to(comm.size, target, tensor), tag, kind, received=received)


def recall(global_idx: np.ndarray, total: np.ndarray, exact: np.ndarray) -> Tuple[float, float]:
    """How close the global set ``global_idx`` is to ``exact``, the exact top-k of ``total`` (the
    sum over ranks of ``g + e``, same tie rule): the fraction of the exact top-k coordinates it
    contains, and the magnitude it covers, ``sum |total[global_idx]| / sum |total[exact]|`` (1
    when it is as good as the exact top-k even if it picks other coordinates)."""
    magnitude = np.abs(total)
    covered = float(magnitude[global_idx].sum(dtype=np.float64)) / max(float(magnitude[exact].sum(dtype=np.float64)),
                                                                         1e-30)
    return float(np.isin(exact, global_idx).sum()) / len(exact), covered
