"""``horovod_sparse.tensorflow.keras``: the Keras optimizer wrapper, with sparse exchange.

    import horovod.tensorflow.keras as hvd
    import horovod_sparse.tensorflow.keras as hsk
    from horovod_sparse.tensorflow import Compression

    opt = hsk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9),
                                   compression=Compression.topk(density=0.01))
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hsk.callbacks.BroadcastGlobalVariablesCallback(0),
                               hsk.SparsificationStatsCallback()])

Keras 2 and Keras 3 both work. An optimizer of the ``keras`` 3 package (``keras.optimizers.*``,
and ``tf.keras.optimizers.*`` when ``tf.keras`` is Keras 3) is wrapped by
:mod:`horovod_sparse.tensorflow.keras3` (see there: exchange in ``apply``,
``jit_compile=False``, loss scaling as ``DistributedOptimizer(LossScaleOptimizer(opt))``), and
:mod:`callbacks` is then :mod:`horovod_sparse.tensorflow.keras3_callbacks`. The rest of this
docstring is the Keras 2 path (``tf.keras`` is tf-keras, ``TF_USE_LEGACY_KERAS=1``), where Horovod
0.28.1's Keras layer is used; under Keras 3 it is never imported (it does not work there).

On Keras 2 this is Horovod's own Keras wrapper (``horovod.tensorflow.keras.DistributedOptimizer``: same
arguments, local variables, ``backward_passes_per_step`` aggregation, process sets, Keras 2
optimizers new and legacy) with its gradient reduction replaced by a
:class:`~horovod_sparse.tensorflow.exchanger.GradientExchanger`. Gradients are exchanged after
the wrapped optimizer computes them and before it clips and applies them, so momentum, weight
decay and clipping act on the aggregated gradient, as in every reference implementation.

``model.fit`` traces the training step (a ``tf.function``) unless ``run_eagerly=True``; every
method works either way (see :mod:`horovod_sparse.tensorflow.exchanger` for the methods whose
exchange runs on the host inside the traced step).

Mixed precision is Keras' own: wrap this optimizer in a LossScaleOptimizer
(``tf.keras.mixed_precision.LossScaleOptimizer(hsk.DistributedOptimizer(...))``, or let
``model.compile`` wrap it under the ``mixed_float16`` policy). An overflow on any rank gives NaN
gradients on every rank, so the LossScaleOptimizer skips the step and halves its scale as around
Horovod's wrapper (it never calls this optimizer's ``apply_gradients`` then, so the ``nonfinite``
policy never acts), and the scale of a dynamic one is divided out of the residuals
(:mod:`horovod_sparse.tensorflow.loss_scale`).

On Keras 2, Horovod's callbacks work unchanged and are re-exported as :mod:`callbacks`
(``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``, ``LearningRateWarmupCallback``,
``LearningRateScheduleCallback``, ``BestModelCheckpoint``): the residuals are per-rank state and
are never broadcast. :class:`SparsificationStatsCallback` works under both.
"""
from __future__ import annotations

from typing import IO, Any, Dict, List, Optional

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_sparse.common.arguments import check_backward_passes, merge_num_groups
from horovod_sparse.common.dense_choice import DenseSpec
from horovod_sparse.common.stats import StepStats
from horovod_sparse.tensorflow.compression import Compression
from horovod_sparse.tensorflow.exchanger import GradientExchanger
from horovod_sparse.tensorflow.keras_version import LEGACY_FIX, is_keras_3_optimizer, tf_keras_is_keras_3
from horovod_sparse.tensorflow.loss_scale import tracked_scale

#: Whether ``tf.keras`` is Keras 3: Horovod's Keras layer is then never imported.
KERAS_3 = tf_keras_is_keras_3()
if KERAS_3:
    from horovod_sparse.tensorflow import keras3_callbacks as callbacks
    _impl: Any = None
