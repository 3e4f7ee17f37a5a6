"""The alpha-beta (Hockney) cost model of collectives: fitted from timed allgathers, used to
predict what an exchange costs.

A message step costs ``alpha`` seconds of latency plus ``beta`` seconds per byte. With ``n``
workers and the usual algorithms (recursive doubling / halving, ring) the collectives cost:

=====================  ============================================================
allgather              ``alpha * log2(n) + (n - 1) * beta * b``   (``b`` bytes per rank)
reduce-scatter         ``alpha * log2(n) + (n - 1) / n * beta * N`` (``N`` bytes in all)
allreduce              ``2 * alpha * log2(n) + 2 * (n - 1) / n * beta * N``
alltoall               ``(n - 1) * alpha + (n - 1) / n * beta * N`` (``N`` bytes per rank)
broadcast              ``log2(n) * (alpha + beta * N)``             (binomial tree)
=====================  ============================================================

:func:`fit_allgather` fits ``alpha`` and ``beta`` to allgathers timed on the running cluster
(:func:`calibration_sizes` says which payloads to time, :func:`calibrate` runs the whole
measurement through two callables a framework provides); :class:`AlphaBeta` predicts the time of
any of the collectives above and of the sparse exchanges built from them, for the measured
worker count or, with :meth:`AlphaBeta.with_workers`, for another one (scaling projections).
The model ignores contention and compute; it is meant for choices (LAGS densities) and for
projections, not for exact timings.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from horovod_sparse.common.validation import check_int

#: Bytes of one float32 value / one int32 index on the wire.
VALUE_BYTES = 4
INDEX_BYTES = 4
#: Bytes of one bf16 value: the dense all-reduce :func:`break_even_link` compares against.
BF16_BYTES = 2


@dataclass(frozen=True)
class AlphaBeta:
    """An alpha-beta model of the collectives among ``workers`` processes.

    Attributes:
        alpha: latency of one message step, in seconds.
        beta: transfer time per byte, in seconds (1 / bandwidth).
        workers: the number of processes ``n`` the predictions are for.
    """

    alpha: float
    beta: float
    workers: int

    def __post_init__(self) -> None:
        check_int("workers", self.workers, minimum=1)
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0 seconds, got {value}")

    @property
    def log2n(self) -> float:
        """``log2(n)``: message steps of a recursive-doubling collective (0 for one worker)."""
        return math.log2(self.workers)

    def with_workers(self, workers: int) -> "AlphaBeta":
        """The same network (alpha, beta) with another number of workers."""
        return AlphaBeta(self.alpha, self.beta, workers)

    # -- collectives ------------------------------------------------------------------------------
    def allgather(self, bytes_per_rank: float) -> float:
        """Seconds for every rank to gather ``bytes_per_rank`` bytes from each of the others."""
        return self.alpha * self.log2n + (self.workers - 1) * self.beta * bytes_per_rank

    def reduce_scatter(self, nbytes: float) -> float:
        """Seconds to reduce ``nbytes`` and leave each rank its 1/n share."""
        n = self.workers
        return self.alpha * self.log2n + (n - 1) / n * self.beta * nbytes

    def allreduce(self, nbytes: float) -> float:
        """Seconds for a dense allreduce of ``nbytes`` (reduce-scatter then allgather)."""
        return self.reduce_scatter(nbytes) + self.allgather(nbytes / self.workers)

    def alltoall(self, bytes_per_rank: float) -> float:
        """Seconds for an alltoall where each rank sends ``bytes_per_rank`` in all, spread evenly."""
        n = self.workers
        return (n - 1) * self.alpha + (n - 1) / n * self.beta * bytes_per_rank

    # -- exchanges --------------------------------------------------------------------------------
    def dense_allreduce(self, numel: int, value_bytes: int = VALUE_BYTES) -> float:
        """Seconds for Horovod's dense exchange of ``numel`` gradient elements."""
        return self.allreduce(numel * value_bytes)

    def sparse_allgather(self, count: int, value_bytes: int = VALUE_BYTES,
                         index_bytes: int = INDEX_BYTES) -> float:
        """Seconds for the allgather exchange of Top-k and LAGS: ``count`` (value, index) pairs
        per rank. ``2 (n - 1) beta' k`` of the LAGS paper is this with 4-byte values and indices
        and ``beta' = 4 beta`` per element."""
        return self.allgather(count * (value_bytes + index_bytes))

    def as_dict(self) -> Dict[str, float]:
        """``{"alpha": ..., "beta": ..., "workers": ...}``, JSON-serialisable."""
        return asdict(self)


