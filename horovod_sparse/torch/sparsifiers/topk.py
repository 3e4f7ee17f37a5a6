"""Top-k (baseline): the k largest |g+e| of each group, exchanged by allgather."""
from __future__ import annotations

from typing import Any

import torch

from horovod_sparse.common.registry import implements
from horovod_sparse.torch.collectives import Communicator
from horovod_sparse.torch.selection import top_k
from horovod_sparse.torch.sparsifier import Exchange, Sparsifier


@implements("torch", "topk")
class TopK(Sparsifier):
    """Exact top-k by magnitude per group, ``k = max(1, int(density * numel))``, ties to the
    lower index (:func:`horovod_sparse.torch.selection.top_k`).

    Every rank sends exactly ``k`` (value, index) pairs; each rank scatter-adds all ``n`` chunks.
    Traffic ``O(k * n)`` per rank, and the union of indices can reach ``n * k`` (build-up).
    """

    def exchange(self, x: torch.Tensor, out: torch.Tensor, comm: Communicator, state: Any,
                 step: int) -> Exchange:
        k = self.options.count(x.numel(), step)
        with comm.timer("select"):
            idx = top_k(x, k)
        yield from self.allgather_exchange(x, idx, out, comm, fixed_count=k)
