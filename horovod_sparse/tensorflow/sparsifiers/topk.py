"""Top-k (baseline): the k largest |g+e| of each group, exchanged by allgather."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod_sparse.common.registry import implements
from horovod_sparse.tensorflow.collectives import Communicator
from horovod_sparse.tensorflow.selection import top_k
from horovod_sparse.tensorflow.sparsifier import Exchange, Sparsifier, Step


@implements("tensorflow", "topk")
class TopK(Sparsifier):
    """Exact top-k by magnitude per group, ``k = max(1, int(density * numel))``, ties to the
    lower index (:func:`horovod_sparse.tensorflow.selection.top_k`).

    Every rank sends exactly ``k`` (value, index) pairs; each rank scatter-adds all ``n`` chunks.
    Traffic ``O(k * n)`` per rank, and the union of indices can reach ``n * k`` (build-up).
    Traceable: runs inside ``tf.function`` (and so in Keras ``model.fit`` without eager mode).
    """

    def exchange(self, x: tf.Tensor, comm: Communicator, state: Any, step: Step) -> Exchange:
        k = self.count(int(x.shape[0]), step)
        with comm.timer("select"):
            idx = top_k(x, k)
        return (yield from self.allgather_exchange(x, idx, comm, fixed_count=k))
