"""A payload of a size known before the step: the most coordinates a rank sends per group and
step, for the methods whose selected count varies with the data (a threshold's: the hard
threshold, DGC, Gaussian-k, MiCRO and ExDyna).

On an accelerator the capacity is the payload's fixed size, so that no count is read on the host
and no length is exchanged. What a selection holds beyond it stays in the residual (error
feedback: nothing is lost) and is counted as the group's ``overflow``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from horovod_sparse.common.options import SparsifierOptions
from horovod_sparse.common.validation import check_int, check_positive_float

#: :attr:`CappedOptions.capacity` unless set: twice the target count.
DEFAULT_CAPACITY = 2.0
#: :attr:`CappedOptions.capacity_floor` unless set (coordinates).
DEFAULT_CAPACITY_FLOOR = 1024



@dataclass(frozen=True)
class CappedOptions(SparsifierOptions):
    """Options of a method whose selected count varies with the data (a threshold's).

    Attributes:
        capacity: the most coordinates a rank sends per group and step, as a multiple of the
            target count ``k`` (:func:`capacity_count`); None: the whole group (no cap). What
            the threshold selects beyond it (the selection's highest indices) is not sent: it
            stays in the residual, sent at a later step, and is counted as the group's
            ``overflow`` in the statistics. On an accelerator it is the payload's fixed size, so
            that no count is read on the host and no length is exchanged.
        capacity_floor: the capacity is at least this many coordinates (at most the group's
            size): in a small group, whose k is 1 or 2, a threshold's whole selection stays
            within reach (DGC's top-k cut is then the exact top-k), for a few kB of payload.
    """

    capacity: Optional[float] = DEFAULT_CAPACITY
    capacity_floor: int = DEFAULT_CAPACITY_FLOOR

    def _validate(self) -> None:
        if self.capacity is not None:
            object.__setattr__(self, "capacity", check_positive_float("capacity", self.capacity))
        object.__setattr__(self, "capacity_floor", check_int("capacity_floor", self.capacity_floor, minimum=1))


def capacity_count(options: CappedOptions, k: int, numel: int) -> int:
    """The payload's capacity in coordinates: ``ceil(capacity * k)``, at least ``capacity_floor``
    and at most the group's ``numel`` (all of it for a ``capacity`` of None)."""
    if options.capacity is None:
        return numel
    return min(numel, max(options.capacity_floor, math.ceil(options.capacity * k)))
