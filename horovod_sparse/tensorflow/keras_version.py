"""Which Keras ``tf.keras`` is, and the refusal of Keras 3.

From TensorFlow 2.16 on, ``tf.keras`` is Keras 3 unless the environment variable
``TF_USE_LEGACY_KERAS=1`` is set before ``tf.keras`` is first used, which makes it the ``tf-keras``
package (Keras 2). This front end, and Horovod 0.28.1's Keras layer under it, are written for
Keras 2. Under Keras 3 they break in ways that do not say why: Horovod's broadcast callback fails
on a Keras 3 variable (``'Variable' object has no attribute 'ref'``), and a Keras 3 optimizer
trains with no exchange at all and no error (Keras 3 calls ``apply_gradients`` directly, while
Horovod's wrapper reduces in ``get_gradients`` / ``_compute_gradients``). So the front end refuses
Keras 3 up front: :func:`require_keras_2` when ``horovod_sparse.tensorflow`` is imported, and
:func:`refuse_keras_3` where a Keras optimizer is accepted (a Keras 3 optimizer can still be built
from the ``keras`` 3 package, ``import keras``, when ``tf.keras`` is Keras 2).
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import tensorflow as tf

#: How to get Keras 2, named in every refusal.
FIX = ("set TF_USE_LEGACY_KERAS=1 in the environment before TensorFlow is imported (with the tf-keras "
       "package installed, `pip install horovod_sparse[tensorflow]`), so that tf.keras is Keras 2, and build "
       "the model and the optimizer with tf.keras (or `import tf_keras`), not with the `keras` 3 package")


def major_version(keras: ModuleType) -> int:
    """The major version of the Keras package ``keras`` (a top-level module: ``keras``, ``tf_keras``)."""
    return int(keras.__version__.split(".")[0])


def require_keras_2() -> None:
    """Raise ``ImportError`` unless ``tf.keras`` is Keras 2 (TF 2.15's own, or ``tf-keras``)."""
    package = sys.modules[tf.keras.__name__.split(".")[0]]  # e.g. tf_keras.api._v2.keras -> tf_keras
    if major_version(package) >= 3:
        raise ImportError(f"horovod_sparse.tensorflow needs Keras 2 as tf.keras, but tf.keras is Keras "
                          f"{package.__version__} (TensorFlow {tf.__version__}'s default): {FIX}.")


def refuse_keras_3(obj: Any, argument: str) -> None:
    """Raise ``TypeError`` when ``obj``, passed as ``argument``, is an optimizer of the ``keras`` 3
    package. Only an imported ``keras`` can have made one, so nothing is imported here."""
    keras = sys.modules.get("keras")
    if keras is None or major_version(keras) < 3:
        return
    if isinstance(obj, keras.optimizers.Optimizer):
        raise TypeError(f"{argument}={type(obj).__module__}.{type(obj).__name__} is a Keras 3 optimizer, which "
                        f"Horovod 0.28.1's Keras layer cannot wrap (Keras 3 would apply the gradients without "
                        f"exchanging them): {FIX}.")


__all__ = ["FIX", "major_version", "refuse_keras_3", "require_keras_2"]
