"""The Keras 3 optimizer wrapper (``keras`` 3 package, TensorFlow backend), with sparse exchange.

    import horovod.tensorflow as hvd
    import keras
    import horovod_sparse.tensorflow.keras as hsk
    from horovod_sparse.tensorflow import Compression

    hvd.init()
    opt = hsk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                   compression=Compression.topk(density=0.01))
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(x, y, callbacks=[hsk.callbacks.BroadcastGlobalVariablesCallback(0),
                               hsk.callbacks.MetricAverageCallback(),
                               hsk.SparsificationStatsCallback()])

:func:`horovod_sparse.tensorflow.keras.DistributedOptimizer` (and so
``horovod_sparse.tensorflow.DistributedOptimizer``) sends an optimizer of the ``keras`` 3 package
here, whatever ``tf.keras`` is. Horovod 0.28.1's Keras layer cannot wrap one: it reduces in
``get_gradients``, which Keras 3 never calls (its ``model.fit`` calls ``apply_gradients``, which
calls ``apply``), so it trains with no exchange at all and no error. This wrapper exchanges in
``apply``: the gradients go through a
:class:`~horovod_sparse.tensorflow.exchanger.GradientExchanger` (the one behind the tape and the
Keras 2 wrapper, with the same arguments) and the aggregate goes to the wrapped optimizer's own
``apply``, so weight decay, clipping, momentum and EMA act on the aggregated gradient, as on the
Keras 2 path. Eager (``run_eagerly=True``) and traced (``model.fit``'s default) alike, for every
method.

What the Keras 2 path does, this one does alike: ``backward_passes_per_step`` aggregates locally
with Horovod's own helper (one exchange every N ``apply`` calls, the passes in between only
count ``iterations``; ``average_aggregated_gradients`` divides the sum by N); the ``nonfinite``
policy acts in ``apply`` (an abandoned step applies no update and leaves ``iterations`` as it was,
then raises or warns; traced, ``"raise"`` surfaces as the ``tf.errors`` error carrying the
``FloatingPointError`` message); ``exchanger`` and ``last_stats`` are there.

Differences that Keras 3 imposes, each refused with the fix rather than ignored:

* **XLA**: Horovod's collectives and the host exchange of some methods are no XLA ops, so an
  ``apply`` traced under XLA raises ``RuntimeError``: compile with ``jit_compile=False``. Keras
  3's default ``jit_compile="auto"`` is off on a machine without GPU and on where one is visible.
* **Loss scaling** goes the other way round: ``DistributedOptimizer(keras.optimizers.
  LossScaleOptimizer(opt))``. The exchange then runs before the LossScaleOptimizer's finite check
  (with its scale divided out of the residuals, :func:`~horovod_sparse.tensorflow.loss_scale.
  keras_3_scale`): an overflow on any rank gives NaN on every rank, so every rank skips the step
  and halves its scale (the ``nonfinite`` policy leaves it to the scaler). A LossScaleOptimizer
  *around* this wrapper (``LossScaleOptimizer(DistributedOptimizer(opt))``, or what
  ``model.compile`` builds under the ``mixed_float16`` policy from a wrapper of a plain
  optimizer) would check each rank's own gradients before the exchange, and a rank that
  overflowed would skip the exchange the others wait in: it raises ``TypeError`` when built.
  Give ``model.compile`` the wrapped LossScaleOptimizer under ``mixed_float16`` (Keras wraps
  none again).
* Keras 3's own ``gradient_accumulation_steps`` would exchange at every pass: refused, use
  ``backward_passes_per_step``. ``scale_local_gradients=False`` acts on Horovod's local
  variables (``register_local_var``), which this wrapper does not have: refused.

The callbacks for Keras 3 are :mod:`horovod_sparse.tensorflow.keras3_callbacks`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import horovod.tensorflow as hvd
import keras
import tensorflow as tf
from horovod.tensorflow.gradient_aggregation_eager import LocalGradientAggregationHelperEager
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util

from horovod_sparse.common.nonfinite import resolve_nonfinite
from horovod_sparse.common.stats import StepStats
from horovod_sparse.tensorflow.exchanger import GradientExchanger
from horovod_sparse.tensorflow.loss_scale import keras_3_scale

#: Why an ``apply`` traced under XLA is refused, and the fix.
XLA_REFUSAL = ("horovod_sparse's exchange cannot run in an XLA-compiled step (Horovod's collectives and the "
               "host exchange of some methods are not XLA ops): compile the model with jit_compile=False "
               "(Keras 3's default jit_compile='auto' turns XLA on where a GPU is visible)")

#: Why a LossScaleOptimizer around the wrapper is refused, and the fix.
SCALER_AROUND_REFUSAL = (
    "keras.optimizers.LossScaleOptimizer around horovod_sparse's Keras 3 DistributedOptimizer (it sets the "
    "wrapped optimizer's loss_scale_factor to None; model.compile builds one under the mixed_float16 policy) "
    "would check each rank's own gradients before the exchange, and a rank that overflowed would skip the "
    "exchange the others wait in. Wrap the other way round: DistributedOptimizer(keras.optimizers."
    "LossScaleOptimizer(opt), ...), and give model.compile that (Keras does not wrap it again)")


def tf_variable(variable: Any) -> tf.Variable:
    """The ``tf.Variable`` that holds a Keras 3 variable's value on the TensorFlow backend (what
    Horovod's collectives and the exchanger's layouts take: a Keras 3 variable has no ``ref()``);
    a ``tf.Variable`` as it is."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _in_xla() -> bool:
    """Whether the step being traced is compiled by XLA (``tf.function(jit_compile=True)``, Keras'
    ``jit_compile``)."""
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


