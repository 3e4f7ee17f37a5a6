"""Slow, obviously-correct single-process references of the methods, fed every rank's gradients.

They follow ALGORITHMS.md line by line in NumPy with explicit loops over ranks, in the same
floating-point type as the workers (float32 unless told), so the selections match exactly and
aggregated values agree up to rounding.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import numpy as np

Selector = Callable[[np.ndarray, int], np.ndarray]


def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x| (a stable sort: ties go to the lower index)."""
    return np.argsort(-np.abs(x), kind="stable")[:k]


def error_feedback_steps(grads: Sequence[Sequence[np.ndarray]], dtype, average: bool,
                         exchange: Callable[[List[np.ndarray], int, np.floating], np.ndarray]
                         ) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """Error feedback over the steps of one group, given ``grads[t][r]``: from a zero residual per
    rank in ``dtype``, each step adds rank r's gradient into its residual (``x = g + e``) and
    ``exchange(xs, step, scale)`` changes every ``x`` into its residual and returns the update,
    each rank's contribution scaled by ``scale`` (1/n when averaging, else 1). Returns (the update
    of each step, each rank's final residual)."""
    n = len(grads[0])
    residuals = [np.zeros_like(grads[0][0], dtype=dtype) for _ in range(n)]
    scale = dtype(1.0 / n) if average else dtype(1.0)
    updates = []
    for step, per_rank in enumerate(grads):
        residuals = [residuals[r] + per_rank[r].astype(dtype) for r in range(n)]
        updates.append(exchange(residuals, step, scale))
    return updates, residuals


def allgather_method(grads: Sequence[Sequence[np.ndarray]], select: Selector, dtype=np.float32,
                     average: bool = True) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """Error-feedback sparsification with an allgather exchange (Top-k and the threshold
    baselines), for one group.

    Args:
        grads: ``grads[t][r]`` is rank r's flat gradient at step t.
        select: ``select(x, step)`` returns the indices rank r sends from ``x = g + e``.

    Returns:
        (aggregated update per step, final residual per rank).
    """
    return error_feedback_steps(grads, dtype, average, lambda xs, step, scale: allgather_step(xs, step, select, scale))


def allgather_step(xs: List[np.ndarray], step: int, select: Selector, scale: np.floating) -> np.ndarray:
    """One allgather exchange on the ranks' buffers ``xs = e + g``: each rank sends
    ``select(x, step)``, zeroed in place; returns the update, each contribution scaled by ``scale``."""
    out = np.zeros_like(xs[0])
    for x in xs:
        idx = select(x, step)
        out[idx] += scale * x[idx]
        x[idx] = 0
    return out
