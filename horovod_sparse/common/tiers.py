"""The two-tier exchange: dense inside a node, the method across nodes (``hierarchical=True``).

On a job of several nodes with several workers each, a sparse group's step runs in three parts
(Shi et al., MLSys 2021, for Top-k; here for every method):

1. **inside the node**, the ranks' error-fed buffers ``x = g + e`` are summed by a
   reduce-scatter, so the node's ``j``-th rank (by global rank) holds slice ``j`` of the node's
   sum (:func:`slice_bounds`: Horovod's split, the first ``numel % L`` slices one element longer);
2. **across nodes**, each slice is exchanged by the method among the ranks that own it, one per
   node (the *cross set* of slice ``j``), exactly as the flat method runs on ``cross_size``
   workers fed the node sums: same selection, collectives, update and error feedback, with the
   update scaled by ``1 / world_size`` for Average;
3. **inside the node** again, the slices' updates are allgathered, so every rank of every node
   holds the whole aggregated update.

Error feedback lives with the slice owner: after a step a rank's residual is zero outside its
slice (what it held there went into the node sum of the slice's owner) and holds the method's
residual inside it. So the residuals of all ranks still add up to everything not yet delivered,
whatever the layout they were saved under: a flat checkpoint loaded two-tier, or the converse,
loses nothing (its first step's reduce-scatter hands each rank's residual to the owners).

Selection work is split over the node's workers (each selects from its slice only) and every
rank's link carries a share of the node's cross-node traffic. Dense groups (warm-up, small
groups, a dense compression) stay on the front end's flat dense path: Horovod's own
``HOROVOD_HIERARCHICAL_ALLREDUCE`` governs those.

A job of one node, or of one worker per node, has nothing to split: it runs exactly as flat.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: Horovod's own switch for its two-level dense allreduce (``horovodrun --hierarchical-allreduce``
#: sets it); ``hierarchical=None`` follows it.
HIERARCHICAL_ENV = "HOROVOD_HIERARCHICAL_ALLREDUCE"
#: The byte kind of the collectives inside a node (``GroupStats.sent["node"]``).
NODE_KIND = "node"


def slice_bounds(numel: int, parts: int, index: int) -> Tuple[int, int]:
    """``[lo, hi)`` of slice ``index`` when ``numel`` elements are split into ``parts`` slices as
    Horovod's reduce-scatter splits them: ``numel // parts`` each, the first ``numel % parts``
    one element more."""
    base, extra = divmod(numel, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class NodeLayout:
    """Which global ranks share a node: ``nodes[c]`` lists node ``c``'s ranks in ascending order
    (the order of Horovod's process set of the node: position ``j`` there owns slice ``j``)."""

    nodes: Tuple[Tuple[int, ...], ...]

    @classmethod
    def from_places(cls, places: Sequence[Tuple[int, int]]) -> NodeLayout:
        """The layout from every rank's ``(cross_rank, local_rank)`` (Horovod's), in rank order.
        ``ValueError`` unless every node has the same number of workers, local ranks ``0..L-1``."""
        nodes: Dict[int, Dict[int, int]] = {}
        for rank, (node, local) in enumerate(places):
            nodes.setdefault(node, {})[local] = rank
        sizes = {node: len(members) for node, members in sorted(nodes.items())}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"hierarchical=True needs the same number of workers on every node; this job has "
                             f"{sizes} (node: workers). Start as many workers per host (horovodrun -H "
                             f"host1:L,host2:L), or use hierarchical=False")
        for node, members in sorted(nodes.items()):
            if sorted(members) != list(range(len(members))):
                raise ValueError(f"node {node} reports local ranks {sorted(members)}, expected 0..{len(members) - 1}")
        return cls(tuple(tuple(sorted(members.values())) for _, members in sorted(nodes.items())))

    @property
    def local_size(self) -> int:
        return len(self.nodes[0])

    @property
    def cross_size(self) -> int:
        return len(self.nodes)

    @property
    def flat(self) -> bool:
        """One node, or one worker per node: nothing to split, the job runs flat."""
        return self.local_size == 1 or self.cross_size == 1

    def cross_sets(self) -> List[List[int]]:
        """Per slice ``j``, the ranks owning it on every node, ascending (the sets the method
        runs over, their ranks numbered in this order)."""
        return [sorted(node[j] for node in self.nodes) for j in range(self.local_size)]

    def cross_root(self, root: int, slice_index: int) -> int:
        """The rank, within the cross set of slice ``slice_index``, of the member on ``root``'s
        node (the one that stands for ``root`` when the method's state is agreed)."""
        node = next(node for node in self.nodes if root in node)
        return self.cross_sets()[slice_index].index(node[slice_index])


