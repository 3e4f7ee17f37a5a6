"""Deterministic per-rank gradient streams, shared by the workers and the reference checks."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np


def raw_gradient(seed: int, step: int, rank: int, shape: Sequence[int], index: int,
                 stream: str = "normal") -> np.ndarray:
    """The gradient rank ``rank`` produces for parameter ``index`` at ``step`` (float64).

    Parameters get different scales (as layers do), and a per-step drift so the selection changes
    from step to step. ``stream="ties"`` gives sparse gradients (about 3% non-zeros) of a few
    integer levels: many exact ties in magnitude, and fewer non-zeros than a typical ``k``.
    """
    rng = np.random.default_rng([seed, step, rank, index])
    scale = 10.0 ** (index % 3 - 1)
    if stream == "ties":
        return scale * rng.integers(-2, 3, tuple(shape)) * (rng.random(tuple(shape)) < 0.03)
    return scale * rng.standard_normal(tuple(shape))


def flat_gradients(seed: int, step: int, rank: int, shapes: Sequence[Sequence[int]],
                   members: Sequence[int], stream: str = "normal") -> np.ndarray:
    """The flat gradient of a group (the parameters ``members``, concatenated in order)."""
    parts: List[np.ndarray] = [raw_gradient(seed, step, rank, shapes[i], i, stream).reshape(-1) for i in members]
    return np.concatenate(parts)
