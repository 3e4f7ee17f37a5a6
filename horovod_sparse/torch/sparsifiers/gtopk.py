"""gTop-k (Shi et al., ICDCS 2019): the global top-k of the summed gradient, O(k log n) traffic.

Each rank selects its local top-k of ``x = g + e``; the sets are then reduced pairwise along the
schedule of :mod:`horovod_sparse.common.butterfly` (fold-in, recursive-doubling rounds, fold-out).
In a round the two partners exchange their sets, each with one ``alltoall`` whose splits are
non-zero only for the partner (a point-to-point exchange over whatever Horovod's alltoall runs
on), and both compute the same merge: values added at common
indices, then the top-k of the at most 2k candidates by magnitude, ties to the lower index
(:func:`horovod_sparse.torch.selection.top_k`, which also makes the local selection).
After the rounds every rank holds the identical global set ``(idx_g, val_g)`` of exactly ``k``
coordinates and writes ``out[idx_g] = val_g / n``.

Residual (``residual="exact"``): each rank tracks which of its own coordinates still carry its
value through the merges and removes exactly those; a host also tracks the rank folded into it
and sends it its delivered indices at fold-out. So nothing is lost, unlike the reference's rule
(``residual="paper"``), which also removes local values that a merge dropped on the way.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from horovod_sparse.common.butterfly import FOLD_IN, Phase, SparseSet, butterfly_schedule, round_count
from horovod_sparse.common.registry import implements
from horovod_sparse.torch.collectives import Communicator, Pending, index_dtype
from horovod_sparse.torch.selection import top_k
from horovod_sparse.torch.sparsifier import Exchange, Sparsifier


def merge(a: SparseSet, b: SparseSet, k: int) -> SparseSet:
    """Sum two sets (at common indices), keep the top-k by magnitude, ties to the lower index.

    Symmetric and deterministic: ``merge(a, b)`` and ``merge(b, a)`` are bitwise equal on every
    device (each sum has at most two terms, added to zero), in the values' dtype (the wire
    dtype). With ``k`` entries in each input the result has ``k``.
    """
    idx, position = torch.unique(torch.cat([a.idx, b.idx]), sorted=True, return_inverse=True)
    summed = torch.zeros(idx.numel(), dtype=a.val.dtype, device=idx.device)
    summed.index_add_(0, position, torch.cat([a.val, b.val]))
    keep = top_k(summed, k)  # idx is ascending: ties to the lower position are to the lower index
    return SparseSet(idx[keep], summed[keep])


def carried(indices: torch.Tensor, held: SparseSet) -> torch.Tensor:
    """The part of ``indices`` still present in ``held``."""
    return indices[torch.isin(indices, held.idx)]


@implements("torch", "gtopk")
class GTopK(Sparsifier):
    """Global top-k: exactly ``k = max(1, int(density * numel))`` coordinates of the sum over
    ranks reach the model each step, with ``k * log2(n)`` (value, index) pairs sent per rank.

    Statistics (``GroupStats.extra``): ``rounds`` (recursive-doubling rounds), ``phases`` and
    ``bytes_per_round`` (payload bytes this rank sent in each phase, folds included),
    ``delivered`` (this rank's coordinates that reached the model) and, on debug steps
    (``recall_every``), ``recall`` and ``recall_mass`` (see :func:`recall`).
    """

    default_grouping = "model"

    def new_state(self, numel: int, world_size: int) -> Tuple[Phase, ...]:
        """The reduction schedule for ``world_size`` ranks (rebuilt when the size changes)."""
        return butterfly_schedule(world_size)

    def exchange(self, x: torch.Tensor, out: torch.Tensor, comm: Communicator, state: Tuple[Phase, ...],
                 step: int) -> Exchange:
        k = self.options.count(x.numel(), step)
        with comm.timer("select"):
            local_idx = top_k(x, k)
            local = SparseSet(local_idx, self.to_wire(x[local_idx]))
        held = local
        # rank -> indices whose value from that rank is still in `held` (self, plus a folded rank).
        tracked: Dict[int, torch.Tensor] = {comm.rank: local.idx}
        sent_per_phase: List[int] = []
        for phase in state:
            sent_before = sum(comm.stats.sent.values())
            pendings = self._launch_phase(phase, held, tracked, x.numel(), comm)
            sent_per_phase.append(sum(comm.stats.sent.values()) - sent_before)
            outputs = yield pendings
            source = phase.receive_from[comm.rank]
            if source is None:
                continue
            with comm.timer("merge"):
                received = SparseSet(outputs[1][0].long(), outputs[0][0])
                if phase.adopt:
                    held = received
                    if self.options.residual == "exact":
                        tracked = {comm.rank: outputs[2][0].long()}
                    continue
                if phase.name == FOLD_IN:
                    tracked[source] = received.idx
                held = merge(held, received, k)
                tracked = {rank: carried(indices, held) for rank, indices in tracked.items()}
        if self.options.recall_every and step % self.options.recall_every == 0:
            (total,) = yield [comm.allreduce(x.clone(), "recall", "meta")]
            comm.stats.extra["recall"], comm.stats.extra["recall_mass"] = recall(held.idx, total, k)
        with comm.timer("apply"):
            out.index_add_(0, held.idx, held.val.to(out.dtype), alpha=comm.scale)
            delivered = tracked[comm.rank] if self.options.residual == "exact" else carried(local.idx, held)
            comm.remove_delivered(x, delivered, local.val[torch.isin(local.idx, delivered)])
        comm.stats.selected = k
        comm.stats.union = held.idx.numel()
        comm.stats.extra.update(rounds=round_count(comm.size), phases=[p.name for p in state],
                                bytes_per_round=sent_per_phase, delivered=int(delivered.numel()))

    def _launch_phase(self, phase: Phase, held: SparseSet, tracked: Dict[int, torch.Tensor], numel: int,
                      comm: Communicator) -> List[Pending]:
        """Every rank launches the phase's alltoalls (idle ranks with nothing to send): values
        and indices of the held set, and at fold-out (``residual="exact"``) the folded rank's
        delivered indices."""
        target = phase.send_to[comm.rank]
        payload = held if target is not None else held.without_entries()
        wire_index = index_dtype(numel)
        pendings = [point_to_point(comm, payload.val, target, f"{phase.name}.values", "values"),
                    point_to_point(comm, payload.idx.to(wire_index), target, f"{phase.name}.indices", "indices")]
        if phase.adopt and self.options.residual == "exact":
            delivered = tracked[target] if target is not None else payload.idx
            pendings.append(point_to_point(comm, delivered.to(wire_index), target,
                                           f"{phase.name}.delivered", "meta"))
        return pendings


def point_to_point(comm: Communicator, tensor: torch.Tensor, target: Optional[int], tag: str,
                   kind: str) -> Pending:
    """Send all of ``tensor`` to rank ``target`` (nothing when None) with one alltoall."""
    splits = torch.zeros(comm.size, dtype=torch.int32)
    if target is not None:
        splits[target] = tensor.shape[0]
    return comm.alltoall(tensor, splits, tag, kind)


def recall(global_idx: torch.Tensor, total: torch.Tensor, k: int) -> Tuple[float, float]:
    """How close the global set ``global_idx`` is to the exact top-k of ``total`` (the sum over
    ranks of ``g + e``, same tie rule): the fraction of the exact top-k coordinates it contains,
    and the magnitude it covers, ``sum |total[global_idx]| / sum |total[exact top-k]|`` (1 when
    it is as good as the exact top-k even if it picks other coordinates)."""
    magnitude = total.abs()
    exact = top_k(total, k)
    covered = float(magnitude[global_idx].sum()) / max(float(magnitude[exact].sum()), 1e-30)
    return float(torch.isin(exact, global_idx).sum()) / k, covered