@dataclass(frozen=True)
class Tiers:
    """This rank's two process sets: its node (``node_set``) and its cross set, with its rank in
    each and their sizes (``node_rank`` is the index of the slice it owns), and the job's layout."""

    layout: NodeLayout
    node_set: Any
    cross_set: Any
    node_rank: int
    node_size: int
    cross_rank: int
    cross_size: int

    @property
    def world_size(self) -> int:
        return self.node_size * self.cross_size

    def bounds(self, numel: int) -> Tuple[int, int]:
        """The slice of a ``numel``-element group this rank owns."""
        return slice_bounds(numel, self.node_size, self.node_rank)

    def slice_numel(self, numel: int) -> int:
        lo, hi = self.bounds(numel)
        return hi - lo

    def splits(self, numel: int) -> bool:
        """Whether a group of ``numel`` elements gives every rank of the node a slice (smaller
        groups take the front end's dense path)."""
        return numel >= self.node_size

    def cross_root(self, root: int) -> int:
        """This rank's cross-set rank standing for global rank ``root``."""
        return self.layout.cross_root(root, self.node_rank)


def exchanged_numel(tiers: Optional[Tiers], numel: int) -> int:
    """The elements of a ``numel``-element group that this rank's method exchanges: its slice
    in two tiers, else all (a group's statistics count these)."""
    return numel if tiers is None else tiers.slice_numel(numel)


def wants_hierarchical(hierarchical: Optional[bool]) -> bool:
    """``hierarchical`` as given, or with None Horovod's own switch (:data:`HIERARCHICAL_ENV`)."""
    if hierarchical is None:
        return os.environ.get(HIERARCHICAL_ENV, "0").strip().lower() in ("1", "true")
    if not isinstance(hierarchical, bool):
        raise TypeError(f"hierarchical must be True, False or None (follow {HIERARCHICAL_ENV}), got {hierarchical!r}")
    return hierarchical


def make_tiers(hierarchical: Optional[bool], rank: int, find_layout: Callable[[], NodeLayout],
               new_set: Callable[[List[int]], Any]) -> Optional[Tiers]:
    """Rank ``rank``'s :class:`Tiers` for a front end built with ``hierarchical``, or None to run
    flat (not wanted, or a flat layout). Collective over the job: ``find_layout()`` finds the
    nodes (every rank the same), and every node's and every cross set's process set is made by
    ``new_set(ranks)``, on every rank in the same order (a Horovod process set, a
    ``torch.distributed`` group: its ranks are numbered in ascending order of the global ranks).

    The front end's ``find_layout`` and ``new_set`` raise ``ValueError`` with the fix when the
    tiers cannot be had (another process group than the global one, nodes of different sizes,
    process sets that cannot be added): when they were asked for explicitly that error goes on;
    when they follow :data:`HIERARCHICAL_ENV` only, it becomes a warning and the job runs flat."""
    if not wants_hierarchical(hierarchical):
        return None
    try:
        layout = find_layout()
        if layout.flat:
            return None
        node_sets = [new_set(list(node)) for node in layout.nodes]
        cross_sets = [new_set(ranks) for ranks in layout.cross_sets()]
    except ValueError as problem:
        if hierarchical is not None:
            raise
        warnings.warn(f"{HIERARCHICAL_ENV}=1 asks for the two-tier sparse exchange, which runs flat: {problem}",
                      RuntimeWarning, stacklevel=3)
        return None
    node = next(c for c, members in enumerate(layout.nodes) if rank in members)
    slice_index = layout.nodes[node].index(rank)
    cross = layout.cross_sets()[slice_index]
    return Tiers(layout, node_sets[node], cross_sets[slice_index], slice_index, layout.local_size,
                 cross.index(rank), layout.cross_size)
