"""A Keras ``LossScaleOptimizer`` seen from the exchange: the scale this step's gradients carry.

Mixed precision (``tf.keras.mixed_precision``) multiplies the loss by the LossScaleOptimizer's
current scale, so gradients arrive multiplied by it, and a dynamic scale changes from step to
step (halved after an overflow, doubled after ``dynamic_growth_steps`` clean steps). Error
feedback must not carry that factor from one step to the next. Knowing the scale, the exchange
divides it out of each gradient as it enters the residual, runs the method in the loss's own
units (its thresholds, momentum and residuals do not depend on the scale, and a scale change
loses nothing) and multiplies the aggregate by the scale again, so that the LossScaleOptimizer's
``get_unscaled_gradients`` and ``apply_gradients`` get what a dense allreduce would give them.

Where the exchange finds the scale:

* ``DistributedGradientTape(..., loss_scaler=opt)``: ``opt.loss_scale``, read as the tape
  exchanges (``opt`` is the LossScaleOptimizer whose ``get_scaled_loss`` scaled the loss);
* the Keras ``DistributedOptimizer`` wrapped by a LossScaleOptimizer
  (``LossScaleOptimizer(hsk.DistributedOptimizer(...))``, or ``model.compile`` under the
  ``mixed_float16`` policy, which wraps it so): a dynamic LossScaleOptimizer makes its scale
  state a checkpoint dependency of the optimizer it wraps, named ``"loss_scale"`` (Keras saves
  the two as one optimizer), and the wrapper reads the scale there at each exchange. A fixed
  scale (``dynamic=False``) is a Python float the wrapped optimizer cannot see: its residuals
  then hold gradients times that constant scale (nothing is lost: it never changes);
* the Keras 3 ``DistributedOptimizer`` wrapping a Keras 3 LossScaleOptimizer
  (``hsk.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt))``,
  :mod:`horovod_sparse.tensorflow.keras3`): its ``dynamic_scale`` (:func:`keras_3_scale`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import tensorflow as tf

from horovod_sparse.tensorflow.keras_version import LEGACY_FIX, is_keras_3_optimizer

#: The current loss scale as a float32 scalar tensor (read when called), or None when the
#: gradients are not scaled.
ScaleReader = Callable[[], Optional[tf.Tensor]]

#: The name under which a dynamic LossScaleOptimizer tracks its scale state in the optimizer it
#: wraps (``_DynamicLossScaleState``, whose call returns the current scale).
_TRACKED_NAME = "loss_scale"


def scale_of(loss_scaler: Any) -> ScaleReader:
    """The reader of ``loss_scaler``'s current scale; ``TypeError`` unless it is a
    Keras 2 ``tf.keras.mixed_precision.LossScaleOptimizer`` (a Keras 3 one says what to do instead)."""
    if is_keras_3_optimizer(loss_scaler):
        raise TypeError(f"loss_scaler={type(loss_scaler).__module__}.{type(loss_scaler).__name__} is a Keras 3 "
                        "optimizer; the tape's loss_scaler is a Keras 2 LossScaleOptimizer (get_scaled_loss, "
                        "loss_scale). With Keras 3, wrap the optimizer instead: horovod_sparse.tensorflow.keras."
                        "DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt), ...); for the tape, "
                        f"{LEGACY_FIX} and pass tf.keras.mixed_precision.LossScaleOptimizer (tf-keras)")
    if not isinstance(loss_scaler, tf.keras.mixed_precision.LossScaleOptimizer):
        raise TypeError(f"loss_scaler={loss_scaler!r}: pass the tf.keras.mixed_precision.LossScaleOptimizer "
                        "whose get_scaled_loss(loss) the tape differentiates (or None without loss scaling)")
    return lambda: loss_scaler.loss_scale


def tracked_scale(optimizer: Any) -> ScaleReader:
    """The reader of the scale of the dynamic LossScaleOptimizer that wraps ``optimizer``, looked
    up at each call (the LossScaleOptimizer is built after it); None while none wraps it."""

    def read() -> Optional[tf.Tensor]:
        state = optimizer._lookup_dependency(_TRACKED_NAME)
        return None if state is None else state()

    return read


def keras_3_scale(loss_scale_optimizer: Any) -> ScaleReader:
    """The reader of the current scale of a Keras 3 ``keras.optimizers.LossScaleOptimizer``
    (always dynamic): its ``dynamic_scale`` variable, which exists once it is built (before the
    first exchange: the Keras 3 wrapper builds it first)."""
    return lambda: tf.convert_to_tensor(loss_scale_optimizer.dynamic_scale, tf.float32)


def rescaled(tensor: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    """``tensor * factor`` (``factor`` a float32 scalar) computed in float64 for float64 tensors
    and in float32 otherwise, in ``tensor``'s dtype: a float16 group neither overflows the factor
    (2**24 is beyond float16) nor turns ``0 * inf`` into NaN. For float32 it is the
    LossScaleOptimizer's own product, exact for its powers of two."""
    wide = tf.float64 if tensor.dtype == tf.float64 else tf.float32
    return tf.cast(tf.cast(tensor, wide) * tf.cast(factor, wide), tensor.dtype)


__all__ = ["ScaleReader", "keras_3_scale", "rescaled", "scale_of", "tracked_scale"]
