"""DGC (baseline, Lin et al. 2018): a sampled threshold with bounded refinement, optional
momentum correction; exchanged like Top-k."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from horovod_sparse.common.controllers import as_float32, scan_block_size
from horovod_sparse.common.registry import implements
from horovod_sparse.common.threshold_baselines import (ACCEPT, DGC_LOWER, TOPK, DGCOptions, dgc_adjustment,
                                                       dgc_sample)
from horovod_sparse.torch.collectives import Communicator
from horovod_sparse.torch.selection import pick, scan, top_k
from horovod_sparse.torch.sparsifier import Exchange, Sparsifier


@dataclass
class MomentumState:
    """DGC's momentum correction of one group: the velocity ``u`` and the accumulated velocity
    ``v`` (equal to the group's residual between steps), allocated on the first step."""

    velocity: Optional[torch.Tensor] = None
    accumulated: Optional[torch.Tensor] = None


@implements("torch", "dgc")
class DGC(Sparsifier):
    """DGC's selection per group: threshold = the ``density`` quantile of a strided 1% sample of
    ``|x|``; above ``1.3 k`` selected the exact top-k of those is kept, below ``0.8 k`` the
    threshold is lowered ×0.8 and the (already scanned) buffer re-selected, at most
    ``max_adaptations`` times.

    With ``momentum=m > 0`` (momentum correction) the residual accumulates the velocity
    ``u = m u + g`` instead of the gradient, and ``u`` and ``v`` are both zeroed where sent
    (momentum-factor masking); the wrapped optimizer should then run without momentum. The
    gradient is recovered as ``g = x - v``, so this keeps two more buffers of the group's size.
    A step abandoned by the optimizer (non-finite gradient) restores the residual but not ``u``.
    """

    per_rank_state = True  # the velocity is this rank's own, like the residual

    def new_state(self, numel: int, world_size: int) -> Optional[MomentumState]:
        return MomentumState() if self.options.momentum else None

    def resized_state(self, state: Optional[MomentumState], numel: int,
                      world_size: int) -> Optional[MomentumState]:
        """The velocity is this rank's own and does not depend on the world size: kept (a new
        state would restart the momentum correction, taking the whole residual as this step's
        velocity)."""
        return state

    def exchange(self, x: torch.Tensor, out: torch.Tensor, comm: Communicator, state: Optional[MomentumState],
                 step: int) -> Exchange:
        options: DGCOptions = self.options
        numel, k, density = x.numel(), options.count(x.numel(), step), options.density_at(step)
        if state is not None:
            self._accumulate_velocity(x, state)
        with comm.timer("select"):
            offset, stride, count = dgc_sample(numel, density, options.sample_ratio, step)
            threshold = as_float32(float(torch.topk(x[offset::stride].abs(), count, sorted=False).values.min()))
            scanned = scan(x, 0, numel, scan_block_size(density))
            idx = pick(scanned, threshold)
            for _ in range(options.max_adaptations):
                action = dgc_adjustment(idx.numel(), k)
                if action == TOPK:
                    idx = idx[top_k(x[idx], k)]  # idx is ascending: ties to the lower index
                if action in (TOPK, ACCEPT):
                    break
                threshold = as_float32(threshold * DGC_LOWER)
                idx = pick(scanned, threshold)
        comm.stats.extra["threshold"] = threshold
        yield from self.allgather_exchange(x, idx, out, comm)
        if state is not None:
            assert state.velocity is not None and state.accumulated is not None
            state.velocity[idx] = 0
            state.accumulated.index_copy_(0, idx, x[idx])

    def _accumulate_velocity(self, x: torch.Tensor, state: MomentumState) -> None:
        """On entry ``x = v + g``; on exit ``u = m u + g``, ``v = v + u`` and ``x = v``."""
        if state.velocity is None:
            state.velocity, state.accumulated = torch.zeros_like(x), torch.zeros_like(x)
        assert state.accumulated is not None
        x.sub_(state.accumulated)
        state.velocity.mul_(self.options.momentum).add_(x)
        state.accumulated.add_(state.velocity)
        x.copy_(state.accumulated)
