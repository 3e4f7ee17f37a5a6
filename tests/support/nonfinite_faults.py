"""The NaN/Inf faults of ``tests/common/test_nonfinite.py``, shared by its workers and its assertions.

Three ranks train three parameters for :data:`STEPS` steps at the defaults users get: parameters
0 and 2 (1200 and 1440 elements) are sparse groups at the default ``min_numel`` (1024),
parameter 1 (30 elements) is a dense group inside every sparse step, and the first
:data:`WARMUP` steps are dense everywhere. :data:`FAULTS` poisons, step by step, single
elements with NaN, +Inf and -Inf: on rank 0 alone, on rank 1 alone, on several ranks at once,
in a sparse group, in the dense group of a sparse step and during warm-up, with healthy steps
before, between and after (three faults in a row among them).
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Set, Tuple

import numpy as np

from tests.support.streams import raw_gradient

NP = 3
SHAPES = [[40, 30], [30], [36, 40]]
MIN_NUMEL = 1024
WARMUP = 2
STEPS = 11
SEED = 7
NAN, INF = math.nan, math.inf
#: step -> the poisoned elements ``(rank, parameter, flat position, value)`` of that step.
FAULTS: Dict[int, List[Tuple[int, int, int, float]]] = {
    1: [(1, 0, 5, NAN)],                                     # warm-up (every group dense), rank 1
    3: [(0, 2, 17, INF)],                                    # sparse group, rank 0
    4: [(0, 0, 1199, NAN)],                                  # sparse group, rank 0
    5: [(0, 0, 0, -INF), (2, 2, 3, INF), (2, 2, 4, -INF)],   # sparse groups, ranks 0 and 2
    7: [(1, 1, 2, NAN), (2, 1, 29, -INF)],                   # the dense group of a sparse step, ranks 1 and 2
    8: [(1, 0, 600, INF)],                                   # sparse group, rank 1
    9: [(0, 1, 0, NAN)],                                     # the dense group of a sparse step, rank 0
}


def gradient(step: int, rank: int, index: int) -> np.ndarray:
    """Rank ``rank``'s float64 gradient of parameter ``index`` at ``step``, with this step's faults."""
    g = raw_gradient(SEED, step, rank, SHAPES[index], index)
    for bad_rank, parameter, position, value in FAULTS.get(step, ()):
        if (bad_rank, parameter) == (rank, index):
            g.reshape(-1)[position] = value
    return g


def bad_ranks(step: int) -> List[int]:
    """The ranks with a non-finite gradient at ``step`` (empty for a healthy step)."""
    return sorted({rank for rank, _, _, _ in FAULTS.get(step, ())})


def poisoned(step: int, rank: int) -> Set[int]:
    """The parameters whose gradient is non-finite on ``rank`` at ``step``."""
    return {parameter for bad_rank, parameter, _, _ in FAULTS.get(step, ()) if bad_rank == rank}


def dense(step: int, index: int, method: str) -> bool:
    """Whether parameter ``index``'s group is exchanged densely at ``step`` (Horovod's ``none``,
    warm-up, or below ``min_numel``)."""
    return method == "none" or step < WARMUP or int(np.prod(SHAPES[index])) < MIN_NUMEL


def kept(step: int, rank: int, index: int, method: str) -> bool:
    """The documented fate of rank ``rank``'s gradient of parameter ``index`` at ``step``: True
    when it is delivered (now, or later from the residual), False when it is dropped, which
    happens only on an abandoned step: to the non-finite gradient itself, and to every rank's
    gradient of a dense group (dense groups keep no residual)."""
    return step not in FAULTS or not (dense(step, index, method) or index in poisoned(step, rank))


def raw_stream(index: int, method: str, steps: Sequence[int] = range(STEPS)) -> np.ndarray:
    """``raw[t, r]``: every rank's flat gradient of parameter ``index`` that the run must
    deliver (zeros where :func:`kept` says it is dropped), for :func:`tests.support.checks.assert_conserved`."""
    size = int(np.prod(SHAPES[index]))
    return np.array([[gradient(t, r, index).reshape(-1) if kept(t, r, index, method) else np.zeros(size)
                      for r in range(NP)] for t in steps])