else:
    import horovod._keras as _impl
    from horovod.tensorflow.keras import callbacks  # noqa: F401  (re-exported: Horovod's callbacks work as they are)


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None,
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = hvd.Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = hvd.Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None,
                         process_set: hvd.ProcessSet = hvd.global_process_set,
                         scale_local_gradients: bool = True,
                         stats_log: Optional[IO[str]] = None,
                         nonfinite: Optional[str] = "default",
                         hierarchical: Optional[bool] = None, dense: DenseSpec = None) -> Any:
    """Wrap a Keras optimizer so its gradients are exchanged over Horovod, sparsely when
    ``compression`` sparsifies.

    Takes every argument of ``horovod.tensorflow.keras.DistributedOptimizer`` with the same
    meaning (see there); ``compression`` may also be a horovod_sparse sparsifier, ``groups`` may
    also be ``"tensor"`` / ``"model"`` / ``"size:N"`` / ``"mergecomp"`` (or a ``MergeCompOptions``)
    with one, and ``stats_log`` is an optional
    text stream receiving one JSON line of statistics per exchange. ``nonfinite`` is the NaN/Inf
    policy of :func:`horovod_sparse.tensorflow.DistributedGradientTape`, acting where the step
    would be applied, as ``step()`` does in PyTorch: the gradients of an abandoned step are NaN
    on every rank, and ``apply_gradients`` of them applies no update (nor ``iterations``), eager
    or traced, so the variables and the optimizer state stay as they were, then raises
    ``FloatingPointError`` (``"raise"``; traced, a ``tf.errors`` error carrying its message) or
    warns (``"skip"``). A LossScaleOptimizer around this optimizer skips such a step before
    (see the module docstring). ``hierarchical`` is the two-tier sparse exchange and ``dense``
    the variables kept dense, as on :func:`horovod_sparse.tensorflow.DistributedGradientTape`.
    An optimizer of the ``keras`` 3 package is wrapped by :func:`horovod_sparse.tensorflow.keras3.wrap`
    (what differs there, and what is refused, is in that module's docstring); while ``tf.keras``
    is Keras 3 any other optimizer raises ``TypeError``.

    Returns:
        An optimizer of the same class as ``optimizer`` (dynamically subclassed, as Horovod
        does) with ``exchanger`` (``groups()``, ``residuals()``, ``steps``, ``state_dict()`` /
        ``load_state_dict()`` for exact resume) and ``last_stats``.
    """
    keras_3 = is_keras_3_optimizer(optimizer)
    if KERAS_3 and not keras_3:
        raise TypeError(f"optimizer={type(optimizer).__module__}.{type(optimizer).__name__} is not a Keras 3 "
                        "optimizer, while tf.keras is Keras 3: pass a keras.optimizers.Optimizer "
                        f"(tf.keras.optimizers.* is one here), or, for a Keras 2 optimizer, {LEGACY_FIX}")
    if op != hvd.Average and op != hvd.Sum:
        raise ValueError("op currently only supports Average and Sum")
    backward_passes_per_step = check_backward_passes(backward_passes_per_step)
    groups = merge_num_groups(num_groups, groups)
    if keras_3:
        from horovod_sparse.tensorflow import keras3

        groups = keras3.prepare(optimizer, groups, scale_local_gradients)
    wrapper_name = name or f"Distributed{type(optimizer).__name__}"
    exchanger = GradientExchanger(wrapper_name, compression, sparse_as_dense, op, gradient_predivide_factor,
                                  groups, process_set, device_dense, device_sparse, stats_log, nonfinite,
                                  backward_passes_per_step, hierarchical=hierarchical, dense=dense)
    if keras_3:
        return keras3.wrap(optimizer, exchanger, nonfinite, backward_passes_per_step, average_aggregated_gradients,
                           sparse_as_dense, process_set)
    # Horovod builds its wrapper (class, checks, local-gradient aggregation) around a dense
    # reduction; the exchanger then takes that reduction's place everywhere Horovod calls it.
    wrapped = _impl.create_distributed_optimizer(
        keras=tf.keras, optimizer=optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=hvd.Compression.none, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=1.0, op=op, backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=None, process_set=process_set, scale_local_gradients=scale_local_gradients)
    _install(wrapped, exchanger)
    return wrapped


