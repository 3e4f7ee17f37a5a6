"""Gaussian-k (baseline, Shi et al. 2019), TensorFlow: a threshold from the mean and deviation of
``g+e`` (the port of :mod:`horovod_sparse.torch.sparsifiers.gaussiank`)."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod_sparse.common.controllers import as_float32
from horovod_sparse.common.registry import implements
from horovod_sparse.common.threshold_baselines import GAUSSIANK_CORRECTIONS, gaussian_threshold, gaussiank_adjustment
from horovod_sparse.tensorflow.collectives import Communicator
from horovod_sparse.tensorflow.selection import select
from horovod_sparse.tensorflow.sparsifier import Exchange, Sparsifier


@implements("tensorflow", "gaussiank")
class GaussianK(Sparsifier):
    """``|x| >= mean(x) + |Phi^-1(density / 2)| std(x)`` per group (unbiased deviation, in
    ``x``'s dtype), then up to three corrections (×0.5 below ``2k/3`` selected, ×1.5 above
    ``4k/3``); exchanged like Top-k. Eager mode only: each correction depends on the count the
    previous threshold selected."""

    traceable = False

    def exchange(self, x: tf.Tensor, comm: Communicator, state: Any, step: int) -> Exchange:
        numel = int(x.shape[0])
        k, density = self.options.count(numel, step), self.options.density_at(step)
        with comm.timer("select"):
            mean = tf.reduce_mean(x)
            std = float(tf.sqrt(tf.reduce_sum(tf.square(x - mean)) / (numel - 1))) if numel > 1 else 0.0
            threshold = gaussian_threshold(float(mean), std, density)
            idx = select(x, as_float32(threshold))
            for _ in range(GAUSSIANK_CORRECTIONS):
                factor = gaussiank_adjustment(int(tf.size(idx)), k)
                if factor is None:
                    break
                threshold *= factor
                idx = select(x, as_float32(threshold))
        comm.stats.extra["threshold"] = as_float32(threshold)
        return (yield from self.allgather_exchange(x, idx, comm))
