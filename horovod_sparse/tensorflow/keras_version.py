"""Which Keras ``tf.keras`` is, and which Keras an optimizer belongs to.

From TensorFlow 2.16 on, ``tf.keras`` is Keras 3 unless the environment variable
``TF_USE_LEGACY_KERAS=1`` is set before ``tf.keras`` is first used, which makes it the ``tf-keras``
package (Keras 2). The front end works under both:

* Keras 2 (``tf.keras`` is tf-keras): the Keras wrapper is Horovod 0.28.1's own Keras layer
  (``horovod._keras``) with the exchange installed, and Horovod's callbacks;
* Keras 3 (the ``keras`` package, TensorFlow backend): Horovod's Keras layer is written for
  Keras 2 and breaks there without saying why (its broadcast callback fails on a Keras 3
  variable, ``'Variable' object has no attribute 'ref'``; its optimizer wrapper reduces in
  ``get_gradients``, which Keras 3 never calls, so training runs with no exchange and no error).
  So it is never imported on that path: a Keras 3 optimizer is wrapped by
  :mod:`horovod_sparse.tensorflow.keras3`, and :mod:`horovod_sparse.tensorflow.keras3_callbacks`
  gives the callbacks.

The Keras of an optimizer decides which wrapper takes it (:func:`is_keras_3_optimizer`), so a
``keras`` 3 optimizer is wrapped for Keras 3 also while ``tf.keras`` is Keras 2.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import tensorflow as tf

#: How to get Keras 2 as ``tf.keras``, named where only Keras 2 will do.
LEGACY_FIX = ("set TF_USE_LEGACY_KERAS=1 in the environment before TensorFlow is imported (with the tf-keras "
              "package installed, `pip install horovod_sparse[tensorflow]`), so that tf.keras is Keras 2")


def major_version(keras: ModuleType) -> int:
    """The major version of the Keras package ``keras`` (a top-level module: ``keras``, ``tf_keras``)."""
    return int(keras.__version__.split(".")[0])


def tf_keras_is_keras_3() -> bool:
    """Whether ``tf.keras`` is Keras 3 (TensorFlow >= 2.16 without ``TF_USE_LEGACY_KERAS=1``)."""
    package = sys.modules[tf.keras.__name__.split(".")[0]]  # e.g. tf_keras.api._v2.keras -> tf_keras
    return major_version(package) >= 3


def is_keras_3_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is an optimizer of the ``keras`` 3 package (``keras.optimizers.Optimizer``).
    Only an imported ``keras`` can have made one, so nothing is imported here."""
    keras = sys.modules.get("keras")
    return keras is not None and major_version(keras) >= 3 and isinstance(obj, keras.optimizers.Optimizer)


__all__ = ["LEGACY_FIX", "is_keras_3_optimizer", "major_version", "tf_keras_is_keras_3"]
