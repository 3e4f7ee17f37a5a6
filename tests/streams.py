"""Deterministic per-rank gradient streams, shared by the workers and the reference checks."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np


def raw_gradient(seed: int, step: int, rank: int, shape: Sequence[int], index: int) -> np.ndarray:
    """The gradient rank ``rank`` produces for parameter ``index`` at ``step`` (float64).

    Parameters get different scales (as layers do), and a per-step drift so the selection changes
    from step to step.
    """
    rng = np.random.default_rng([seed, step, rank, index])
    scale = 10.0 ** (index % 3 - 1)
    return scale * rng.standard_normal(tuple(shape))


def flat_gradients(seed: int, step: int, rank: int, shapes: Sequence[Sequence[int]],
                   members: Sequence[int]) -> np.ndarray:
    """The flat gradient of a group (the parameters ``members``, concatenated in order)."""
    parts: List[np.ndarray] = [raw_gradient(seed, step, rank, shapes[i], i).reshape(-1) for i in members]
    return np.concatenate(parts)