def break_even_link(parameters: int, added_seconds: float, wire: Callable[[AlphaBeta], float],
                    workers: int) -> Optional[float]:
    """The link bandwidth, in bits/s, below which a compressed step beats a dense bf16 all-reduce.

    Both steps share the compute; on ``workers`` ranks, each with a link of ``bw`` bits/s
    (``beta = 8 / bw`` seconds per byte) and latency ignored (``alpha = 0``):

    * dense step: ``compute + AlphaBeta(0, beta, n).dense_allreduce(parameters, BF16_BYTES)``,
      the ring's ``2 (n - 1) / n * 2 * parameters * beta``;
    * compressed step: ``compute + added_seconds + wire(AlphaBeta(0, beta, n))``, e.g.
      ``wire = lambda ab: ab.allgather(bytes_per_rank)`` (``(n - 1) * bytes_per_rank * beta``) for
      an allgather-based method, or a law of :data:`benchmarks.emulated.wire.WIRE` for the method's own
      collectives.

    With ``alpha = 0`` every collective of the model is ``beta`` times a byte count, so with
    ``D = dense / beta`` and ``W = wire / beta`` the steps are equal at ``beta * (D - W) =
    added_seconds``: the closed form ``bw = 8 (D - W) / added_seconds``. Ignoring latency favours
    neither side much on the ring (a few message steps each) and keeps the answer one number.

    Args:
        parameters: gradient elements the dense all-reduce would move (>= 1).
        added_seconds: the compressed step's own cost beyond the dense step's compute, e.g. its
            measured step minus the dense step, floored at 0 (finite, >= 0).
        wire: seconds of the compressed exchange under a model; must be proportional to
            ``beta`` when ``alpha = 0`` (every collective of :class:`AlphaBeta` and every law of
            :data:`benchmarks.emulated.wire.WIRE` is) and not negative.
        workers: ranks ``n`` (>= 1), each with its own link.

    Returns:
        The bandwidth in bits/s: the compressed step is faster on every link strictly slower
        than it, the dense step on every faster one. ``math.inf`` when compression costs nothing
        (``added_seconds == 0``) and moves fewer bytes: it wins on every link. None when it never
        wins: its wire bytes are not fewer than the dense all-reduce's (``W >= D``; always so on
        one worker, where nothing moves).

    Raises:
        ValueError: a count below 1, a negative or non-finite ``added_seconds``, or a ``wire``
            that is negative or not proportional to ``beta``.
    """
    check_int("parameters", parameters, minimum=1)
    check_int("workers", workers, minimum=1)
    if not (math.isfinite(added_seconds) and added_seconds >= 0.0):
        raise ValueError(f"added_seconds must be a finite number >= 0 seconds, got {added_seconds}")
    per_byte = AlphaBeta(alpha=0.0, beta=1.0, workers=workers)  # seconds at 1 s/byte: byte counts
    dense = per_byte.dense_allreduce(parameters, BF16_BYTES)
    compressed = wire(per_byte)
    if not (math.isfinite(compressed) and compressed >= 0.0
            and math.isclose(wire(AlphaBeta(0.0, 2.0, workers)), 2.0 * compressed, rel_tol=1e-9, abs_tol=1e-12)):
        raise ValueError("wire must give finite seconds >= 0, proportional to beta when alpha = 0 (a law of "
                         f"AlphaBeta's collectives); got {compressed} at beta = 1 s/byte")
    if compressed >= dense:
        return None
    if added_seconds == 0.0:
        return math.inf
    return 8.0 * (dense - compressed) / added_seconds


def calibration_sizes(smallest: int = 1 << 10, largest: int = 1 << 20, count: int = 4) -> List[int]:
    """Payload sizes in bytes per rank to time for a fit: ``count`` sizes spread geometrically
    from ``smallest`` to ``largest``, each a multiple of 4 bytes (whole float32 elements)."""
    check_int("count", count, minimum=2)
    if not 4 <= smallest < largest:
        raise ValueError(f"calibration sizes need 4 <= smallest < largest, got {smallest} and {largest}")
    sizes = np.geomspace(smallest, largest, count)
    return sorted({int(round(s / 4)) * 4 for s in sizes})


def fit_allgather(samples: Sequence[Tuple[float, float]], workers: int) -> AlphaBeta:
    """Fit ``alpha`` and ``beta`` to timed allgathers.

    Args:
        samples: ``(bytes_per_rank, seconds)`` pairs, at least two distinct sizes. Pass the
            same (agreed) samples on every rank to get the same model everywhere.
        workers: the number of processes that took part.

    Returns:
        The model whose :meth:`AlphaBeta.allgather` best fits the samples in relative error
        (each sample weighted by ``1 / seconds``, so small payloads fix ``alpha`` and large ones
        ``beta``). Negative fitted terms (noise) are clamped to 0. With one worker nothing is
        communicated and the model is ``alpha = beta = 0``.
    """
    check_int("workers", workers, minimum=1)
    sizes = np.array([s for s, _ in samples], dtype=np.float64)
    seconds = np.array([t for _, t in samples], dtype=np.float64)
    if len(np.unique(sizes)) < 2:
        raise ValueError("fit_allgather needs samples of at least two different sizes")
    if not np.all(np.isfinite(seconds) & (seconds > 0)):
        raise ValueError(f"fit_allgather needs positive finite timings, got {seconds.tolist()}")
    if workers == 1:
        return AlphaBeta(0.0, 0.0, 1)
    weights = 1.0 / seconds
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (intercept, slope), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    if intercept < 0:
        # Pure bandwidth: refit the slope through the origin.
        intercept, slope = 0.0, float(np.sum(weights ** 2 * sizes * seconds) / np.sum((weights * sizes) ** 2))
    return AlphaBeta(alpha=float(intercept) / math.log2(workers), beta=max(0.0, float(slope)) / (workers - 1),
                     workers=workers)


