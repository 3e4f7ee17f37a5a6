"""What a MiCRO or ExDyna group carries from one step to the next, and its partition table.

Both methods scan exclusive, rotating partitions of one flat buffer with one threshold
(:mod:`horovod_sparse.methods.micro.controllers`), exchange the selected indices by allgather and the
values at their union by one allreduce (sum), and zero every rank's residual at the union. So the
union holds exactly the sum of the per-rank counts: there is no gradient build-up. MiCRO's
partitions are equal and fixed; ExDyna's are runs of blocks whose boundaries move to balance the
per-rank counts (:mod:`horovod_sparse.methods.micro.partitions`).

Everything decided from globally known numbers (thresholds, partition tables) is decided here and
in the controllers, framework-free, so every rank and both frameworks decide the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

from horovod_sparse.common.validation import check_choice
from horovod_sparse.methods.micro.controllers import ThresholdState
from horovod_sparse.methods.micro.options import ExDynaOptions, MicroOptions
from horovod_sparse.methods.micro.partitions import (BALANCERS, BlockLayout, counts_by_partition, equal_bounds,
                                                     pairwise_rebalance, prefix_rebalance)


@dataclass
class PartitionedState:
    """Everything a MiCRO/ExDyna group carries from one step to the next. Plain numbers and lists
    (a checkpoint saves and restores it as is); identical on every rank.

    Attributes:
        numel: elements in the group's buffer.
        parts: number of partitions (the world size it was built for).
        threshold: the threshold controller's state.
        blocks: ExDyna: blocks per partition for the next step (empty for MiCRO).
    """

    numel: int
    parts: int
    threshold: ThresholdState = field(default_factory=ThresholdState)
    blocks: List[int] = field(default_factory=list)


class EqualPartitions:
    """MiCRO's table: ``n`` equal partitions, fixed."""

    def new_state(self, numel: int, parts: int) -> PartitionedState:
        return PartitionedState(numel, parts)

    def bounds(self, state: PartitionedState) -> List[int]:
        """Element boundaries of the partitions for the coming step."""
        return equal_bounds(state.numel, state.parts)

    def observe(self, state: PartitionedState, step: int, counts: Sequence[int]) -> None:
        """After ``step``, in which rank ``r`` selected ``counts[r]``: nothing changes for MiCRO."""


class BlockPartitions(EqualPartitions):
    """ExDyna's table: runs of blocks, re-balanced after every step by ``balancer``."""

    def __init__(self, num_blocks: int, balancer: str) -> None:
        self.num_blocks = num_blocks
        self.balancer = check_choice("balancer", balancer, BALANCERS)

    def layout(self, state: PartitionedState) -> BlockLayout:
        return BlockLayout.for_buffer(state.numel, self.num_blocks)

    def new_state(self, numel: int, parts: int) -> PartitionedState:
        state = PartitionedState(numel, parts)
        state.blocks = self.layout(state).initial_blocks(parts)
        return state

    def bounds(self, state: PartitionedState) -> List[int]:
        return self.layout(state).bounds(state.blocks)

    def observe(self, state: PartitionedState, step: int, counts: Sequence[int]) -> None:
        layout = self.layout(state)
        by_partition = counts_by_partition(counts, step)
        least = layout.min_blocks(state.parts)
        if self.balancer == "paper":
            state.blocks = pairwise_rebalance(state.blocks, by_partition, sum(counts), layout, least)
        else:
            state.blocks = prefix_rebalance(state.blocks, by_partition, least)


def make_partitions(options: MicroOptions) -> EqualPartitions:
    """The partition table of a method: equal for MiCRO, blocks for ExDyna."""
    if isinstance(options, ExDynaOptions):
        return BlockPartitions(options.num_blocks, options.balancer)
    return EqualPartitions()
