"""What both frameworks' ``Communicator`` share: one group's identity in one step, and the
accounting of the collectives it launches."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

from horovod_sparse.common.stats import GroupStats
from horovod_sparse.common.tiers import slice_bounds

#: What an allgather's caller knows of every rank's row count (:class:`CommunicatorBase`).
Rows = Union[None, str, List[Any]]


class CommunicatorBase:
    """One group's collectives in one step (subclassed per framework, which launches them).

    Args:
        process_set: the Horovod process set the wrapper reduces over.
        name: the group's name; collective names are ``hs.<name>.<tag>``.
        stats: the group's statistics record for this step.
        scale: factor applied to the summed update (``1/size`` for Average, 1 for Sum).
        size, rank: the process set's size and this process's rank in it, when the caller
            already knows them (each is a call into Horovod otherwise).
    """

    def __init__(self, process_set: Any, name: str, stats: GroupStats, scale: float,
                 size: Optional[int] = None, rank: Optional[int] = None) -> None:
        self.process_set = process_set
        self.name = name
        self.stats = stats
        self.scale = scale
        self.size: int = process_set.size() if size is None else size
        self.rank: int = process_set.rank() if rank is None else rank
        #: The group's parameters' shapes where its buffer is those whole parameters (the engine's).
        self.shapes: Optional[Sequence[Tuple[int, ...]]] = None

    #: ``allgather(tensor, tag, kind, rows=...)``, in every framework: a variable-length
    #: allgather along dim 0, and what every rank knows of the per-rank row counts beforehand:
    #: None (nothing), a list (every rank's count, in rank order) or a key that an earlier
    #: allgather of this communicator was given, whose per-rank counts this one repeats. Horovod
    #: negotiates sizes itself and ignores ``rows``; ``torch.distributed``, which has no
    #: variable-length allgather, exchanges the counts (a host read) only when they are not known.

    def order_after(self, x: Any) -> None:
        """Order this group's collectives after ``x``, its loaded ``g + e``, where the transport
        needs that said (a traced TensorFlow step: its ``Communicator``); nothing here."""

    def _name(self, tag: str) -> str:
        """The Horovod name of this group's collective ``tag``."""
        return f"hs.{self.name}.{tag}"

    def _slice_bytes(self, numel: int, itemsize: int) -> Tuple[int, int, int]:
        """A reduce-scatter of ``numel`` elements of ``itemsize`` bytes, as this rank sees it:
        ``(sent, own, received)``: all but its slice (:func:`slice_bounds`) leaves it, its slice's
        bytes, and every other rank's contribution to that slice."""
        lo, hi = slice_bounds(numel, self.size, self.rank)
        own = (hi - lo) * itemsize
        return numel * itemsize - own, own, own * (self.size - 1)

    def _account(self, kind: str, sent: Any) -> None:
        """Count one launched collective and the bytes it sends, under ``kind``."""
        self.stats.collectives += 1
        self.stats.sent[kind] += sent
