"""Non-finite gradients in a TensorFlow exchange (``nonfinite="raise"|"skip"``, sparse exchanges):
each rank checks its gradients and one allgather of one int32 per rank tells every rank, *before*
anything is exchanged, whether any saw a NaN/Inf; if one did, the step is abandoned everywhere
(every returned gradient NaN, each finite sparse group's gradient kept in its residual) and the
policy acts where the step would be applied (the exchanger's module docstring says where)."""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Tuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_sparse.common.nonfinite import apply_nonfinite_policy
from horovod_sparse.common.stats import StepStats
from horovod_sparse.methods.base import Step
from horovod_sparse.tensorflow import recording
from horovod_sparse.tensorflow.layout import Layout


def _all_finite(tensor: tf.Tensor) -> tf.Tensor:
    """Whether every element of ``tensor`` is finite (a boolean scalar), as the PyTorch side
    decides it: a NaN or Inf anywhere makes the sum non-finite, so one summing pass settles the
    usual case; only a non-finite sum (finite values near the dtype's maximum can also overflow
    it) takes the exact elementwise check, which writes a full-size boolean tensor."""
    accumulate = tf.float64 if tensor.dtype == tf.float64 else tf.float32
    return tf.cond(tf.math.is_finite(tf.reduce_sum(tf.cast(tensor, accumulate))), lambda: tf.constant(True),
                   lambda: tf.reduce_all(tf.math.is_finite(tensor)))


class NonfiniteSteps:
    """The non-finite policy of :class:`~horovod_sparse.tensorflow.exchanger.GradientExchanger` (a
    base of it): it reads the exchanger's ``nonfinite``, ``reports_in``, ``process_set`` and its
    step (``_exchange_step``, ``_dense_step``, ``_end_step``, ``_record``), and keeps
    ``_abandoned_report`` and ``_abandoned``."""

    # -- where the policy acts ----------------------------------------------------------------------
    def _abandoned_flag(self) -> tf.Variable:
        """Whether the last exchange was abandoned, created on first use outside any ``tf.function``."""
        if self._abandoned is None:
            with tf.init_scope():
                self._abandoned = tf.Variable(False, trainable=False, name="hs_abandoned")
        return self._abandoned

    def take_abandoned(self) -> Any:
        """Whether the gradients of the last exchange were abandoned (a bool; a boolean tensor
        inside a ``tf.function``), then forgets it: the Keras wrapper asks once per update, and
        then applies no update and calls :meth:`report_abandoned`."""
        flag = self._abandoned_flag()
        abandoned = flag.read_value()
        if tf.executing_eagerly():
            abandoned = bool(abandoned)
        flag.assign(False)
        return abandoned

    def report_abandoned(self) -> None:
        """Apply the ``nonfinite`` policy to the last abandoned exchange (``reports_in="apply"``):
        raise ``FloatingPointError`` (``"raise"``) or warn (``"skip"``)."""
        assert self.nonfinite is not None and self._abandoned_report is not None
        apply_nonfinite_policy(self.nonfinite, *self._abandoned_report)

    def update_unless_abandoned(self, abandoned: Any, update: Callable[[], Any]) -> None:
        """Run ``update`` (the optimizer's update with the exchanged gradients) unless
        ``abandoned`` (what :meth:`take_abandoned` returned; False where the policy is off): then
        no update, and :meth:`report_abandoned` instead. A boolean tensor (traced) decides in a
        ``tf.cond``, the report running in a ``tf.py_function``; ``update``'s result is dropped."""
        if not tf.is_tensor(abandoned):
            if abandoned:
                self.report_abandoned()
            else:
                update()
            return

        def report() -> None:
            tf.py_function(self.report_abandoned, inp=[], Tout=[], name="horovod_sparse_abandoned")

        def apply() -> None:
            update()

        tf.cond(abandoned, report, apply)

    # -- in the step ------------------------------------------------------------------------------
    def _exchange_if_finite(self, kept: List[tf.Tensor], layout: Layout, step: Step, counter: tf.Variable,
                            loss_scale: Optional[tf.Tensor]) -> Tuple[List[tf.Tensor], Any]:
        """The step's exchange if no rank has a non-finite gradient, else :meth:`_abandon`;
        counts the step, then reports it (:meth:`_report_nonfinite`). Returns the gradients and
        whether the step was abandoned: the report's answer (traced: its ``tf.py_function``'s
        output, so that whatever reads it, :meth:`take_abandoned`, runs after the report)."""
        finite = [tf.reduce_all([_all_finite(kept[p]) for p in group.positions])
                  for group in layout.groups]
        local = tf.reshape(tf.cast(tf.logical_not(tf.reduce_all(finite)), tf.int32), [1])
        flags = hvd.allgather(local, name="hs.nonfinite", ignore_name_scope=True, process_set=self.process_set)
        if isinstance(step, int):
            if bool(tf.reduce_any(flags > 0)):
                exchanged = self._abandon(kept, layout, step, finite, loss_scale)
            else:
                exchanged = self._exchange_step(kept, layout, step, loss_scale)
        else:
            exchanged = tf.cond(tf.reduce_any(flags > 0),
                                lambda: self._abandon(kept, layout, step, finite, loss_scale),
                                lambda: self._exchange_step(kept, layout, step, loss_scale))
        counter.assign_add(1)
        report = functools.partial(self._report_nonfinite, [g.name for g in layout.groups])
        if isinstance(step, int):
            return exchanged, report(flags, tf.stack(finite), step)
        return exchanged, tf.py_function(report, inp=[flags, tf.stack(finite), step], Tout=tf.bool,
                                         name="horovod_sparse_nonfinite")

    def _abandon(self, kept: List[tf.Tensor], layout: Layout, step: Step, finite: List[tf.Tensor],
                 loss_scale: Optional[tf.Tensor]) -> List[tf.Tensor]:
        """An abandoned step: nothing is exchanged and every gradient returned is NaN (so a loss
        scaler sees the overflow, as after Horovod's allreduce of one); each sparse group finite
        on this rank adds its gradient (divided by ``loss_scale``) to its residual, the others
        keep their residual as it was."""
        warm = self._dense_step(layout, step)
        for group in layout.groups:
            if not layout.engine.takes_sparse(group.numel, False, group.kept_dense):
                continue  # exchanged densely: this step's gradient is dropped
            before = group.residual_value()
            x = group.load_gradients(kept, loss_scale)
            group.store_residual(tf.where(tf.logical_and(finite[group.index], tf.logical_not(warm)), x, before))
        recording.publish(StepStats(step=step, abandoned=True), self._record)
        if isinstance(step, int):
            self._end_step(layout)
        return [tf.fill(g.shape, tf.constant(np.nan, g.dtype)) for g in kept]

    def _report_nonfinite(self, names: List[str], flags: Any, finite: Any, step: Any) -> bool:
        """Whether some rank had a non-finite gradient (``flags[r]``: rank r saw a NaN/Inf;
        ``finite[i]``: whether group ``names[i]`` is finite here). If one had, keep the report
        for :meth:`report_abandoned` and, with ``reports_in="exchange"``, apply the
        ``nonfinite`` policy now."""
        bad_ranks = [rank for rank, flag in enumerate(np.asarray(flags)) if flag]
        if not bad_ranks:
            return False
        assert self.nonfinite is not None
        groups = [name for name, ok in zip(names, np.asarray(finite)) if not ok]
        self._abandoned_report = (bad_ranks, int(np.asarray(step)), groups)
        if self.reports_in == "exchange":
            apply_nonfinite_policy(self.nonfinite, *self._abandoned_report)
        return True
