"""The configuration agreement of a front end on FSDP2's replica axis: over the whole job, not
only over a shard position's replicas, so that a rank that differs anywhere stops every rank
(a replicate group left out would go on alone and wait for the others at the step's end)."""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Sequence, Tuple

from horovod_sparse.distributed.process_group import ProcessGroup
from horovod_sparse.engine.model_state import ModelState

#: A group's key in a configuration's agreement: its name, size, dtype and member shapes.
Key = Tuple[str, int, str, List[List[int]]]


class ShardedModelState(ModelState):
    """The engine's model state on sharded replicas: a configuration is agreed over the whole job
    first, with ``whole`` (each parameter's key with its whole shape, the same on every rank) as
    the groups (every rank joins: a difference between any two ranks raises on every rank, none
    left waiting in a collective of its replicas), then over the replicas with the groups given
    (the local shards' shapes)."""

    def __init__(self, *args: Any, whole: Sequence[Key]) -> None:
        super().__init__(*args)
        self.whole = list(whole)
        self._over_the_job = False

    def require_same_configuration(self, settings: Dict[str, Any], groups: Sequence[Key]) -> None:
        self._over_the_job = True
        try:
            super().require_same_configuration(settings, self.whole)
        finally:
            self._over_the_job = False
        super().require_same_configuration(settings, groups)

    def _allgather_bytes(self) -> Callable[[bytes, str], List[bytes]]:
        return functools.partial(self.B.allgather_bytes,
                                 process_set=ProcessGroup(None) if self._over_the_job else self.process_set)
