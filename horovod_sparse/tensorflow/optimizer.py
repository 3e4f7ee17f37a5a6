"""``horovod_sparse.tensorflow.DistributedOptimizer``: ``hvd.DistributedOptimizer``'s dispatch.

As in Horovod, a Keras optimizer is wrapped by the Keras wrapper
(:func:`horovod_sparse.tensorflow.keras.DistributedOptimizer`: Horovod's Keras layer for a Keras 2
one, :mod:`horovod_sparse.tensorflow.keras3` for a ``keras`` 3 one). A TF1 ``tf.compat.v1.train``
optimizer goes to Horovod's own wrapper with a dense compression; with a sparsifier it is refused
(graph-mode sessions are not supported; use a Keras optimizer or ``DistributedGradientTape``).

A program may swap this function in for Horovod's at start-up
(``hvd.DistributedOptimizer = hs.DistributedOptimizer``): the TF1 branch calls Horovod's own
wrapper, bound when this module is imported, never the module attribute the swap replaced
(which would be this function again: an endless recursion).
"""
from __future__ import annotations

from typing import IO, Any, Optional

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_sparse.common.dense_choice import DenseSpec
from horovod_sparse.tensorflow import keras
from horovod_sparse.methods.base import Sparsifier

#: ``horovod.tensorflow.DistributedOptimizer`` as Horovod defines it. Bound here, before any
#: program can replace the module attribute with :func:`DistributedOptimizer`: swapping needs
#: this module imported first.
_HorovodOptimizer = hvd.DistributedOptimizer


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "", compression: Any = hvd.Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: Any = hvd.Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None,
                         process_set: hvd.ProcessSet = hvd.global_process_set,
                         scale_local_gradients: bool = True, stats_log: Optional[IO[str]] = None,
                         nonfinite: Optional[str] = "default", dense: DenseSpec = None) -> Any:
    """Wrap ``optimizer`` as ``horovod.tensorflow.DistributedOptimizer`` does, with the same
    arguments; a sparsifier as ``compression`` (and so ``nonfinite`` and ``dense``) requires a
    Keras optimizer."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if isinstance(compression, Sparsifier):
            raise TypeError(f"{type(optimizer).__name__} is a TF1 tf.compat.v1.train optimizer, which "
                            "horovod_sparse does not wrap with a sparsifier; use a Keras optimizer "
                            "(tf.keras.optimizers.*) or horovod_sparse.tensorflow.DistributedGradientTape")
        return _HorovodOptimizer(optimizer, name, use_locking, device_dense, device_sparse, compression,
                                 sparse_as_dense, backward_passes_per_step, op, gradient_predivide_factor,
                                 average_aggregated_gradients, num_groups, groups, process_set,
                                 scale_local_gradients)
    return keras.DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                      gradient_predivide_factor, op, backward_passes_per_step,
                                      average_aggregated_gradients, num_groups, groups, process_set,
                                      scale_local_gradients, stats_log, nonfinite, dense=dense)


__all__ = ["DistributedOptimizer"]
