"""Hard threshold (baseline), TensorFlow: ``|g+e| >= 1 / (2 sqrt(k))`` per group, exchanged like
Top-k (the port of :mod:`horovod_sparse.torch.sparsifiers.threshold`)."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod_sparse.common.controllers import as_float32
from horovod_sparse.common.registry import implements
from horovod_sparse.common.threshold_baselines import hard_threshold
from horovod_sparse.tensorflow.collectives import Communicator
from horovod_sparse.tensorflow.selection import select
from horovod_sparse.tensorflow.sparsifier import Exchange, Sparsifier, Step


@implements("tensorflow", "threshold")
class HardThreshold(Sparsifier):
    """A fixed threshold ``1 / (2 sqrt(k))``, ``k = max(1, int(density * numel))``, never adapted;
    per-rank counts vary, so they are allgathered with the values and indices. Traceable."""

    def exchange(self, x: tf.Tensor, comm: Communicator, state: Any, step: Step) -> Exchange:
        numel = int(x.shape[0])
        threshold = self.per_step(lambda s: as_float32(hard_threshold(self.options.count(numel, s))), step,
                                  tf.float64)
        with comm.timer("select"):
            idx = select(x, threshold)
        comm.stats.extra["threshold"] = threshold
        return (yield from self.allgather_exchange(x, idx, comm))
