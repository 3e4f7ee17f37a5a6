"""Top-k (baseline): the k largest |g+e| of each group, exchanged by allgather."""
from __future__ import annotations

from typing import Any

from horovod_sparse.common.options import SparsifierOptions
from horovod_sparse.common.registry import implements
from horovod_sparse.methods.backend import Tensor
from horovod_sparse.methods.base import Exchange, Sparsifier, Step
from horovod_sparse.methods.comm import Comm


@implements("topk", SparsifierOptions,
            "exact top-k of |g+e| per group; allgather of values and indices (build-up up to n*k)")
class TopK(Sparsifier):
    """Exact top-k by magnitude per group, ``k = max(1, int(density * numel))``, ties to the
    lower index (the backend's ``top_k``).

    Every rank sends exactly ``k`` (value, index) pairs; each rank scatter-adds all ``n`` chunks.
    Traffic ``O(k * n)`` per rank, and the union of indices can reach ``n * k`` (build-up).
    Traceable.
    """

    def exchange(self, x: Tensor, comm: Comm, state: Any, step: Step) -> Exchange:
        k = self.count(self.B.numel(x), step)
        with comm.timer("select"):
            idx = self.B.top_k(x, k, ascending=False)  # the exchange needs no order
        return (yield from self.allgather_exchange(x, idx, comm, fixed_count=k))
