"""The threshold baselines, framework-free: hard threshold, DGC and Gaussian-k.

All three select ``|x| >= threshold`` from each group's own buffer and are exchanged like Top-k
(allgather of values, indices and counts; the union can reach ``n`` times the per-rank count).
They differ in how the threshold is found:

hard threshold
    ``1 / (2 sqrt(k))``, fixed (:func:`hard_threshold`). The selected count drifts with the
    gradient's scale: the failure that MiCRO's controller was designed to fix.
DGC (Lin et al. 2018)
    The top ``density`` fraction of a strided ~1% sample of ``|x|`` (:func:`dgc_sample`), then
    bounded refinement (:data:`DGC_UPPER`, :data:`DGC_LOWER`): more than ``1.3 k`` selected keeps the exact
    top-k of those; fewer than ``0.8 k`` lowers the threshold ×0.8 and selects again, at most
    ``max_adaptations`` times. Optional momentum correction (``momentum > 0``): velocity, not
    gradient, accumulates in the residual, and both are masked where sent.
Gaussian-k (Shi et al. 2019)
    ``mean(x) + |Phi^-1(density / 2)| std(x)`` (:func:`gaussian_threshold`), then up to three
    corrections (:func:`band_factor`): fewer than ``2k/3`` selected halves it, more than ``4k/3``
    multiplies it by 1.5.

All three send at most ``capacity`` times ``k`` coordinates per step
(:class:`~horovod_sparse.common.capacity.CappedOptions`: 2 for DGC and Gaussian-k, none for the
hard threshold unless set): a payload whose size is known before the step, so that an accelerator
moves it without reading the selected count on the host. What a threshold selects beyond it stays
in the residual (error feedback: nothing is lost) and is counted as ``overflow``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import List, Optional, Sequence, Tuple

from horovod_sparse.common.capacity import CappedOptions
from horovod_sparse.common.thresholds import as_float32
from horovod_sparse.common.validation import check_fraction, check_int

#: DGC's refinement bounds and step (the reference's compress_upper/lower_bound).
DGC_UPPER, DGC_LOWER = 1.3, 0.8
#: Gaussian-k: at most this many corrections, the band and the factors.
GAUSSIANK_CORRECTIONS = 3
GAUSSIANK_LOW, GAUSSIANK_HIGH = 2.0 / 3.0, 4.0 / 3.0
GAUSSIANK_RAISE, GAUSSIANK_LOWER = 1.5, 0.5

def hard_threshold(k: int) -> float:
    """The hard-threshold baseline's fixed threshold ``1 / (2 sqrt(k))``."""
    return 1.0 / (2.0 * math.sqrt(k))


@dataclass(frozen=True)
class HardThresholdOptions(CappedOptions):
    """Options of the hard threshold: no cap unless ``capacity`` is set (its selected count
    drifts with the gradient's scale, the flaw it stands for as a baseline; on an accelerator its
    payload then has the group's size)."""

    capacity: Optional[float] = None


@dataclass(frozen=True)
class DGCOptions(CappedOptions):
    """Options of DGC (``capacity`` as :class:`CappedOptions`).

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
        super()._validate()
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


def gaussian_threshold(mean: float, std: float, density: float) -> float:
    """Gaussian-k's estimate ``mean + |Phi^-1(density / 2)| std``."""
    return mean + abs(NormalDist().inv_cdf(density / 2.0)) * std


def band_factor(count: int, low: float, high: float, below: float, above: float) -> float:
    """The factor a threshold is multiplied by when it selected ``count`` coordinates: ``below``
    when ``count < low``, ``above`` when ``count > high``, else 1 (the count is in the band)."""
    if count < low:
        return below
    if count > high:
        return above
    return 1.0


def lowered_thresholds(threshold: float, factor: float, times: int) -> List[float]:
    """DGC's thresholds to try in turn: ``threshold`` lowered ``i`` times by ``factor`` for ``i``
    in ``0..times``, each the product ``threshold * factor ** i`` in double precision rounded to
    float32 once (:func:`~horovod_sparse.common.thresholds.as_float32`), so that an accelerator
    forms them all in one operation with the same bits (the powers are these floats)."""
    return [as_float32(threshold * power) for power in powers(factor, times)]


def powers(factor: float, times: int) -> Tuple[float, ...]:
    """``factor ** i`` for ``i`` in ``0..times`` (Python floats, as every backend takes them)."""
    return tuple(factor ** i for i in range(times + 1))


def first_settled(thresholds: Sequence[float], counts: Sequence[int], low: float, high: float,
                  checks: int) -> Tuple[float, bool]:
    """DGC's refinement, read off the thresholds tried in turn and their counts: the first among
    the first ``checks`` whose count is at least ``low`` (else the last, unchecked), and whether
    its count exceeds ``high`` (the top-k of its selection is then kept)."""
    settled = next((j for j in range(min(checks, len(counts))) if counts[j] >= low), len(counts) - 1)
    return thresholds[settled], settled < checks and counts[settled] > high
