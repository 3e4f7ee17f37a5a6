"""Slow single-process reference of gTop-k, fed every rank's gradients.

Written independently of the implementation: plain loops over ranks, sets as dicts
``index -> (value, contributing ranks)``, the fold/recursive-doubling schedule spelled out with
XOR, and the tie rule of ``tests.support.reference.topk_indices`` (a stable sort: ties go to the lower
index). Contributor sets make "delivered" explicit: rank r's value at index i reached the model
iff r is among the contributors of i in the final set.
"""
from __future__ import annotations

from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from tests.support.reference import error_feedback_steps, topk_indices

Entry = Tuple[np.floating, FrozenSet[int]]
SparseDict = Dict[int, Entry]


def merge_sets(a: SparseDict, b: SparseDict, k: int) -> SparseDict:
    """Sum at common indices (contributors joined), keep the k largest |value|, ties to the
    lower index."""
    merged: SparseDict = {}
    for i in sorted(set(a) | set(b)):
        if i in a and i in b:
            merged[i] = (a[i][0] + b[i][0], a[i][1] | b[i][1])
        else:
            merged[i] = a[i] if i in a else b[i]
    indices = sorted(merged)
    values = np.array([merged[i][0] for i in indices])
    keep = topk_indices(values, k)
    return {indices[j]: merged[indices[j]] for j in sorted(keep)}


def butterfly_reduce(sets: List[SparseDict], k: int) -> List[SparseDict]:
    """What every rank holds after fold-in, the XOR rounds and fold-out."""
    n = len(sets)
    p = 1
    while 2 * p <= n:
        p *= 2
    sets = list(sets)
    for extra in range(p, n):
        sets[extra - p] = merge_sets(sets[extra - p], sets[extra], k)
    distance = 1
    while distance < p:
        sets = [merge_sets(sets[r], sets[r ^ distance], k) if r < p else sets[r] for r in range(n)]
        distance *= 2
    for extra in range(p, n):
        sets[extra] = sets[extra - p]
    return sets


def gtopk_method(grads: Sequence[Sequence[np.ndarray]], k_at: Callable[[int], int], residual: str = "exact",
                 dtype=np.float32, average: bool = True, trace: Optional[List[dict]] = None
                 ) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """gTop-k with error feedback for one group.

    Args:
        grads: ``grads[t][r]`` is rank r's flat gradient at step t.
        k_at: ``k_at(step)`` is the target count of that step.
        residual: ``"exact"`` (remove a rank's value only where it is in the final sum) or
            ``"paper"`` (remove every local top-k value whose index is in the final set).
        trace: when a list, one dict per step is appended: ``indices`` (the global set),
            ``recall`` and ``recall_mass`` (vs the exact top-k of the sum of ``g + e`` over ranks:
            the share of its coordinates, and of its magnitude, that the global set covers).

    Returns:
        (aggregated update per step, final residual per rank).
    """
    return error_feedback_steps(grads, dtype, average,
                                lambda xs, step, scale: gtopk_step(xs, k_at(step), scale, residual, trace))


def gtopk_step(xs: List[np.ndarray], k: int, scale: np.floating, residual: str = "exact",
               trace: Optional[List[dict]] = None) -> np.ndarray:
    """One gTop-k step on the ranks' buffers ``xs = e + g`` (zeroed in place where delivered,
    see :func:`gtopk_method` for ``residual`` and ``trace``); returns the update, each rank's
    contribution scaled by ``scale``."""
    n = len(xs)
    local = [{int(i): (xs[r][i], frozenset([r])) for i in topk_indices(xs[r], k)} for r in range(n)]
    held = butterfly_reduce(local, k)
    final = held[0]
    assert all(h == final for h in held), "the reference's ranks disagree"
    if trace is not None:
        magnitude = np.abs(sum(xs))
        exact = topk_indices(magnitude, k)
        trace.append({"indices": sorted(final), "recall": len(set(exact) & set(final)) / k,
                      "recall_mass": magnitude[sorted(final)].sum() / magnitude[exact].sum()})
    out = np.zeros_like(xs[0])
    for i, (value, _) in final.items():
        out[i] = scale * value
    for r in range(n):
        if residual == "exact":
            delivered = [i for i, (_, contributors) in final.items() if r in contributors]
        else:
            delivered = [i for i in local[r] if i in final]
        xs[r][delivered] = 0
    return out
