"""Measurements of the running job, agreed across ranks, written once for every framework.

LAGS and the MergeComp scheduler decide from times measured on the job (an alpha-beta model of
the network, the local costs of selection and scatter-add, step times). Each rank measures its
own; the functions here make the figures identical on every rank (decisions taken from them then
agree) through one backend primitive, ``allgather_array`` (every rank's NumPy rows, in rank
order), and time the backend's own selection and scatter primitives. ``B`` is the framework's
backend module (:mod:`horovod_sparse.methods.backend`). Every function is a collective call:
every rank of ``process_set`` makes it at the same point.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from horovod_sparse.common.cost_model import AlphaBeta, LocalCost, calibrate


def agree_seconds(B: Any, values: Sequence[float], process_set: Any, name: str) -> List[float]:
    """The mean over the ranks of each of ``values``. Every rank averages the same gathered rows
    in the same order, so the result is bitwise identical on every rank. ``name`` names the
    collective (the same on every rank)."""
    gathered = B.allgather_array(np.asarray([list(values)], dtype=np.float64), process_set, name)
    return [float(v) for v in gathered.mean(axis=0)]


def agree_order(B: Any, order: Sequence[int], process_set: Any, name: str) -> List[int]:
    """The first rank's ``order`` (a sequence of the same length on every rank), on every rank."""
    gathered = B.allgather_array(np.asarray([list(order)], dtype=np.int64), process_set, name)
    return [int(v) for v in gathered[0]]


def measure_cost_model(B: Any, process_set: Any, sizes: Optional[Sequence[int]] = None, repeats: int = 5,
                       like: Optional[Any] = None) -> Tuple[AlphaBeta, List[Tuple[int, float]]]:
    """Fit the alpha-beta model to allgathers of float32 payloads timed now on ``process_set``,
    on ``like``'s device through the collectives the exchange uses there (the host's when None;
    see :func:`horovod_sparse.common.cost_model.calibrate` for ``sizes`` and ``repeats``).

    Returns:
        The model, identical on every rank, and the agreed ``(bytes_per_rank, seconds)`` samples.
    """

    def time_allgather(nbytes: int) -> float:
        start = time.perf_counter()
        B.allgather_payload(max(1, nbytes // 4), like, process_set, "hs.calibrate.allgather")
        return time.perf_counter() - start

    def agree(values: List[float]) -> List[float]:
        return agree_seconds(B, values, process_set, "hs.calibrate.agree")

    return calibrate(time_allgather, agree, process_set.size(), sizes, repeats)


def measure_local_cost(B: Any, process_set: Any, numel: int, low: int, high: int, repeats: int = 3,
                       like: Optional[Any] = None) -> LocalCost:
    """Time, on this rank and on ``like``'s device (the host's when None), the backend's exact
    top-k of a normal float32 buffer of ``numel`` elements at ``low`` and ``high`` coordinates
    and the scatter-add of ``n * high`` received pairs (what an allgather exchange runs), each
    run timed from an idle device to its end, agree the medians over ``process_set`` and fit
    :class:`~horovod_sparse.methods.lags.rule.LocalCost` to them: the same costs on every rank."""
    host = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    x = B.from_numpy(host, like)
    workers = process_set.size()
    chosen = B.top_k(x, high)
    indices = B.concat([chosen] * workers)
    values = B.concat([B.gather(x, chosen)] * workers)
    out = B.from_numpy(np.zeros_like(host), like)

    def seconds(work: Callable[[], Any]) -> float:
        work()
        timings = []
        for _ in range(repeats):
            B.synchronize(x)
            start = time.perf_counter()
            work()
            B.synchronize(x)
            timings.append(time.perf_counter() - start)
        return statistics.median(timings)

    def apply() -> None:
        B.scatter_chunks(out, indices, values, [high] * workers, 1.0 / workers)
        B.distinct(indices, numel)

    measured = [seconds(lambda: B.top_k(x, low)), seconds(lambda: B.top_k(x, high)), seconds(apply)]
    t_low, t_high, t_apply = agree_seconds(B, measured, process_set, "hs.lags.local_cost")
    return LocalCost.fit(numel, (low, t_low), (high, t_high), (workers * high, t_apply))
