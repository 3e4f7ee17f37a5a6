"""Hard threshold (baseline): ``|g+e| >= 1 / (2 sqrt(k))`` per group, exchanged like Top-k."""
from __future__ import annotations

from typing import Any

from horovod_sparse.common.thresholds import as_float32
from horovod_sparse.common.registry import implements
from horovod_sparse.common.threshold_baselines import HardThresholdOptions, hard_threshold
from horovod_sparse.methods.backend import Tensor
from horovod_sparse.methods.base import Exchange, Sparsifier, Step
from horovod_sparse.methods.comm import Comm


@implements("threshold", HardThresholdOptions,
            "fixed threshold 1/(2 sqrt(k)) per group; allgather like Top-k")
class HardThreshold(Sparsifier):
    """A fixed threshold ``1 / (2 sqrt(k))``, ``k = max(1, int(density * numel))``, never adapted:
    one O(numel) scan, no sort, and a selected count that drifts with the gradient's scale, all
    of it sent unless ``capacity`` is set
    (:class:`~horovod_sparse.common.threshold_baselines.HardThresholdOptions`; the rest then
    stays in the residual). Per-rank counts vary, so they are allgathered with the
    values and indices, except on an accelerator, where every rank sends its capacity: with
    a capacity of the whole group (the default) the group itself, zeroed where nothing is
    selected (:meth:`~horovod_sparse.methods.base.Sparsifier.masked_exchange`). Traceable."""

    options: HardThresholdOptions

    def exchange(self, x: Tensor, comm: Comm, state: Any, step: Step) -> Exchange:
        numel = self.B.numel(x)
        threshold = self.per_step(lambda s: as_float32(hard_threshold(self.options.count(numel, s))), step,
                                  "float64")
        capacity = self.capacity(numel, step)
        masked = self.B.decides_on_device(x) and capacity >= numel
        with comm.timer("select"):
            scanned = self.B.scan(x, 0, numel, self.block_size(step))
            selection = (self.B.device_reached(scanned, threshold) if masked
                         else self.B.pick_capped(scanned, threshold, capacity))
        comm.stats.extra["threshold"] = threshold
        if masked:
            return (yield from self.masked_exchange(x, *selection, comm))
        return (yield from self.allgather_exchange(x, selection, comm))
