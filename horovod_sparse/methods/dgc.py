"""DGC (baseline, Lin et al. 2018): a sampled threshold with bounded refinement, optional
momentum correction; exchanged like Top-k."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from horovod_sparse.common.thresholds import scan_block_size
from horovod_sparse.common.registry import implements
from horovod_sparse.common.threshold_baselines import DGC_LOWER, DGC_UPPER, DGCOptions, dgc_sample
from horovod_sparse.methods.backend import Backend, Capped, Tensor
from horovod_sparse.methods.base import Exchange, Sparsifier, Step
from horovod_sparse.methods.comm import Comm


@dataclass
class MomentumState:
    """DGC's momentum correction of one group: the velocity ``u`` and the accumulated velocity
    ``v`` (equal to the group's residual between steps), allocated on the first step."""

    velocity: Optional[Any] = None
    accumulated: Optional[Any] = None


def dgc_select(B: Backend, x: Tensor, options: DGCOptions, step: int, capacity: int) -> Tuple[Capped, Any]:
    """DGC's selection from the flat ``x`` at ``step``, cut to ``capacity``, and its final
    threshold. The threshold of the sample (:func:`~horovod_sparse.common.threshold_baselines.dgc_sample`)
    is refined from the counts of one block scan: below ``0.8 k`` it is lowered ×0.8, at most
    ``max_adaptations`` times (:meth:`~horovod_sparse.methods.backend.Backend.lowered_thresholds`);
    above ``1.3 k`` the top-k of the selection's first ``capacity`` indices is kept
    (:meth:`~horovod_sparse.methods.backend.Backend.top_k_capped`). On the host the refinement
    counts the thresholds in turn and stops at the first that settles it
    (:meth:`~horovod_sparse.methods.backend.Backend.count_reaching`; the pick finishes that
    count's pass); on an accelerator every threshold is counted in one pass
    (:meth:`~horovod_sparse.methods.backend.Backend.counts_at`) and the first that settles is
    chosen there (:meth:`~horovod_sparse.methods.backend.Backend.first_settled`): nothing is
    read on the host."""
    numel = B.numel(x)
    k, density = options.count(numel, step), options.density_at(step)
    low, high, checks = DGC_LOWER * k, DGC_UPPER * k, options.max_adaptations
    offset, stride, count = dgc_sample(numel, density, options.sample_ratio, step)
    scanned = B.scan(x, 0, numel, scan_block_size(density))
    thresholds = B.lowered_thresholds(B.kth_magnitude(x[offset::stride], count), DGC_LOWER, checks)
    if B.decides_on_device(x):
        counted, counts = thresholds, B.counts_at(scanned, thresholds)
    else:
        counts = []
        for threshold in thresholds:
            counts.append(B.count_reaching(scanned, threshold))
            if counts[-1] >= low:
                break
        counted = thresholds[:len(counts)]
    threshold, cut = B.first_settled(counted, counts, low, high, checks)
    return B.top_k_capped(x, B.pick_capped(scanned, threshold, capacity), k, cut), threshold


@implements("dgc", DGCOptions,
            "sampled threshold with bounded refinement (DGC); allgather like Top-k")
class DGC(Sparsifier):
    """DGC's selection per group (:func:`dgc_select`): threshold = the ``density`` quantile of a
    strided 1% sample of ``|x|`` (:func:`~horovod_sparse.common.threshold_baselines.dgc_sample`);
    when the exact selection exceeds ``1.3 k`` the top-k of it is kept, when it falls below
    ``0.8 k`` the threshold is lowered ×0.8 and the (already scanned) buffer re-selected, at most
    ``max_adaptations`` times; at most ``capacity`` coordinates are sent
    (:class:`~horovod_sparse.common.capacity.CappedOptions`).

    With ``momentum=m > 0`` (momentum correction) the residual accumulates the velocity
    ``u = m u + g`` instead of the gradient, and ``u`` and ``v`` are both zeroed where sent
    (momentum-factor masking); the wrapped optimizer should then run without momentum. The
    gradient is recovered as ``g = x - v``, so this keeps two more buffers of the group's size.
    A step abandoned by the front end (non-finite gradient) restores the residual but not ``u``.
    Each refinement depends on the count the previous threshold selected: a traced TensorFlow
    step runs the exchange on the host (:attr:`~horovod_sparse.methods.base.Sparsifier.host_exchange`).
    """

    options: DGCOptions
    host_exchange = True
    per_rank_state = True

    def new_state(self, numel: int, world_size: int) -> Optional[MomentumState]:
        return MomentumState() if self.options.momentum else None

    def resized_state(self, state: Optional[MomentumState], numel: int,
                      world_size: int) -> Optional[MomentumState]:
        """The velocity is this rank's own and does not depend on the world size: kept (a new
        state would restart the momentum correction, taking the whole residual as this step's
        velocity)."""
        return state

    def export_state(self, state: Optional[MomentumState]) -> Optional[MomentumState]:
        """The momentum buffers in the backend's checkpoint form."""
        if state is None or state.velocity is None:
            return None if state is None else MomentumState()
        return MomentumState(self.B.saved(state.velocity), self.B.saved(state.accumulated))

    def import_state(self, saved: Optional[MomentumState]) -> Optional[MomentumState]:
        if saved is None or saved.velocity is None:
            return None if saved is None else MomentumState()
        return MomentumState(self.B.from_saved(saved.velocity), self.B.from_saved(saved.accumulated))

    def exchange(self, x: Tensor, comm: Comm, state: Optional[MomentumState], step: Step) -> Exchange:
        B, options = self.B, self.options
        numel = B.numel(x)
        if state is not None:
            x, state.velocity, state.accumulated = B.momentum_step(x, state.velocity, state.accumulated,
                                                                   options.momentum)
        with comm.timer("select"):
            capped, threshold = dgc_select(B, x, options, step, self.capacity(numel, step))
        comm.stats.note("threshold", threshold)
        update, residual = yield from self.allgather_exchange(x, capped, comm)
        if state is not None:
            state.velocity = B.copy_at(state.velocity, capped, None)
            state.accumulated = B.copy_at(state.accumulated, capped, residual)
        return update, residual
