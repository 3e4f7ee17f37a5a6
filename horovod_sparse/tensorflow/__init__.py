"""TensorFlow front end of horovod_sparse (TF 2.15, Keras 2 via ``tf.keras``).

    import horovod.tensorflow as hvd
    import horovod_sparse.tensorflow as hs

    tape = hs.DistributedGradientTape(tape, compression=hs.Compression.topk(density=0.01))

and for Keras, ``horovod_sparse.tensorflow.keras.DistributedOptimizer``. Same names, options and
exchange design as ``horovod_sparse.torch``; the methods are registered in the shared registry.
"""
from horovod_sparse.tensorflow.compression import Compression
from horovod_sparse.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from horovod_sparse.tensorflow.optimizer import DistributedOptimizer
from horovod_sparse.methods.base import Sparsifier

__all__ = ["Compression", "DistributedGradientTape", "DistributedOptimizer", "PartialDistributedGradientTape",
           "Sparsifier"]