class _Distributed:
    """What the wrapper adds to the class of the wrapped Keras 3 optimizer (first in its MRO)."""

    #: Set once the wrapper is complete; a later ``loss_scale_factor = None`` is a
    #: LossScaleOptimizer wrapping it (refused in ``__setattr__``).
    _hs_wrapped = False
    exchanger: GradientExchanger
    #: Horovod's local aggregation helper with ``backward_passes_per_step`` > 1, else None.
    _hs_aggregation: Optional[LocalGradientAggregationHelperEager]

    @property
    def last_stats(self) -> Optional[StepStats]:
        """Statistics of the last exchange that ran (this rank)."""
        return self.exchanger.last_stats

    def __setattr__(self, name: str, value: Any) -> None:
        """Refuse ``loss_scale_factor = None`` once wrapped: a LossScaleOptimizer wrapping this one."""
        if name == "loss_scale_factor" and value is None and self._hs_wrapped:
            raise TypeError(SCALER_AROUND_REFUSAL)
        super().__setattr__(name, value)

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        """Exchange ``grads`` (one per variable of ``trainable_variables``, or of the variables the
        optimizer was built with), then apply the aggregate with the wrapped optimizer's
        ``apply``; with ``backward_passes_per_step`` > 1 only every N-th call exchanges and
        applies (the others count ``iterations``); an abandoned exchange applies nothing (the
        ``nonfinite`` policy). Traced, ``tf.cond`` decides; under XLA, ``RuntimeError``."""
        if _in_xla():
            raise RuntimeError(XLA_REFUSAL)
        update = super().apply  # type: ignore[misc]
        if trainable_variables is None:
            if not self.built:  # type: ignore[attr-defined]
                return update(grads)  # Keras' own error: build it first
            trainable_variables = self._trainable_variables  # type: ignore[attr-defined]
        variables = list(trainable_variables)
        if not len(grads):
            return update(grads, variables)
        if not self.built:  # type: ignore[attr-defined]
            # Before anything is traced into a branch: variables cannot be created there.
            with keras.name_scope(self.name, caller=self):  # type: ignore[attr-defined]
                self.build(variables)  # type: ignore[attr-defined]
        sources = [tf_variable(v) for v in variables]
        exchanger, helper = self.exchanger, self._hs_aggregation
        if helper is None:
            exchanged = exchanger(list(grads), sources)
        else:
            exchanged = helper.compute_gradients(tuple(grads), tuple(sources))
        abandoned: Any = False
        if exchanger.reports_in == "apply" and exchanger.nonfinite is not None:
            abandoned = exchanger.take_abandoned()
        ready: Any = True if helper is None else tf.equal(helper.counter, 0)

        def step() -> None:
            update(list(exchanged), variables)

        def step_unless_abandoned() -> None:
            exchanger.update_unless_abandoned(abandoned, step)

        def count_pass() -> None:
            self.iterations.assign_add(1)  # type: ignore[attr-defined]

        if ready is True or (tf.executing_eagerly() and bool(ready)):
            step_unless_abandoned()
        elif tf.executing_eagerly():
            count_pass()
        else:
            tf.cond(ready, step_unless_abandoned, count_pass)
        return None


