"""Gaussian-k (baseline, Shi et al. 2019): a threshold from the mean and deviation of ``g+e``."""
from __future__ import annotations

from typing import Any, Tuple

import torch

from horovod_sparse.common.controllers import as_float32, scan_block_size
from horovod_sparse.common.registry import implements
from horovod_sparse.common.threshold_baselines import GAUSSIANK_CORRECTIONS, gaussian_threshold, gaussiank_adjustment
from horovod_sparse.torch.collectives import Communicator
from horovod_sparse.torch.selection import pick, scan
from horovod_sparse.torch.sparsifier import Exchange, Sparsifier


def gaussiank_select(x: torch.Tensor, k: int, density: float) -> Tuple[torch.Tensor, float]:
    """Gaussian-k's selection from the flat ``x``: indices (ascending) of ``|x| >=`` the final
    threshold, and that threshold (float32). One block scan gives the block maxima and the
    mean and deviation (:meth:`horovod_sparse.torch.selection.BlockScan.mean_std`); the first
    threshold and every correction are picks from it."""
    scanned = scan(x, 0, x.numel(), scan_block_size(density), moments=True)
    threshold = gaussian_threshold(*scanned.mean_std(), density)
    idx = pick(scanned, as_float32(threshold))
    for _ in range(GAUSSIANK_CORRECTIONS):
        factor = gaussiank_adjustment(idx.numel(), k)
        if factor is None:
            break
        threshold *= factor
        idx = pick(scanned, as_float32(threshold))
    return idx, as_float32(threshold)


@implements("torch", "gaussiank")
class GaussianK(Sparsifier):
    """``|x| >= mean(x) + |Phi^-1(density / 2)| std(x)`` per group, then up to three corrections
    (×0.5 below ``2k/3`` selected, ×1.5 above ``4k/3``); exchanged like Top-k. One scan serves
    the statistics and every correction (:func:`gaussiank_select`)."""

    def exchange(self, x: torch.Tensor, out: torch.Tensor, comm: Communicator, state: Any,
                 step: int) -> Exchange:
        with comm.timer("select"):
            idx, comm.stats.extra["threshold"] = gaussiank_select(x, self.options.count(x.numel(), step),
                                                                  self.options.density_at(step))
        yield from self.allgather_exchange(x, idx, out, comm)