def _install(optimizer: Any, exchanger: GradientExchanger) -> None:
    """Make ``exchanger`` the gradient reduction of Horovod's wrapper ``optimizer``, reading the
    loss scale of a LossScaleOptimizer that wraps it, with the ``nonfinite`` policy acting in
    ``apply_gradients``."""
    exchanger.loss_scale = tracked_scale(optimizer)
    exchanger.reports_in = "apply"
    optimizer._allreduce_grads = exchanger
    helper = optimizer._agg_helper
    if helper is not None:
        # The eager helper calls `allreduce_grads`, the graph helper `_allreduce_grads`.
        attribute = "allreduce_grads" if hasattr(helper, "allreduce_grads") else "_allreduce_grads"
        setattr(helper, attribute, exchanger)
    optimizer.exchanger = exchanger
    # The class was created by Horovod for this optimizer alone, so these stay local.
    cls = type(optimizer)
    cls.last_stats = property(lambda self: self.exchanger.last_stats,
                              doc="Statistics of the last exchange that ran (this rank).")
    apply_gradients = cls.apply_gradients

    def apply_gradients_unless_abandoned(self: Any, *args: Any, **kwargs: Any) -> Any:
        """Horovod's ``apply_gradients``, unless the gradients' exchange was abandoned: then no
        update, and the ``nonfinite`` policy (raise or warn). Traced, a ``tf.cond`` decides."""
        exchanger = self.exchanger
        if exchanger.nonfinite is None:
            return apply_gradients(self, *args, **kwargs)
        exchanger.update_unless_abandoned(exchanger.take_abandoned(), lambda: apply_gradients(self, *args, **kwargs))
        return self.iterations

    cls.apply_gradients = apply_gradients_unless_abandoned


class SparsificationStatsCallback(tf.keras.callbacks.Callback):
    """Adds the sparsification figures of the epoch to Keras' logs (so History, TensorBoard and
    progress bars show them): ``union_density`` (mean density that reached the model),
    ``density_ratio`` (union / target of the sparse groups) and ``bytes_sent`` (mean payload
    bytes per step sent by this rank)."""

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._records: List[StepStats] = []

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        stats = getattr(self.model.optimizer, "last_stats", None)
        if stats is not None:
            self._records.append(stats)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if logs is None or not self._records:
            return
        logs["union_density"] = float(np.mean([r.union_density for r in self._records]))
        logs["density_ratio"] = float(np.mean([r.density_ratio for r in self._records]))
        logs["bytes_sent"] = float(np.mean([r.bytes_sent() for r in self._records]))


def load_model(filepath: str, custom_optimizers: Optional[List[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None, compression: Any = hvd.Compression.none,
               legacy_opts: bool = False) -> tf.keras.Model:
    """``horovod.tensorflow.keras.load_model`` with the optimizer wrapped by this module's
    :func:`DistributedOptimizer` (residuals start empty: they are not part of a saved model).
    Keras 2 only (Horovod's ``load_model``): under Keras 3 it raises ``NotImplementedError``."""
    if _impl is None:
        raise NotImplementedError("load_model is Horovod 0.28.1's Keras 2 load_model; under Keras 3 load the model "
                                  "with keras.saving.load_model(path) and compile it again with "
                                  "DistributedOptimizer(...) (residuals start empty either way)")

    def wrap_optimizer(cls: type) -> Any:
        return lambda **kwargs: DistributedOptimizer(cls(**kwargs), compression=compression)

    return _impl.load_model(tf.keras, wrap_optimizer, filepath, custom_optimizers, custom_objects, legacy_opts)


__all__ = ["Compression", "DistributedOptimizer", "SparsificationStatsCallback", "callbacks", "load_model"]
