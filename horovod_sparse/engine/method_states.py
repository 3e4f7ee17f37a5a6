"""Each group's method state (partition tables, thresholds, DGC's velocity), built for the
world size and elements it serves, in every front end.

A group is either framework's ``FlatGroup`` (or FSDP2's ``ShardGroup``): its ``index`` keys its
state here, its ``numel`` is what the state is built for unless the exchange takes a slice (two
tiers). The method's *own* state, not per group (LAGS's measurements), is the method's
(:meth:`~horovod_sparse.methods.base.Sparsifier.method_state`).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Tuple

from horovod_sparse.common.plain import from_plain, to_plain
from horovod_sparse.methods.backend import Backend

#: A group's method state with what it was built for: ``((world size, elements), state)``.
Built = Tuple[Tuple[int, int], Any]


class IndexedGroup(Protocol):
    """What this module reads of a group."""

    index: int
    numel: int


class MethodStates(Dict[int, Built]):
    """Each group's method state by group index, with the world size and elements it was built
    for (:data:`Built`).

    Args:
        compression: the sparsifier building the states.
        backend: the framework's backend (states are built outside a traced step).
    """

    def __init__(self, compression: Any, backend: Backend) -> None:
        super().__init__()
        self.compression = compression
        self.B = backend

    def for_group(self, group: IndexedGroup, world_size: int, numel: Optional[int] = None) -> Any:
        """``group``'s method state for ``world_size`` ranks and ``numel`` elements (default: the
        group's): built on the group's first sparse step, rebuilt (``Sparsifier.resized_state``:
        partition tables, thresholds, schedules; DGC keeps its velocity) when it was built for
        another world size (an elastic change, or a checkpoint of another worker count), built
        anew when it was built for another number of elements (a checkpoint saved with another
        split into tiers). The residual is never touched."""
        numel = group.numel if numel is None else numel
        built_for, state = self.get(group.index, (None, None))
        if built_for != (world_size, numel):
            with self.B.outside_trace():
                state = (self.compression.new_state(numel, world_size) if built_for is None or built_for[1] != numel
                         else self.compression.resized_state(state, numel, world_size))
            self[group.index] = ((world_size, numel), state)
        return state

    def record(self, index: int) -> Optional[Dict[str, Any]]:
        """Group ``index``'s state as a checkpoint entry (plain containers), None before it was built."""
        built = self.get(index)
        return None if built is None else {"world_size": built[0][0], "numel": built[0][1],
                                           "state": to_plain(self.compression.export_state(built[1]))}

    def from_record(self, saved: Dict[str, Any], numel: int) -> Built:
        """A group's method state from a :meth:`record` entry, with the world size and elements
        it was built for (``numel``, the group's, where the entry does not say)."""
        size, numel = saved["world_size"], saved.get("numel", numel)
        template = self.compression.new_state(numel, size)
        return (size, numel), self.compression.import_state(from_plain(template, saved["state"]))
