"""TensorFlow front end of horovod_sparse (TF 2.21, with ``tf.keras`` Keras 2 (the tf-keras
package under ``TF_USE_LEGACY_KERAS=1``) or Keras 3 (TensorFlow's default): see
:mod:`horovod_sparse.tensorflow.keras_version`).

    import horovod.tensorflow as hvd
    import horovod_sparse.tensorflow as hs

    tape = hs.DistributedGradientTape(tape, compression=hs.Compression.topk(density=0.01))

and for Keras, ``horovod_sparse.tensorflow.keras.DistributedOptimizer``: Horovod's Keras layer
with the exchange installed for a Keras 2 optimizer, :mod:`horovod_sparse.tensorflow.keras3` for
a ``keras`` 3 one (the tape needs no Keras at all). Same names, options and exchange design as
``horovod_sparse.torch``; the methods are registered in the shared registry.

A codebase may move over with a global swap at start-up (``hvd.DistributedGradientTape =
hs.DistributedGradientTape``, ``hvd.DistributedOptimizer = hs.DistributedOptimizer``,
``horovod.tensorflow.keras.DistributedOptimizer = hs.keras.DistributedOptimizer``): these
wrappers never look Horovod's public names up when called (Horovod's pieces they reuse are bound
at import or private), so nothing recurses. The Horovod functions that do look them up when
called then build ours: ``hvd.PartialDistributedGradientTape``, ``hvd.DistributedOptimizer`` of
a Keras optimizer, and ``horovod.tensorflow.keras.load_model(path, compression=<sparsifier>)``
(an HDF5 file: Horovod's ``load_model`` cannot read the ``.keras`` format, swapped or not;
residuals start empty, restore them with ``model.optimizer.exchanger.load_state_dict``; Keras 2
only).
"""
from horovod_sparse.tensorflow.compression import Compression
from horovod_sparse.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from horovod_sparse.tensorflow.optimizer import DistributedOptimizer
from horovod_sparse.methods.base import Sparsifier

__all__ = ["Compression", "DistributedGradientTape", "DistributedOptimizer", "PartialDistributedGradientTape",
           "Sparsifier"]
