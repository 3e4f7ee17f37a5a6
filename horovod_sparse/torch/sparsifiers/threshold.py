"""Hard threshold (baseline): ``|g+e| >= 1 / (2 sqrt(k))`` per group, exchanged like Top-k."""
from __future__ import annotations

from typing import Any

import torch

from horovod_sparse.common.controllers import as_float32, scan_block_size
from horovod_sparse.common.registry import implements
from horovod_sparse.common.threshold_baselines import hard_threshold
from horovod_sparse.torch.collectives import Communicator
from horovod_sparse.torch.selection import select
from horovod_sparse.torch.sparsifier import Exchange, Sparsifier


@implements("torch", "threshold")
class HardThreshold(Sparsifier):
    """A fixed threshold ``1 / (2 sqrt(k))``, ``k = max(1, int(density * numel))``, never adapted:
    one O(numel) scan, no sort, and a selected count that drifts with the gradient's scale.
    Per-rank counts vary, so they are allgathered with the values and indices."""

    def exchange(self, x: torch.Tensor, out: torch.Tensor, comm: Communicator, state: Any,
                 step: int) -> Exchange:
        threshold = as_float32(hard_threshold(self.options.count(x.numel(), step)))
        with comm.timer("select"):
            idx = select(x, threshold, scan_block_size(self.options.density_at(step)))
        comm.stats.extra["threshold"] = threshold
        yield from self.allgather_exchange(x, idx, out, comm)