def prepare(optimizer: keras.optimizers.Optimizer, groups: Any, scale_local_gradients: bool) -> Any:
    """Refuse what cannot apply to the Keras 3 ``optimizer`` (or a ``keras.optimizers.
    LossScaleOptimizer`` of one), with ``ValueError`` naming the fix: ``scale_local_gradients=False``
    (no local variables here) and Keras 3's own ``gradient_accumulation_steps`` (use
    ``backward_passes_per_step``). Returns ``groups`` with Keras 3 variables given as their
    ``tf.Variable`` (:func:`tf_variable`), what the exchanger's layouts match."""
    if not scale_local_gradients:
        raise ValueError("scale_local_gradients=False acts on Horovod's local variables (register_local_var), "
                         "which the Keras 3 wrapper does not have (it exchanges every variable); leave it True")
    inner = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    if inner.gradient_accumulation_steps:
        raise ValueError(f"gradient_accumulation_steps={inner.gradient_accumulation_steps} on the Keras 3 optimizer "
                         "would exchange at every pass: leave it unset and pass backward_passes_per_step="
                         f"{inner.gradient_accumulation_steps} to DistributedOptimizer (local aggregation, one "
                         "exchange per step)")
    if isinstance(groups, (list, tuple)):
        return [[tf_variable(v) for v in members] for members in groups]
    return groups


def wrap(optimizer: keras.optimizers.Optimizer, exchanger: GradientExchanger, nonfinite: Optional[str],
         backward_passes_per_step: int, average_aggregated_gradients: bool, sparse_as_dense: bool,
         process_set: hvd.ProcessSet) -> keras.optimizers.Optimizer:
    """The Keras 3 ``optimizer`` (checked by :func:`prepare`) wrapped so that its gradients go
    through ``exchanger`` in ``apply``: what :func:`horovod_sparse.tensorflow.keras.DistributedOptimizer`
    returns for a ``keras`` 3 optimizer, whose arguments these are (see there; XLA and loss
    scaling: the module docstring). ``nonfinite=None`` with a sparsifier around a
    LossScaleOptimizer is refused with ``ValueError``.

    Returns:
        An optimizer of the same class as ``optimizer``, built from its config (dynamically
        subclassed, as Horovod does), with ``exchanger`` (``groups()``, ``residuals()``,
        ``steps``, ``state_dict()`` / ``load_state_dict()``) and ``last_stats``.
    """
    scaler = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if scaler:
        resolve_nonfinite(nonfinite, exchanger.sparse, scaled=True)  # a sparsifier refuses None
    cls = type(type(optimizer).__name__, (_Distributed, type(optimizer)), {})
    wrapped = cls.from_config(optimizer.get_config())
    if scaler:
        # The LossScaleOptimizer skips an abandoned (NaN) step on every rank and halves its scale.
        exchanger.loss_scale = keras_3_scale(wrapped)
        exchanger.reports_in = None
    else:
        exchanger.reports_in = "apply"
    wrapped.exchanger = exchanger
    wrapped._hs_aggregation = None if backward_passes_per_step == 1 else LocalGradientAggregationHelperEager(
        backward_passes_per_step, exchanger, sparse_as_dense, average_aggregated_gradients, process_set, True)
    wrapped._hs_wrapped = True
    return wrapped


__all__ = ["SCALER_AROUND_REFUSAL", "XLA_REFUSAL", "prepare", "tf_variable", "wrap"]
