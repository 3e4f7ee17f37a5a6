"""LAGS-SGD, TensorFlow: layer-wise Top-k per group of merged layers.

The PyTorch side (:mod:`horovod_sparse.torch.sparsifiers.lags`) exchanges each layer group from
the backward hooks as soon as it is complete and gives it the density whose allgather fits under
the backward computation still left (``t_comp``). ``tf.GradientTape.gradient`` (and so Keras)
returns every gradient at once, after the whole backward pass: no group's communication can hide
under backward, so ``t_comp`` is 0 for every group: the LAGS rule
(:func:`horovod_sparse.common.lags.lags_counts`) has no overlap to fill, the rule is not run and
every group sends the global ``density``; the cost models are therefore not measured. What remains is the method's
grouping (adjacent layers merged up to ``group_size`` elements) and error-feedback Top-k per group,
exchanged like Top-k; statistics report ``rho``, ``t_comp`` (0.0 with ``adaptive=True``, None
without), ``alpha``, ``beta`` and ``local_cost`` (None) as on the PyTorch side.
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod_sparse.common.grouping import MergeBySize
from horovod_sparse.common.lags import LagsOptions
from horovod_sparse.common.registry import implements
from horovod_sparse.tensorflow.collectives import Communicator
from horovod_sparse.tensorflow.selection import top_k
from horovod_sparse.tensorflow.sparsifier import Exchange, Sparsifier, Step


@implements("tensorflow", "lags")
class Lags(Sparsifier):
    """Top-k with error feedback per layer group at the global density (see the module docstring
    for why the adaptive rule gives the floor here). Traceable."""

    options: LagsOptions

    @property  # type: ignore[override]
    def default_grouping(self) -> MergeBySize:
        """Adjacent parameters merged up to ``group_size`` elements."""
        return MergeBySize(self.options.group_size)

    def exchange(self, x: tf.Tensor, comm: Communicator, state: Any, step: Step) -> Exchange:
        k = self.count(int(x.shape[0]), step)
        comm.stats.extra.update({"rho": self.density(step), "t_comp": 0.0 if self.options.adaptive else None,
                                 "alpha": None, "beta": None, "local_cost": None})
        with comm.timer("select"):
            idx = top_k(x, k)
        return (yield from self.allgather_exchange(x, idx, comm, fixed_count=k))
