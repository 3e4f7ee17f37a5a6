"""Step statistics whose figures may be tensors, turned into plain numbers when the step runs.

The statistics records are the framework-free :class:`~horovod_sparse.common.stats.StepStats` /
:class:`~horovod_sparse.common.stats.GroupStats`. While a TensorFlow step is built, some figures
(the union of gathered indices, the bytes of a variable-length allgather, a threshold) are
tensors. :func:`publish` hands the finished record to a callback with every such figure replaced
by its value: at once in eager mode, and through one ``tf.py_function`` each time the step runs
when it is traced in a ``tf.function`` (so ``last_stats`` describes the step that actually ran,
not the trace).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, List

import tensorflow as tf

from horovod_sparse.common.stats import StepStats

#: The figures of a GroupStats that may hold tensors: scalar fields and dict fields (whose
#: values may be nested lists and dicts, as method-specific figures are).
_SCALAR_FIELDS = ("target", "selected", "union", "collectives")
_DICT_FIELDS = ("sent", "received", "extra")


class _Slot:
    """Placeholder for the ``index``-th tensor figure in a record whose tensors were taken out."""

    def __init__(self, index: int) -> None:
        self.index = index


def _map_figures(stats: StepStats, replace: Callable[[Any], Any]) -> None:
    """Apply ``replace`` to every figure of ``stats`` (recursing into lists and dicts), in place."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item) for item in value)
        return replace(value)

    stats.step = walk(stats.step)
    for group in stats.groups:
        for name in _SCALAR_FIELDS + _DICT_FIELDS:
            setattr(group, name, walk(getattr(group, name)))


def _take_tensors(stats: StepStats) -> List[tf.Tensor]:
    """Replace every tensor figure of ``stats`` by a :class:`_Slot`, in place (the figures a
    group noted as tensors, ``GroupStats.unread``, go into its ``extra`` first); return the
    tensors."""
    tensors: List[tf.Tensor] = []
    for group in stats.groups:
        group.extra.update(group.unread)
        group.unread.clear()

    def take(value: Any) -> Any:
        if isinstance(value, (tf.Tensor, tf.Variable)):
            tensors.append(tf.convert_to_tensor(value))
            return _Slot(len(tensors) - 1)
        return value

    _map_figures(stats, take)
    return tensors


def _fill(stats: StepStats, values: List[Any]) -> StepStats:
    """A copy of ``stats`` with every :class:`_Slot` replaced by its value (as a Python number)."""
    filled = copy.deepcopy(stats)
    _map_figures(filled, lambda value: _python_number(values[value.index]) if isinstance(value, _Slot) else value)
    return filled


def _python_number(value: Any) -> Any:
    """An eager tensor or NumPy scalar as a Python int/float (lists for non-scalars)."""
    if hasattr(value, "numpy"):
        value = value.numpy()
    return value.tolist() if hasattr(value, "tolist") else value


def publish(stats: StepStats, callback: Callable[[StepStats], None]) -> None:
    """Call ``callback`` with ``stats`` made of plain numbers, when the step runs.

    Eager mode: now. Inside a ``tf.function``: a ``tf.py_function`` is added to the graph (a
    stateful op, so the function runs it every step) that calls ``callback`` with the values of
    that step. ``stats`` must not be used by the caller afterwards.
    """
    tensors = _take_tensors(stats)
    if tf.executing_eagerly():
        callback(_fill(stats, tensors))
        return

    def record(*values: tf.Tensor) -> None:
        callback(_fill(stats, list(values)))

    tf.py_function(record, inp=tensors, Tout=[], name="horovod_sparse_stats")


__all__ = ["publish"]
