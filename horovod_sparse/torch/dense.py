"""The Horovod optimizer's dense groups: Horovod's own allreduce of each gradient, as
``hvd.DistributedOptimizer`` does it (a group of a dense compression, a group kept dense, or a
sparse step's dense groups)."""
from __future__ import annotations

import time
from typing import Any, List, Tuple

import horovod.torch as hvd
import torch

from horovod_sparse.common.stats import GroupStats
from horovod_sparse.methods.base import Sparsifier
from horovod_sparse.torch.waiting import wait
from horovod_sparse.torch_core.buffers import FlatGroup


class DenseFlight:
    """One group's dense allreduces in flight: Horovod's own path (one in-place allreduce per
    gradient, through ``compression``), with nothing per gradient but what Horovod's optimizer
    does, so that the wrapper costs what Horovod costs when nothing is sparsified. (A step with
    a non-finite gradient on some rank is abandoned after the exchange: every rank fills the
    aggregates with NaN then, whatever they hold.)
    """

    sparse = False

    def __init__(self, group: FlatGroup, stats: GroupStats, compression: Any, process_set: hvd.ProcessSet,
                 op: Any, prescale: float, postscale: float) -> None:
        self.group = group
        self.stats = stats
        self._compression = compression
        self._launched: List[Tuple[torch.Tensor, Any, Any]] = []
        wire = 0
        for name, p in zip(group.names, group.params):
            if p.grad is None:
                continue  # a sparse gradient, aggregated on its own (horovod_sparse.torch.sparse_rows)
            # Horovod's torch collectives do not take bfloat16: such gradients travel as float32.
            grad = p.grad.float() if p.grad.dtype == torch.bfloat16 else p.grad
            compressed, ctx = compression.compress(grad)
            handle = hvd.allreduce_async_(compressed, name=f"hs.{group.name}.{name}", op=op, prescale_factor=prescale,
                                          postscale_factor=postscale, process_set=process_set)
            self._launched.append((p, handle, ctx))
            wire += compressed.numel() * compressed.element_size()
        stats.selected = stats.union = group.numel
        stats.collectives = len(self._launched)
        stats.sent["values"] = stats.received["values"] = wire

    def finish(self) -> None:
        """Wait for the allreduces and write the aggregated gradients into ``.grad``."""
        start = time.perf_counter()
        for p, handle, ctx in self._launched:
            result = self._compression.decompress(wait(handle), ctx)
            if result.dtype == p.grad.dtype:
                p.grad.set_(result)
            else:
                p.grad.copy_(result)
        self.stats.add_time("communicate", time.perf_counter() - start)


class HorovodDense:
    """How the Horovod optimizer's dense groups travel: each gradient allreduced by Horovod
    with ``op`` over ``process_set``, through ``compression`` (none for a sparsifier's dense
    groups), an average's ``predivide_factor`` split around it as ``hvd.DistributedOptimizer``
    splits its ``gradient_predivide_factor``."""

    def __init__(self, compression: Any, process_set: hvd.ProcessSet, op: Any, predivide_factor: float) -> None:
        self.compression = hvd.Compression.none if isinstance(compression, Sparsifier) else compression
        self.process_set = process_set
        self.op = op
        self.factor = predivide_factor if op == hvd.Average else 1.0

    def start(self, group: FlatGroup, stats: GroupStats) -> DenseFlight:
        """Launch ``group``'s allreduces, accounting into ``stats``."""
        return DenseFlight(group, stats, self.compression, self.process_set, self.op, 1.0 / self.factor, self.factor)
