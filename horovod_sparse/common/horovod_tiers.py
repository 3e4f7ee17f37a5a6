"""The two-tier exchange's process sets in a Horovod job (both Horovod front ends): the nodes
are Horovod's (``cross_rank``, ``local_rank``), the sets Horovod process sets, found among those
registered at ``hvd.init`` or added (dynamic process sets). See :mod:`horovod_sparse.common.tiers`.

**Every rank launches as many Horovod collectives per step** (:func:`level_collectives`). Horovod
names a collective launched without a name after its handle, a counter of every collective the
process launched (``allreduce.noname.<handle>`` in ``horovod/torch/mpi_ops_v2.cc``), and pairs
collectives across ranks by name. In two tiers each cross set takes its own data-dependent rounds
(MiCRO's and ExDyna's histogram rounds, an empty union's skipped allreduce), so without leveling
the ranks of one cross set launch more collectives in a step than those of another, and the
training loop's own unnamed collective after the step (``hvd.broadcast_(t, 0)``, an allreduce of a
metric) gets another name on each: Horovod waits for ever for a match that never comes, until
Gloo's timeout aborts every rank.
"""
from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

from horovod_sparse.common.tiers import NodeLayout, Tiers, make_tiers

#: Horovod's switch allowing process sets to be added after ``hvd.init()``.
DYNAMIC_ENV = "HOROVOD_DYNAMIC_PROCESS_SETS"


def horovod_tiers(hierarchical: Optional[bool], hvd: Any, process_set: Any,
                  gather_places: Callable[[Tuple[int, int]], List[Tuple[int, int]]]) -> Optional[Tiers]:
    """This rank's :class:`Tiers` in a Horovod job (:func:`make_tiers`): ``hvd`` is the front
    end's Horovod module, ``process_set`` the one it was given (only the global one can be split
    into nodes), ``gather_places(place)`` allgathers every rank's ``(cross_rank, local_rank)``."""

    def find_layout() -> NodeLayout:
        if process_set.process_set_id != 0:
            raise ValueError("hierarchical=True splits the job into its nodes, so it needs the global process "
                             "set; use hierarchical=False with another process_set")
        return node_layout(hvd, gather_places)

    return make_tiers(hierarchical, hvd.rank(), find_layout, lambda ranks: _process_set(hvd, ranks))


def node_process_set(hvd: Any, gather_places: Callable[[Tuple[int, int]], List[Tuple[int, int]]]) -> Any:
    """This rank's node's Horovod process set (the ranks of its host, Horovod's ``cross_rank``), the
    one :func:`horovod_tiers` takes for the node: found among those registered, else added
    (every node's, on every rank in the same order). Collective over the job."""
    layout = node_layout(hvd, gather_places)
    sets = [_process_set(hvd, list(node)) for node in layout.nodes]
    return next(found for found, node in zip(sets, layout.nodes) if hvd.rank() in node)


def node_layout(hvd: Any, gather_places: Callable[[Tuple[int, int]], List[Tuple[int, int]]]) -> NodeLayout:
    """The job's nodes, from every rank's Horovod ``(cross_rank, local_rank)`` (``gather_places``
    allgathers them). Collective over the job."""
    return NodeLayout.from_places(gather_places((hvd.cross_rank(), hvd.local_rank())))


def _process_set(hvd: Any, ranks: List[int]) -> Any:
    """The Horovod process set of exactly ``ranks``: the one registered already (at ``hvd.init``
    or by an earlier front end, read from the registry of the front end's Horovod library: Horovod
    has no public listing), else a new one (dynamic process sets). Collective."""
    for set_id, members in hvd.mpi_ops._basics._get_process_set_ids_and_ranks().items():
        if sorted(members) == sorted(ranks) and set_id != 0:
            found = hvd.ProcessSet(ranks)
            found.process_set_id = set_id
            return found
    if os.environ.get(DYNAMIC_ENV, "0") != "1":
        raise ValueError("hierarchical=True needs a Horovod process set per node and per slice: start Horovod "
                         "with hvd.init(process_sets=\"dynamic\") (or HOROVOD_DYNAMIC_PROCESS_SETS=1) so that "
                         f"they can be added, or register them at hvd.init (missing: ranks {ranks})")
    return hvd.add_process_set(ranks)


def level_collectives(launched: Sequence[int], rank: int, pad: Callable[[int], None]) -> int:
    """Bring this rank's count of the step's Horovod collectives up to the most any rank launched:
    ``launched`` holds every rank's count (in rank order, gathered at the step's end), ``pad(n)``
    launches ``n`` collectives on this rank's cross set and waits for them. The ranks of a cross
    set launched the same collectives, so they pad alike and their pads pair up. Returns ``n``
    (the module docstring says why)."""
    missing = max(launched) - launched[rank]
    if missing:
        pad(missing)
    return missing
