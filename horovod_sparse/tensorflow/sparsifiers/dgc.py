"""DGC (baseline, Lin et al. 2018), TensorFlow: a sampled threshold with bounded refinement,
optional momentum correction; exchanged like Top-k (the port of
:mod:`horovod_sparse.torch.sparsifiers.dgc`)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import tensorflow as tf

from horovod_sparse.common.controllers import as_float32
from horovod_sparse.common.registry import implements
from horovod_sparse.common.threshold_baselines import ACCEPT, DGC_LOWER, TOPK, DGCOptions, dgc_adjustment, dgc_sample
from horovod_sparse.tensorflow.collectives import Communicator
from horovod_sparse.tensorflow.selection import select, top_k
from horovod_sparse.tensorflow.sparsifier import Exchange, Sparsifier


@dataclass
class MomentumState:
    """DGC's momentum correction of one group: the velocity ``u`` and the accumulated velocity
    ``v`` (equal to the group's residual between steps), created on the first step."""

    velocity: Optional[tf.Tensor] = None
    accumulated: Optional[tf.Tensor] = None


@implements("tensorflow", "dgc")
class DGC(Sparsifier):
    """DGC's selection per group: threshold = the ``density`` quantile of a strided sample of
    ``|x|``; above ``1.3 k`` selected the exact top-k of those is kept, below ``0.8 k`` the
    threshold is lowered ×0.8 and the buffer re-selected, at most ``max_adaptations`` times.
    With ``momentum=m > 0`` the residual accumulates the velocity ``u = m u + g`` instead of the
    gradient, and both are zeroed where sent. Eager mode only: each refinement depends on the
    count the previous threshold selected."""

    traceable = False
    per_rank_state = True  # the velocity is this rank's own, like the residual

    def new_state(self, numel: int, world_size: int) -> Optional[MomentumState]:
        return MomentumState() if self.options.momentum else None

    def export_state(self, state: Optional[MomentumState]) -> Optional[MomentumState]:
        """The momentum buffers as NumPy arrays."""
        if state is None or state.velocity is None:
            return copy.deepcopy(state)
        assert state.accumulated is not None
        return MomentumState(state.velocity.numpy(), state.accumulated.numpy())

    def import_state(self, saved: Optional[MomentumState]) -> Optional[MomentumState]:
        if saved is None or saved.velocity is None:
            return copy.deepcopy(saved)
        return MomentumState(tf.constant(saved.velocity), tf.constant(saved.accumulated))

    def exchange(self, x: tf.Tensor, comm: Communicator, state: Optional[MomentumState], step: int) -> Exchange:
        options: DGCOptions = self.options
        numel = int(x.shape[0])
        k, density = options.count(numel, step), options.density_at(step)
        if state is not None:
            x = self._accumulate_velocity(x, state)
        with comm.timer("select"):
            offset, stride, count = dgc_sample(numel, density, options.sample_ratio, step)
            sample = tf.abs(x[offset::stride])
            threshold = as_float32(float(tf.reduce_min(tf.math.top_k(sample, count, sorted=False).values)))
            idx = select(x, threshold)
            for _ in range(options.max_adaptations):
                action = dgc_adjustment(int(tf.size(idx)), k)
                if action == TOPK:
                    idx = tf.gather(idx, top_k(tf.gather(x, idx), k))  # idx is ascending: ties to the lower index
                if action in (TOPK, ACCEPT):
                    break
                threshold = as_float32(threshold * DGC_LOWER)
                idx = select(x, threshold)
        comm.stats.extra["threshold"] = threshold
        update, residual = yield from self.allgather_exchange(x, idx, comm)
        if state is not None:
            assert state.velocity is not None and state.accumulated is not None
            positions = tf.expand_dims(idx, 1)
            state.velocity = tf.tensor_scatter_nd_update(state.velocity, positions, tf.zeros_like(idx, x.dtype))
            state.accumulated = tf.tensor_scatter_nd_update(state.accumulated, positions, tf.gather(residual, idx))
        return update, residual

    def _accumulate_velocity(self, x: tf.Tensor, state: MomentumState) -> tf.Tensor:
        """On entry ``x = v + g``; returns the new ``v`` after ``u = m u + g``, ``v = v + u``."""
        if state.velocity is None:
            state.velocity, state.accumulated = tf.zeros_like(x), tf.zeros_like(x)
        gradient = x - state.accumulated
        state.velocity = state.velocity * self.options.momentum + gradient
        state.accumulated = state.accumulated + state.velocity
        return state.accumulated
