"""Runnable benchmarks of horovod_sparse (see docs/benchmarks.md).

Every benchmark module is imported through this package, so it sets ``TF_USE_LEGACY_KERAS=1``
(unless the environment says otherwise) before any of them imports TensorFlow: ``tf.keras`` is
then Keras 2 (tf-keras), which ``horovod_sparse.tensorflow`` needs, in this process and in the
workers it launches (they inherit the environment)."""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
