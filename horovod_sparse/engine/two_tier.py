"""The two-tier exchange of one group (:mod:`horovod_sparse.common.tiers` says what the tiers are):
the node's reduce-scatter, the method on this rank's slice across nodes, the node's allgather."""
from __future__ import annotations

from typing import Any, Tuple

from horovod_sparse.common.tiers import NODE_KIND, slice_bounds
from horovod_sparse.methods.base import Exchange, Sparsifier, Step


def two_tier_exchange(method: Sparsifier, x: Any, node: Any, cross: Any, state: Any, step: Step,
                      bounds: Tuple[int, int]) -> Exchange:
    """One group's two-tier exchange (the module docstring), as a generator with the contract of
    :meth:`Sparsifier.exchange` for the whole group.

    Args:
        method: the sparsifier; its exchange runs on this rank's slice of the node sum.
        x: the group's ``g + e`` on this rank, whole; it becomes the residual (the backend's
            ``embed``: zero outside the slice).
        node: the communicator of the node's process set (its collectives are accounted under
            :data:`NODE_KIND`).
        cross: the communicator of this rank's cross set, with the front end's scale
            (``1 / world_size`` for Average) and its ``output`` buffer the slice's.
        state: the method's state for the slice (built for ``cross_size`` ranks).
        step: the front end's step counter.
        bounds: the slice this rank owns (:meth:`Tiers.bounds`).
    """
    B = method.B
    lo, hi = bounds
    numel = B.numel(x)
    rows = [end - start for start, end in (slice_bounds(numel, node.size, r) for r in range(node.size))]
    (node_sum,) = yield [node.reducescatter(x, "node.sum", NODE_KIND)]
    x = B.embed(x, lo, node_sum)
    update, residual = yield from method.exchange(x[lo:hi], cross, state, step)
    (whole,) = yield [node.allgather(update, "node.update", NODE_KIND, rows=rows)]
    return whole, B.embed(x, lo, residual)
