"""Where a group's exchange runs: flat over the front end's process set, or in two tiers over this
rank's cross set with the node's reduce-scatter and allgather around it
(:mod:`horovod_sparse.engine.two_tier`). A front end's transport gives the communicator class
(a ``TorchCommunicator`` subclass, or any with its constructor)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from horovod_sparse.common.stats import GroupStats
from horovod_sparse.common.tiers import Tiers
from horovod_sparse.engine.two_tier import two_tier_exchange
from horovod_sparse.methods.base import Exchange, Sparsifier


def group_communicators(cls: Callable[..., Any], process_set: Any, size: int, rank: int, tiers: Optional[Tiers],
                        name: str, stats: GroupStats, scale: float, device: Any, step: int
                        ) -> Tuple[Any, Optional[Any]]:
    """A sparse group's communicators of class ``cls`` at ``step``: the one its method exchanges
    over (the front end's ``process_set`` of ``size`` ranks, or in two tiers this rank's cross
    set) and, in two tiers, the node's (None when flat). Both account into ``stats``; ``scale``
    is the method's (``1 / size`` of the whole job for Average, in either case)."""
    if tiers is None:
        return cls(process_set, name, stats, scale, size, rank, device, step), None
    return (cls(tiers.cross_set, name, stats, scale, tiers.cross_size, tiers.cross_rank, device, step),
            cls(tiers.node_set, name, stats, 1.0, tiers.node_size, tiers.node_rank, device, step))


def start_exchange(method: Sparsifier, x: Any, comm: Any, node: Optional[Any],
                   tiers: Optional[Tiers], state: Any, step: int) -> Exchange:
    """The exchange of a group's ``x = g + e`` over the communicators of
    :func:`group_communicators`: the method's own, or with ``node`` the two-tier exchange of
    this rank's slice (``comm.output_buffer``, the group's, narrowed to the slice)."""
    if node is None:
        return method.exchange(x, comm, state, step)
    assert tiers is not None
    lo, hi = tiers.bounds(method.B.numel(x))
    if comm.output_buffer is not None:
        comm.output_buffer = comm.output_buffer[lo:hi]
    return two_tier_exchange(method, x, node, comm, state, step, (lo, hi))
