"""The two-tier exchange's process groups over ``torch.distributed`` (see
:mod:`horovod_sparse.common.tiers`)."""
from __future__ import annotations

import os
from typing import List, Optional

import torch.distributed as dist

from horovod_sparse.common.tiers import NodeLayout, Tiers, make_tiers
from horovod_sparse.distributed.host_collectives import gather_ints
from horovod_sparse.distributed.process_group import ProcessGroup


def ddp_tiers(hierarchical: Optional[bool], node_size: Optional[int], process_group: ProcessGroup) -> Optional[Tiers]:
    """This rank's :class:`~horovod_sparse.common.tiers.Tiers` over ``torch.distributed``
    (:func:`~horovod_sparse.common.tiers.make_tiers`): nodes of ``node_size`` consecutive ranks
    (default ``LOCAL_WORLD_SIZE``, one node without it), one new group per node and per slice.
    Collective: every rank of the default group."""

    def find_layout() -> NodeLayout:
        if process_group.group is not None:
            raise ValueError("hierarchical=True splits the job into its nodes, so it needs the default process "
                             "group; use hierarchical=False with another process_group")
        size = node_size if node_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", process_group.size()))
        sizes = gather_ints(size, process_group)
        if len(set(sizes)) > 1 or size < 1:
            raise ValueError(f"hierarchical=True needs the same node_size >= 1 on every rank (LOCAL_WORLD_SIZE by "
                             f"default); the ranks have {sizes}")
        return NodeLayout.from_places([(rank // size, rank % size) for rank in range(process_group.size())])

    def new_group(ranks: List[int]) -> Optional[ProcessGroup]:
        group = dist.new_group(ranks)
        return ProcessGroup(group) if dist.get_rank() in ranks else None

    return make_tiers(hierarchical, dist.get_rank(), find_layout, new_group)
