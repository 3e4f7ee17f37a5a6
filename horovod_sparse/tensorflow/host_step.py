"""A traced step's exchange run on the host: for a variable list whose method decides from the
step's values or times (``Sparsifier.host_exchange``: MiCRO, ExDyna, DGC, Gaussian-k, gTop-k with
``recall_every``, LAGS's adaptive rule) or whose groups change between steps (MergeComp), the
step's sparse exchange runs eagerly, collectives included, in one ``tf.py_function`` each time the
traced step runs. Such a function holds one of TensorFlow's inter-op threads while its
collectives run and TensorFlow needs another to finish them: building one where the pool has
fewer than 2 threads raises ``RuntimeError`` naming the fix, before it can hang."""
from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Tuple

import tensorflow as tf

#: One counted step of a variable list: ``(gradients, loss scale) -> (aggregated, abandoned)``.
SparseStep = Callable[[List[tf.Tensor], Optional[tf.Tensor]], Tuple[List[tf.Tensor], Any]]


def inter_op_threads() -> int:
    """The threads of TensorFlow's inter-op pool: as configured
    (``tf.config.threading.set_inter_op_parallelism_threads``), else (0, the default) TensorFlow's
    choice, one per CPU this process may run on."""
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    if configured:
        return configured
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def host_step(step: SparseStep, kept: List[tf.Tensor], loss_scale: Optional[tf.Tensor],
              what: str) -> Tuple[List[tf.Tensor], tf.Tensor]:
    """``step(kept, loss_scale)`` as eager mode runs it, in one ``tf.py_function`` that runs it,
    collectives included, each time the traced step runs (``what`` runs there: named in the
    refusal). Only one such function runs at a time on a rank (every one is a stateful op,
    ordered by the function's automatic control dependencies), so ranks cannot block each other
    on two of them."""
    threads = inter_op_threads()
    if threads < 2:
        raise RuntimeError(
            f"horovod_sparse runs {what} on the host inside the traced step, in a tf.py_function that holds "
            f"one TensorFlow inter-op thread while its collectives run and needs another to finish them: with "
            f"{threads} inter-op thread the step would hang. Give TensorFlow at least 2 "
            f"(tf.config.threading.set_inter_op_parallelism_threads(2) before it starts; the default, 0, is one "
            f"per CPU), or run the step eagerly (Keras: run_eagerly=True)")

    def run(*inputs: tf.Tensor) -> List[Any]:
        exchanged, abandoned = step(list(inputs[:len(kept)]), None if loss_scale is None else inputs[-1])
        return [*exchanged, abandoned]

    *results, abandoned = tf.py_function(run, inp=kept if loss_scale is None else [*kept, loss_scale],
                                         Tout=[*(g.dtype for g in kept), tf.bool], name="horovod_sparse_host_step")
    for result, grad in zip(results, kept):
        result.set_shape(grad.shape)
    return results, abandoned