def calibrate(time_allgather: Callable[[int], float], agree: Callable[[List[float]], List[float]],
              workers: int, sizes: Optional[Sequence[int]] = None,
              repeats: int = 5) -> Tuple[AlphaBeta, List[Tuple[int, float]]]:
    """Measure the model on the running cluster.

    Every rank must call this at the same point with the same arguments: the timed allgathers
    are collectives.

    Args:
        time_allgather: ``time_allgather(nbytes)`` runs one blocking allgather of ``nbytes``
            bytes per rank and returns its wall time in seconds.
        agree: turns this rank's list of timings into the list every rank uses (identical on
            every rank, e.g. the mean over ranks as broadcast by rank 0).
        workers: the number of processes taking part.
        sizes: payloads in bytes per rank (:func:`calibration_sizes` when None).
        repeats: timed allgathers per size, after one untimed warm-up; the median is kept.

    Returns:
        The fitted model and the agreed ``(bytes_per_rank, seconds)`` samples it was fitted to.
    """
    check_int("repeats", repeats, minimum=1)
    sizes = list(calibration_sizes() if sizes is None else sizes)
    medians = []
    for nbytes in sizes:
        time_allgather(nbytes)
        medians.append(float(np.median([time_allgather(nbytes) for _ in range(repeats)])))
    samples = list(zip(sizes, agree(medians)))
    return fit_allgather(samples, workers), samples


def exposed_time(exchanges: Sequence[Tuple[float, float, float]], backward_end: float,
                 fuse: bool = True) -> float:
    """Communication time left after backward when exchanges share one network link.

    Args:
        exchanges: ``(ready, latency, transfer)`` per group, in launch order: when the group was
            launched (same clock as ``backward_end``), and its exchange's latency and transfer
            seconds (e.g. ``model.allreduce(0)`` and ``model.allreduce(nbytes) -
            model.allreduce(0)``). Exchanges run one after another, each starting when it is
            launched and the link is free.
        backward_end: when the backward pass finished.
        fuse: exchanges launched while the link is busy go together as one collective when it
            frees (Horovod's tensor fusion): one latency, the transfers summed.

    Returns:
        ``max(0, last exchange's end - backward_end)``: the communication not hidden under the
        backward computation (0 when nothing is exchanged).
    """
    free = -math.inf
    i = 0
    while i < len(exchanges):
        start = max(free, exchanges[i][0])
        batch = [exchanges[i]]
        i += 1
        while fuse and i < len(exchanges) and exchanges[i][0] <= start:
            batch.append(exchanges[i])
            i += 1
        free = start + max(latency for _, latency, _ in batch) + sum(transfer for _, _, transfer in batch)
    return max(0.0, free - backward_end) if exchanges else 0.0


@dataclass(frozen=True)
class LocalCost:
    """Seconds of local work a LAGS group's exchange costs on the training thread.

    Attributes:
        select_element: selection time per element of the group's buffer (the scan).
        select_pair: selection time per selected coordinate, beyond the scan.
        apply_pair: time to add one received (value, index) pair into the update.
    """

    select_element: float
    select_pair: float
    apply_pair: float

    def __post_init__(self) -> None:
        for name in ("select_element", "select_pair", "apply_pair"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0 seconds, got {value}")

    def select(self, numel: int, count: int) -> float:
        """Seconds to select ``count`` of a group's ``numel`` elements."""
        return self.select_element * numel + self.select_pair * count

    @classmethod
    def fit(cls, numel: int, low: Tuple[int, float], high: Tuple[int, float],
            apply: Tuple[int, float]) -> "LocalCost":
        """The costs from a selection over ``numel`` elements timed at two counts, ``low`` and
        ``high`` = ``(count, seconds)`` with ``low[0] < high[0]``, and ``apply`` = ``(pairs,
        seconds)`` of one scatter-add. Negative fitted terms (noise) are clamped to 0."""
        (k_low, t_low), (k_high, t_high), (pairs, t_apply) = low, high, apply
        if not 0 <= k_low < k_high:
            raise ValueError(f"the selection must be timed at two counts low < high, got {k_low} and {k_high}")
        per_pair = max(0.0, (t_high - t_low) / (k_high - k_low))
        return cls(max(0.0, (t_low - per_pair * k_low) / numel), per_pair, max(0.0, t_apply) / max(1, pairs))
