"""Gaussian-k (baseline, Shi et al. 2019): a threshold from the mean and deviation of ``g+e``."""
from __future__ import annotations

from typing import Any, Tuple

from horovod_sparse.common.thresholds import as_float32, scan_block_size
from horovod_sparse.common.options import SparsifierOptions
from horovod_sparse.common.registry import implements
from horovod_sparse.common.threshold_baselines import GAUSSIANK_CORRECTIONS, gaussian_threshold, gaussiank_adjustment
from horovod_sparse.methods.backend import Backend, Tensor
from horovod_sparse.methods.base import Exchange, Sparsifier, Step


def gaussiank_select(B: Backend, x: Tensor, k: int, density: float) -> Tuple[Tensor, float]:
    """Gaussian-k's selection from the flat ``x``: indices (ascending) of ``|x| >=`` the final
    threshold, and that threshold (float32). One block scan gives the block maxima and the
    mean and deviation (``BlockScan.mean_std``); the first threshold and every correction are
    picks from it."""
    scanned = B.scan(x, 0, B.numel(x), scan_block_size(density), moments=True)
    threshold = gaussian_threshold(*scanned.mean_std(), density)
    idx = B.pick(scanned, as_float32(threshold))
    for _ in range(GAUSSIANK_CORRECTIONS):
        factor = gaussiank_adjustment(B.size(idx), k)
        if factor is None:
            break
        threshold *= factor
        idx = B.pick(scanned, as_float32(threshold))
    return idx, as_float32(threshold)


@implements("gaussiank", SparsifierOptions,
            "threshold mean + z*std with up to 3 corrections; allgather like Top-k")
class GaussianK(Sparsifier):
    """``|x| >= mean(x) + |Phi^-1(density / 2)| std(x)`` per group, then up to three corrections
    (×0.5 below ``2k/3`` selected, ×1.5 above ``4k/3``); exchanged like Top-k. One scan serves
    the statistics and every correction (:func:`gaussiank_select`). Each correction depends on the
    count the previous threshold selected: a traced TensorFlow step runs the exchange on the host."""

    host_exchange = True

    def exchange(self, x: Tensor, comm: Any, state: Any, step: Step) -> Exchange:
        with comm.timer("select"):
            idx, comm.stats.extra["threshold"] = gaussiank_select(self.B, x, self.options.count(self.B.numel(x), step),
                                                                  self.options.density_at(step))
        return (yield from self.allgather_exchange(x, idx, comm))
