"""Gaussian-k (baseline, Shi et al. 2019): a threshold from the mean and deviation of ``g+e``."""
from __future__ import annotations

from typing import Any

import torch

from horovod_sparse.common.controllers import as_float32, scan_block_size
from horovod_sparse.common.registry import implements
from horovod_sparse.common.threshold_baselines import GAUSSIANK_CORRECTIONS, gaussian_threshold, gaussiank_adjustment
from horovod_sparse.torch.collectives import Communicator
from horovod_sparse.torch.selection import pick, scan
from horovod_sparse.torch.sparsifier import Exchange, Sparsifier


@implements("torch", "gaussiank")
class GaussianK(Sparsifier):
    """``|x| >= mean(x) + |Phi^-1(density / 2)| std(x)`` per group, then up to three corrections
    (×0.5 below ``2k/3`` selected, ×1.5 above ``4k/3``); exchanged like Top-k. One scan serves
    every correction."""

    def exchange(self, x: torch.Tensor, out: torch.Tensor, comm: Communicator, state: Any,
                 step: int) -> Exchange:
        k, density = self.options.count(x.numel(), step), self.options.density_at(step)
        with comm.timer("select"):
            std, mean = torch.std_mean(x)
            threshold = gaussian_threshold(float(mean), float(std) if x.numel() > 1 else 0.0, density)
            scanned = scan(x, 0, x.numel(), scan_block_size(density))
            idx = pick(scanned, as_float32(threshold))
            for _ in range(GAUSSIANK_CORRECTIONS):
                factor = gaussiank_adjustment(idx.numel(), k)
                if factor is None:
                    break
                threshold *= factor
                idx = pick(scanned, as_float32(threshold))
        comm.stats.extra["threshold"] = as_float32(threshold)
        yield from self.allgather_exchange(x, idx, out, comm)
