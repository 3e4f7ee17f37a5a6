"""The wire laws of the benchmarks' alpha-beta model: how many seconds each method's collectives
take on ``n`` workers for a payload measured on some other count (:class:`Payload`).

Kept apart from :mod:`benchmarks.emulated.scaling` (which projects whole steps with them) so that a check
that needs only the laws (:mod:`benchmarks.gpu_check`: PyTorch alone on a GPU machine) does not
import the plotting and cluster machinery.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict

from horovod_sparse.common.cost_model import AlphaBeta


@dataclass(frozen=True)
class Payload:
    """Bytes per rank of one step, by kind (``values``, ``indices``, ``meta``), as measured on
    ``workers`` workers, and the number of collectives issued."""

    values: float
    indices: float
    meta: float
    collectives: float
    workers: int


# The laws below give the seconds of a method's collectives on ``n = ab.workers`` ranks placed
# ``per_node`` to a node whose one link (alpha, beta) they share; the links inside a node are
# taken as free (their traffic runs beside the node link's). With ``per_node = 1`` every rank
# has a link of its own.
def _dense(ab: AlphaBeta, p: Payload, per_node: int = 1) -> float:
    # One allreduce per collective (latency each), the bytes of all of them through the ring once;
    # a ring that visits a node's ranks in a row crosses each node link once, whatever per_node.
    n = ab.workers
    return p.collectives * 2 * ab.alpha * ab.log2n + 2 * (n - 1) / n * ab.beta * (p.values + p.indices + p.meta)


def _allgather(ab: AlphaBeta, p: Payload, per_node: int = 1) -> float:
    # Every collective pays one latency term; each of a node's ranks receives every remote rank's
    # bytes through the node link: per_node (n - per_node) of them.
    return (p.collectives * ab.alpha * ab.log2n
            + per_node * (ab.workers - per_node) * ab.beta * (p.values + p.indices + p.meta))


def _partitioned(ab: AlphaBeta, p: Payload, per_node: int = 1) -> float:
    # Indices: each rank's share of the union (k/n) shrinks as 1/n, allgathered as above;
    # values: an allreduce of the whole union (k), whatever n.
    indices = p.indices * p.workers / ab.workers
    return (p.collectives * ab.alpha * ab.log2n + per_node * (ab.workers - per_node) * ab.beta * (indices + p.meta)
            + 2 * (ab.workers - 1) / ab.workers * ab.beta * p.values)


def _butterfly(ab: AlphaBeta, p: Payload, per_node: int = 1) -> float:
    # ceil(log2 n) rounds of k pairs; the first log2(per_node) pair ranks of one node (latency
    # only), each later one sends all the node's ranks' pairs through its link at once.
    rounds_measured = max(1.0, math.log2(p.workers))
    per_round = (p.values + p.indices + p.meta) / rounds_measured
    rounds = math.ceil(ab.log2n)
    inside = min(rounds, int(math.log2(per_node)))
    return inside * ab.alpha + (rounds - inside) * (ab.alpha + per_node * ab.beta * per_round)


#: How each method's collectives cost on ``n`` workers (``per_node`` to a node link), given the
#: payload measured on ``p.workers``.
WIRE: Dict[str, Callable[..., float]] = {
    "none": _dense, "fp16": _dense,
    "topk": _allgather, "threshold": _allgather, "dgc": _allgather, "gaussiank": _allgather, "lags": _allgather,
    "sparseloco": _allgather,
    "micro": _partitioned, "exdyna": _partitioned,
    "gtopk": _butterfly,
}


def wire_law(compressor: str) -> Callable[..., float]:
    """``WIRE[compressor]``: ``law(ab, payload, per_node=1)`` -> seconds; a ValueError naming
    the fix for a method without one."""
    try:
        return WIRE[compressor]
    except KeyError:
        raise ValueError(f"no wire model for method {compressor!r}; add it to benchmarks.emulated.wire.WIRE") from None
