"""Where a group's exchange runs: flat over the front end's process set, or in two tiers over this
rank's cross set with the node's reduce-scatter and allgather around it
(:mod:`horovod_sparse.engine.two_tier`), over the front end's :class:`Transport`."""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from horovod_sparse.common.stats import GroupStats, ReadScalars
from horovod_sparse.common.tiers import Tiers
from horovod_sparse.engine.two_tier import two_tier_exchange
from horovod_sparse.methods.base import Exchange, Sparsifier


class Transport:
    """The collectives a front end's groups travel over, held once instead of passed at every
    group: ``communicator``, the transport's communicator class (a ``TorchCommunicator``
    subclass, or any with its constructor ``(process_set, name, stats, scale, size, rank,
    device, step)``), over ``process_set``; a group's update averaged over the ranks
    (``average``: the method's scale ``1 / size``) or summed; ``read_scalars`` reads the figures
    a step left on a device, all at once (None: they are on the host).

    The size and rank are the process set's, asked at each group, unless :meth:`pin` fixed them
    (Horovod's elastic jobs read them once per agreement: the world changes only between steps).
    """

    def __init__(self, communicator: Callable[..., Any], process_set: Any, average: bool = True,
                 read_scalars: Optional[ReadScalars] = None) -> None:
        self.communicator = communicator
        self.process_set = process_set
        self.average = average
        self.read_scalars = read_scalars
        self._pinned: Optional[Tuple[int, int]] = None

    def pin(self, size: int, rank: int) -> None:
        """Use ``size`` ranks, this one ``rank``, until pinned again."""
        self._pinned = (size, rank)

    def place(self) -> Tuple[int, int]:
        """``(size, rank)``: the ranks of the process set and this one's."""
        return self._pinned if self._pinned is not None else (self.process_set.size(), self.process_set.rank())

    def communicator_of(self, group: Any, stats: GroupStats, step: Any) -> Any:
        """``group``'s communicator at ``step`` over the whole process set, accounting into ``stats``."""
        size, rank = self.place()
        return self.communicator(self.process_set, group.collective_name, stats, self._scale(size), size, rank,
                                 group.device, step)

    def communicators(self, group: Any, stats: GroupStats, tiers: Optional[Tiers], step: Any
                      ) -> Tuple[Any, Optional[Any]]:
        """A sparse group's communicators at ``step``: the one its method exchanges over (the
        process set, or in two ``tiers`` this rank's cross set) and, in two tiers, the node's
        (None when flat). Both account into ``stats``; the method's scale is ``1 / size`` of the
        whole job for an average, flat or not."""
        if tiers is None:
            return self.communicator_of(group, stats, step), None
        scale, name, device = self._scale(self.place()[0]), group.collective_name, group.device
        return (self.communicator(tiers.cross_set, name, stats, scale, tiers.cross_size, tiers.cross_rank, device,
                                  step),
                self.communicator(tiers.node_set, name, stats, 1.0, tiers.node_size, tiers.node_rank, device, step))

    def _scale(self, size: int) -> float:
        return 1.0 / size if self.average else 1.0


def start_exchange(method: Sparsifier, x: Any, comm: Any, node: Optional[Any],
                   tiers: Optional[Tiers], state: Any, step: int) -> Exchange:
    """The exchange of a group's ``x = g + e`` over the communicators of
    :meth:`Transport.communicators`: the method's own, or with ``node`` the two-tier exchange of
    this rank's slice (``comm.output_buffer``, the group's, narrowed to the slice)."""
    if node is None:
        return method.exchange(x, comm, state, step)
    assert tiers is not None
    lo, hi = tiers.bounds(method.B.numel(x))
    if comm.output_buffer is not None:
        comm.output_buffer = comm.output_buffer[lo:hi]
    return two_tier_exchange(method, x, node, comm, state, step, (lo, hi))
