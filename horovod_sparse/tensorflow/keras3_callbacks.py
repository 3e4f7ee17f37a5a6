"""Horovod's Keras callbacks for Keras 3: ``horovod_sparse.tensorflow.keras.callbacks`` when
``tf.keras`` is Keras 3 (import this module directly for a ``keras`` 3 model while ``tf.keras``
is Keras 2).

Horovod 0.28.1's own (``horovod.tensorflow.keras.callbacks``) are written for Keras 2: its
broadcast fails on a Keras 3 variable (``'Variable' object has no attribute 'ref'``). These do
what Horovod's do, on Keras 3 models and optimizers:

* :class:`BroadcastGlobalVariablesCallback`: rank ``root_rank``'s model variables and optimizer
  variables (the wrapped optimizer's state and ``iterations``; those of a LossScaleOptimizer
  too) to every rank, once, when training begins (Keras 3 builds the optimizer before that, so
  the first step already starts from identical replicas; Horovod's waits for the end of the
  first batch, when a Keras 2 optimizer has made its variables). The exchange's residuals are
  per-rank state and are never broadcast; its step counter and shared method state follow rank
  0 at the first exchange (the checkpoint idiom, see the exchanger's ``_agree``).
* :class:`MetricAverageCallback`: every metric of the epoch's logs averaged over the ranks at
  the end of the epoch (put it before the callbacks that read them).

``LearningRateWarmupCallback``, ``LearningRateScheduleCallback`` and ``BestModelCheckpoint`` are
Horovod's Keras 2 callbacks: asking this module for one raises ``AttributeError`` naming the
Keras 3 way to do the same.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from horovod_sparse.tensorflow.keras3 import tf_variable

#: Horovod's Keras 2 callbacks not given here, and what does the same under Keras 3.
KERAS_2_ONLY = {
    "LearningRateWarmupCallback": "a learning-rate schedule with warm-up on the optimizer "
                                  "(keras.optimizers.schedules.CosineDecay(..., warmup_target=lr * hvd.size(), "
                                  "warmup_steps=...)) or keras.callbacks.LearningRateScheduler",
    "LearningRateScheduleCallback": "keras.callbacks.LearningRateScheduler(schedule) or a "
                                    "keras.optimizers.schedules schedule on the optimizer",
    "BestModelCheckpoint": "keras.callbacks.ModelCheckpoint(path, save_best_only=True), given on rank 0 only",
}


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` to every rank when
    training begins (once per callback), building the optimizer first if it is not yet built."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.broadcast_done:
            return
        optimizer = self.model.optimizer
        variables = list(self.model.variables)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        with tf.device(self.device):
            hvd.broadcast_variables([tf_variable(v) for v in variables], root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average every numeric metric of the epoch's logs over the ranks at the end of each epoch
    (in name order, the same collectives on every rank)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not logs:
            return
        with tf.device(self.device):
            for name in sorted(logs):
                value = logs[name]
                if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
                    mean = hvd.allreduce(tf.constant(value, tf.float64), op=hvd.Average,
                                         name=f"MetricAverageCallback.{name}")
                    logs[name] = float(mean.numpy())


def __getattr__(name: str) -> Any:
    if name in KERAS_2_ONLY:
        raise AttributeError(f"{name} is one of Horovod 0.28.1's Keras 2 callbacks (horovod.tensorflow.keras."
                             f"callbacks), not available under Keras 3; use {KERAS_2_ONLY[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BroadcastGlobalVariablesCallback", "KERAS_2_ONLY", "MetricAverageCallback"]
