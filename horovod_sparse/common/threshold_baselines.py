"""The threshold baselines, framework-free: hard threshold, DGC and Gaussian-k.

All three select ``|x| >= threshold`` from each group's own buffer and are exchanged like Top-k
(allgather of values, indices and counts; the union can reach ``n`` times the per-rank count).
They differ in how the threshold is found:

hard threshold
    ``1 / (2 sqrt(k))``, fixed (:func:`hard_threshold`). The selected count drifts with the
    gradient's scale: the failure that MiCRO's controller was designed to fix.
DGC (Lin et al. 2018)
    The top ``density`` fraction of a strided ~1% sample of ``|x|`` (:func:`dgc_sample`), then
    bounded refinement (:func:`dgc_adjustment`): more than ``1.3 k`` selected keeps the exact
    top-k of those; fewer than ``0.8 k`` lowers the threshold ×0.8 and selects again, at most
    ``max_adaptations`` times. Optional momentum correction (``momentum > 0``): velocity, not
    gradient, accumulates in the residual, and both are masked where sent.
Gaussian-k (Shi et al. 2019)
    ``mean(x) + |Phi^-1(density / 2)| std(x)`` (:func:`gaussian_threshold`), then up to three
    corrections (:func:`gaussiank_adjustment`): fewer than ``2k/3`` selected halves it, more than
    ``4k/3`` multiplies it by 1.5.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Optional, Tuple

from horovod_sparse.common.options import SparsifierOptions
from horovod_sparse.common.validation import check_fraction, check_int

#: DGC's refinement bounds and step (the reference's compress_upper/lower_bound).
DGC_UPPER, DGC_LOWER = 1.3, 0.8
#: Gaussian-k: at most this many corrections, the band and the factors.
GAUSSIANK_CORRECTIONS = 3
GAUSSIANK_LOW, GAUSSIANK_HIGH = 2.0 / 3.0, 4.0 / 3.0
GAUSSIANK_RAISE, GAUSSIANK_LOWER = 1.5, 0.5

#: What DGC's refinement says to do next.
ACCEPT, TOPK, LOWER = "accept", "topk", "lower"


def hard_threshold(k: int) -> float:
    """The hard-threshold baseline's fixed threshold ``1 / (2 sqrt(k))``."""
    return 1.0 / (2.0 * math.sqrt(k))


@dataclass(frozen=True)
class DGCOptions(SparsifierOptions):
    """Options of DGC.

    Attributes:
        sample_ratio: fraction of ``|x|`` sampled (strided) to estimate the threshold.
        max_adaptations: at most this many threshold refinements per step.
        momentum: 0 (default) turns momentum correction off; ``m > 0`` accumulates velocity
            ``u = m u + g`` into the residual and masks both where sent (use the wrapped
            optimizer without momentum then).
    """

    sample_ratio: float = 0.01
    max_adaptations: int = 10
    momentum: float = 0.0

    def _validate(self) -> None:
        object.__setattr__(self, "sample_ratio", check_fraction("sample_ratio", self.sample_ratio))
        object.__setattr__(self, "max_adaptations", check_int("max_adaptations", self.max_adaptations))
        momentum = check_fraction("momentum", self.momentum, allow_zero=True)
        if momentum >= 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}; for example momentum=0.9")
        object.__setattr__(self, "momentum", momentum)


def dgc_sample(numel: int, density: float, sample_ratio: float, step: int) -> Tuple[int, int, int]:
    """Where DGC samples: ``(offset, stride, count)``.

    The sample is ``|x|[offset::stride]`` with ``stride = max(1, round(1 / sample_ratio))`` and an
    offset that moves with the step (``step mod stride``, the same on every rank); the
    threshold is its ``count``-th largest value, ``count = ceil(density * sample size)`` (>= 1).
    """
    stride = max(1, round(1.0 / sample_ratio))
    offset = step % stride if numel > stride else 0
    size = len(range(offset, numel, stride))
    return offset, stride, max(1, math.ceil(density * size))


def dgc_adjustment(count: int, k: int) -> str:
    """DGC's refinement: :data:`TOPK` above ``1.3 k``, :data:`LOWER` (×0.8) below ``0.8 k``,
    else :data:`ACCEPT`."""
    if count > DGC_UPPER * k:
        return TOPK
    if count < DGC_LOWER * k:
        return LOWER
    return ACCEPT


def gaussian_threshold(mean: float, std: float, density: float) -> float:
    """Gaussian-k's estimate ``mean + |Phi^-1(density / 2)| std``."""
    return mean + abs(NormalDist().inv_cdf(density / 2.0)) * std


def gaussiank_adjustment(count: int, k: int) -> Optional[float]:
    """Gaussian-k's correction factor: 0.5 below ``2k/3``, 1.5 above ``4k/3``, else None."""
    if count < GAUSSIANK_LOW * k:
        return GAUSSIANK_LOWER
    if count > GAUSSIANK_HIGH * k:
        return GAUSSIANK_RAISE
    return None
