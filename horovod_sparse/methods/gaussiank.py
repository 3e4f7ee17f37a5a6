"""Gaussian-k (baseline, Shi et al. 2019): a threshold from the mean and deviation of ``g+e``."""
from __future__ import annotations

from typing import Any, Tuple

from horovod_sparse.common.thresholds import scan_block_size
from horovod_sparse.common.registry import implements
from horovod_sparse.common.capacity import CappedOptions
from horovod_sparse.common.threshold_baselines import (GAUSSIANK_CORRECTIONS, GAUSSIANK_HIGH, GAUSSIANK_LOW,
                                                       GAUSSIANK_LOWER, GAUSSIANK_RAISE, gaussian_threshold)
from horovod_sparse.methods.backend import Backend, Capped, Tensor
from horovod_sparse.methods.base import Exchange, Sparsifier, Step
from horovod_sparse.methods.comm import Comm


def gaussiank_select(B: Backend, x: Tensor, k: int, density: float, capacity: int) -> Tuple[Capped, Any]:
    """Gaussian-k's selection from the flat ``x``: ``|x| >=`` the final threshold, cut to
    ``capacity`` (:meth:`~horovod_sparse.methods.backend.Backend.pick_capped`), and that
    threshold (float32). One block scan gives the block maxima and the mean and deviation
    (``BlockScan.mean_std``); the first threshold and every correction count from it
    (:meth:`~horovod_sparse.methods.backend.Backend.count_reaching`), and the final threshold
    is picked once. On an accelerator the moments, counts, corrections and threshold stay device
    tensors (all three corrections run, a settled one changing nothing; nothing is read on the
    host); on the host the corrections stop at the first count within the band, and the pick
    finishes that count's pass."""
    scanned = B.scan(x, 0, B.numel(x), scan_block_size(density), moments=True)
    threshold = gaussian_threshold(*scanned.mean_std(), density)
    bar = B.as_threshold(threshold)  # what is counted and picked: the threshold as float32
    found = B.count_reaching(scanned, bar)
    for _ in range(GAUSSIANK_CORRECTIONS):
        factor = B.band(found, GAUSSIANK_LOW * k, GAUSSIANK_HIGH * k, GAUSSIANK_LOWER, GAUSSIANK_RAISE)
        if isinstance(factor, float) and factor == 1.0:  # settled, on the host
            break
        threshold = threshold * factor
        bar = B.as_threshold(threshold)
        found = B.count_reaching(scanned, bar)
    return B.pick_capped(scanned, bar, capacity), bar


@implements("gaussiank", CappedOptions,
            "threshold mean + z*std with up to 3 corrections; allgather like Top-k")
class GaussianK(Sparsifier):
    """``|x| >= mean(x) + |Phi^-1(density / 2)| std(x)`` per group, then up to three corrections
    (×0.5 below ``2k/3`` selected, ×1.5 above ``4k/3``); exchanged like Top-k, up to the
    ``capacity`` (:class:`~horovod_sparse.common.capacity.CappedOptions`). One scan
    serves the statistics and every correction (:func:`gaussiank_select`). Each correction
    depends on the count the previous threshold selected: a traced TensorFlow step runs the
    exchange on the host."""

    options: CappedOptions
    host_exchange = True

    def exchange(self, x: Tensor, comm: Comm, state: Any, step: Step) -> Exchange:
        numel = self.B.numel(x)
        with comm.timer("select"):
            capped, threshold = gaussiank_select(self.B, x, self.options.count(numel, step),
                                                 self.options.density_at(step), self.capacity(numel, step))
        comm.stats.note("threshold", threshold)
        return (yield from self.allgather_exchange(x, capped, comm))
