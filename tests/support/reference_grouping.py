"""Slow reference of a whole model's exchange, group by group, as the method x grouping matrices
check it: each step's groups (given, as the optimizer formed them; MergeComp changes them
between steps), the dense groups (given by the caller's rule), one residual per rank and
coordinate that carries over from one grouping to the next, and each group's method state,
which restarts when the grouping changes.

Each group's sparse step is one of the independent per-method references (``tests.support.reference``,
``tests.support.reference_gtopk``, ``tests.support.reference_partitioned``, ``tests.support.reference_sparseloco``, the
threshold baselines' NumPy selections), fed the same gradients, in float32.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tests.support.reference import allgather_step, topk_indices
from tests.support.reference_gtopk import gtopk_step
from tests.support.reference_partitioned import PartitionedGroup
from tests.support.reference_sparseloco import DEFAULTS as SPARSELOCO_DEFAULTS, sparseloco_step
from tests.torch.test_threshold_baselines import DENSITY as BASELINE_DENSITY, SELECTORS

#: ``exchange(xs, step)``: one sparse step of a group on the ranks' float32 buffers ``xs = e + g``
#: (zeroed in place where delivered); returns the aggregated update.
GroupExchange = Callable[[List[np.ndarray], int], np.ndarray]
Members = List[int]


def group_exchange(method: str, options: Dict, numel: int, ranks: int,
                   shapes: Optional[Sequence[Sequence[int]]] = None) -> GroupExchange:
    """A fresh reference of ``method`` (with ``options``) for a group of ``numel`` elements (the
    parameters of ``shapes``, which SparseLoCo's ``blocks`` reads)."""
    density = options.get("density", SPARSELOCO_DEFAULTS["density"] if method == "sparseloco" else 0.01)
    k, scale = max(1, int(density * numel)), np.float32(1.0 / ranks)
    if options.get("density_schedule") is not None:
        raise NotImplementedError("the grouping reference takes a constant density")
    if method == "lags" and options.get("adaptive", True):
        raise NotImplementedError("LAGS's adaptive densities follow measured times: give adaptive=False")
    if method in ("topk", "lags"):
        return functools.partial(allgather_step, select=lambda x, step: topk_indices(x, k), scale=scale)
    if method in ("threshold", "dgc", "gaussiank"):
        if density != BASELINE_DENSITY or set(options) - {"density", "min_numel", "warmup_steps"}:
            raise NotImplementedError(f"the {method} selection is written for density {BASELINE_DENSITY} only")
        return functools.partial(allgather_step, select=SELECTORS[method], scale=scale)
    if method == "gtopk":
        return lambda xs, step: gtopk_step(xs, k, scale, options.get("residual", "exact"))
    if method == "sparseloco":
        return functools.partial(sparseloco_step, options=options, scale=scale, shapes=shapes)
    if method in ("micro", "exdyna"):
        group = PartitionedGroup(method, options, numel, ranks)
        return lambda xs, step: group.exchange(xs, step)[0]
    raise NotImplementedError(f"no reference for {method!r}")


def model_reference(stream: Sequence[Sequence[Sequence[np.ndarray]]], groups_at: Sequence[Sequence[Members]],
                    is_dense: Callable[[int, int], bool],
                    new_exchange: Callable[[Members], GroupExchange]
                    ) -> Tuple[List[np.ndarray], List[List[np.ndarray]]]:
    """The exchange of every step.

    Args:
        stream: ``stream[t][r][i]``: rank r's flat gradient (float64) of parameter i at step t.
        groups_at: ``groups_at[t]``: the groups of step t, lists of parameter indices in buffer order.
        is_dense: ``is_dense(step, numel)``: whether a group of ``numel`` elements is allreduced dense
            (the raw gradients' mean; its residual is left as it is).
        new_exchange: ``new_exchange(members)``: a fresh :data:`GroupExchange` for a group of
            those parameters.

    Returns:
        (``updates[t][i]``: the aggregated gradient of parameter i at step t (float64),
        ``residuals[r][i]``: rank r's final residual of parameter i (float64)).
    """
    ranks = len(stream[0])
    residuals = [[np.zeros(g.size, dtype=np.float32) for g in stream[0][0]] for _ in range(ranks)]
    updates: List[np.ndarray] = []
    exchanges: Dict[Tuple[int, ...], GroupExchange] = {}
    for step, per_rank in enumerate(stream):
        if step and groups_at[step] != groups_at[step - 1]:
            exchanges = {}  # a regrouping: residuals carry over, method states restart
        out: List[np.ndarray] = [np.zeros(0)] * len(per_rank[0])
        for members in groups_at[step]:
            sizes = [per_rank[0][i].size for i in members]
            cuts = np.cumsum(sizes)[:-1]
            if is_dense(step, sum(sizes)):
                total = sum(np.concatenate([g[i] for i in members]).astype(np.float32) for g in per_rank)
                update = total * np.float32(1.0 / ranks)
            else:
                xs = [np.concatenate([residuals[r][i] + per_rank[r][i].astype(np.float32) for i in members])
                      for r in range(ranks)]
                exchange = exchanges.setdefault(tuple(members), new_exchange(members))
                update = exchange(xs, step)
                for r, x in enumerate(xs):
                    for i, part in zip(members, np.split(x, cuts)):
                        residuals[r][i] = part
            for i, part in zip(members, np.split(update, cuts)):
                out[i] = part.astype(np.float64)
        updates.append(out)
    return updates, [[e.astype(np.float64) for e in per_rank] for per_rank in residuals]
