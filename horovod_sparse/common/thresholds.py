"""The numbers every threshold selection shares, framework-free: thresholds as float32 (so every
framework and the NumPy references compare against the same number, never below the smallest
positive float32: zeros are never selected), the block and chunk sizes of the selection scans and
of the exact top-k's candidate level, and the moments the Gaussian-k threshold is read from."""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np

#: The smallest positive float32: thresholds never go below it, so zeros are never selected.
SMALLEST_THRESHOLD = float(np.nextafter(np.float32(0), np.float32(1)))


def as_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (returned as a Python float), at least
    :data:`SMALLEST_THRESHOLD`."""
    return max(float(np.float32(value)), SMALLEST_THRESHOLD)


def float32_bits(value: float) -> int:
    """The bit pattern of ``value`` rounded to float32 (monotone in ``value`` for ``value >= 0``)."""
    return int(np.array([value], dtype=np.float32).view(np.int32)[0])


#: Elements per chunk of the CPU scan in both frameworks: the chunk's ``|x|`` stays in cache,
#: and the per-chunk calls are few (1 MiB of float32: 10% faster over 25.6M elements than 512 KiB).
SCAN_CHUNK = 1 << 18
#: The exact top-k's candidate level samples about this many of the block maxima it looks for...
LEVEL_SAMPLE = 2048
#: ... and aims this much above ``k`` of them, so that at least ``k`` usually reach the level.
LEVEL_MARGIN = 1.125


def scan_block_size(density: float) -> int:
    """Block length of the selection scan: a power of two near ``1 / (16 density)`` in [32, 512].

    The scan reads each block's largest ``|x|`` (one fast reduction) and only re-reads the blocks
    whose maximum passes the threshold; at about one selected coordinate per 16 blocks few
    blocks are re-read.
    """
    return int(min(512, max(32, 2 ** round(math.log2(1.0 / (16.0 * density))))))


def mean_std(total: float, squares: float, numel: int) -> Tuple[float, float]:
    """Mean and unbiased standard deviation (0 for one element) of ``numel`` values from their
    sum and sum of squares: ``sqrt((sum x^2 - n mean^2) / (n - 1))``. With single-precision
    partial sums that is within about 1e-5 of the exact deviation while ``|mean|`` is at most a
    few deviations (so for gradients), and worse as ``|mean|`` grows beyond."""
    mean = total / numel
    return mean, math.sqrt(max(0.0, squares - total * mean) / (numel - 1)) if numel > 1 else 0.0
