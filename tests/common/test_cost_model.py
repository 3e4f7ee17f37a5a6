"""The break-even link (:func:`horovod_sparse.common.cost_model.break_even_link`) against a slow
reference written here: the two ring-model steps as plain formulas, and the bandwidth where they
cross found by bisection over a log scale of bandwidths."""
from __future__ import annotations

import math
from typing import Callable, Optional

import pytest

from horovod_sparse.common.cost_model import AlphaBeta, break_even_link

COMPUTE = 0.030  # seconds; cancels out, but the reference keeps it to compare whole steps


def dense_step(parameters: int, workers: int, bits_per_second: float) -> float:
    """A dense bf16 ring all-reduce: 2 (n-1)/n of the 2-byte buffer through each link."""
    return COMPUTE + 2 * (workers - 1) / workers * 2 * parameters * 8 / bits_per_second


def reference(parameters: int, workers: int, added: float, wire_bytes: float) -> Optional[float]:
    """The bandwidth where ``compute + added + wire_bytes * 8 / bw`` meets the dense step, by
    bisection on ``log(bw)`` between 1 bit/s and 1e18 bit/s; None when the compressed step is
    slower at both ends (it never wins), inf when it is faster at both (it always does)."""
    def compressed_wins(bw: float) -> bool:
        return COMPUTE + added + wire_bytes * 8 / bw < dense_step(parameters, workers, bw)

    low, high = 0.0, 18 * math.log(10)
    if not compressed_wins(math.exp(low)):
        return None
    if compressed_wins(math.exp(high)):
        return math.inf
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if compressed_wins(math.exp(middle)) else (low, middle)
    return math.exp(low)


def allgather(bytes_per_rank: float) -> Callable[[AlphaBeta], float]:
    return lambda ab: ab.allgather(bytes_per_rank)


# (parameters, workers, added seconds, bytes per rank of an allgather)
ALLGATHER_CASES = [
    (25_600_000, 8, 5e-3, 8 * 25_600),      # Top-k of ResNet-50 at 0.001, 5 ms added
    (25_600_000, 64, 5e-3, 8 * 25_600),
    (25_600_000, 8, 15e-3, 8 * 256_000),    # density 0.01
    (1_000_000, 2, 1e-4, 1_000),
]


@pytest.mark.parametrize("parameters, workers, added, bytes_per_rank", ALLGATHER_CASES)
def test_allgather_break_even_matches_the_bisection(parameters, workers, added, bytes_per_rank):
    link = break_even_link(parameters, added, allgather(bytes_per_rank), workers)
    expected = reference(parameters, workers, added, (workers - 1) * bytes_per_rank)
    assert link is not None and expected is not None
    assert link == pytest.approx(expected, rel=1e-9)
    # Either side of it, the faster step is the one the contract names.
    slower, faster = 0.99 * link, 1.01 * link
    assert COMPUTE + added + (workers - 1) * bytes_per_rank * 8 / slower < dense_step(parameters, workers, slower)
    assert COMPUTE + added + (workers - 1) * bytes_per_rank * 8 / faster > dense_step(parameters, workers, faster)


def test_the_methods_own_collective_shape_is_used():
    """gTop-k's butterfly: log2 n rounds of k pairs, not an allgather of them."""
    parameters, workers, added, pairs = 25_600_000, 64, 8e-3, 8 * 25_600
    link = break_even_link(parameters, added, lambda ab: ab.log2n * ab.beta * pairs, workers)
    assert link == pytest.approx(reference(parameters, workers, added, 6 * pairs), rel=1e-9)
    assert link > break_even_link(parameters, added, allgather(pairs), workers)


def test_compression_that_sends_no_fewer_bytes_never_wins():
    # 64 ranks allgathering a sixteenth of the 4-byte-per-element buffer each: 63/16 * 4 P bytes
    # through each link against the dense ring's 2 * 63/64 * 2 P.
    parameters, workers = 1_000_000, 64
    wire = allgather(4 * parameters / 16)
    assert reference(parameters, workers, 1e-3, (workers - 1) * 4 * parameters / 16) is None
    assert break_even_link(parameters, 1e-3, wire, workers) is None
    # Top-k of ResNet-50 at density 0.01 on 64 ranks: 63 x 2 MB gathered, more than the dense ring's 101 MB.
    assert break_even_link(25_600_000, 1e-3, allgather(8 * 256_000), 64) is None
    assert reference(25_600_000, 64, 1e-3, 63 * 8 * 256_000) is None
    assert break_even_link(parameters, 0.0, wire, workers) is None  # free, but still more bytes
    # Exactly the dense bytes: never strictly faster either.
    assert break_even_link(parameters, 0.0, lambda ab: ab.dense_allreduce(parameters, 2), workers) is None
    assert break_even_link(parameters, 1e-3, allgather(8), 1) is None  # one worker: nothing moves


def test_free_compression_that_saves_bytes_wins_on_every_link():
    assert break_even_link(1_000_000, 0.0, allgather(8_000), 8) == math.inf
    assert reference(1_000_000, 8, 0.0, 7 * 8_000) == math.inf


@pytest.mark.parametrize("arguments, message", [
    ((0, 1e-3, allgather(8), 8), "parameters"),
    ((1000, -1e-3, allgather(8), 8), "added_seconds"),
    ((1000, math.nan, allgather(8), 8), "added_seconds"),
    ((1000, 1e-3, allgather(8), 0), "workers"),
    ((1000, 1e-3, lambda ab: ab.allgather(8) + 1e-3, 8), "proportional to beta"),
    ((1000, 1e-3, lambda ab: -ab.allgather(8), 8), "proportional to beta"),
])
def test_bad_input_is_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        break_even_link(*arguments)
