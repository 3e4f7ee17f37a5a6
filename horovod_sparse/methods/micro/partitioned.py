"""MiCRO and ExDyna, framework-free: options, per-group state and partition tables.

Both methods scan exclusive, rotating partitions of one flat buffer with one threshold
(:mod:`horovod_sparse.methods.micro.controllers`), exchange the selected indices by allgather and the
values at their union by one allreduce (sum), and zero every rank's residual at the union. So the
union holds exactly the sum of the per-rank counts: there is no gradient build-up. MiCRO's
partitions are equal and fixed; ExDyna's are runs of blocks whose boundaries move to balance the
per-rank counts (:mod:`horovod_sparse.methods.micro.partitions`).

The framework front ends run the exchange; everything decided from globally known numbers
(thresholds, partition tables) is decided here, so every rank and both frameworks decide the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

from horovod_sparse.methods.micro.controllers import CONTROLLERS, ThresholdState
from horovod_sparse.common.threshold_baselines import CappedOptions, capacity_count
from horovod_sparse.methods.micro.partitions import (BALANCERS, BlockLayout, counts_by_partition, equal_bounds,
                                              pairwise_rebalance, prefix_rebalance)
from horovod_sparse.common.validation import check_choice, check_int


@dataclass(frozen=True)
class MicroOptions(CappedOptions):
    """Options of MiCRO (and, with more fields, ExDyna).

    Attributes:
        capacity, capacity_floor: as :class:`~horovod_sparse.common.threshold_baselines.CappedOptions`,
            with a rank's share of the target, ``ceil(k / n)``, in place of ``k``
            (:func:`share_capacity`): by default a rank sends at most twice its share (at least
            1024 coordinates) per group and step; what its partition selects beyond that stays
            in its residual (``overflow``). On an accelerator every rank sends exactly that
            many indices, padded, and the values' allreduce runs over ``n`` times that.
        controller: how the threshold is chosen each step: ``"histogram"`` (default: follows
            the current step's gradient through one allreduce of about 1 KB), ``"paper"``
            (the published multiplicative rule) or ``"paper_intent"`` (the same with the
            presumed intent of its band rule). See :mod:`horovod_sparse.methods.micro.controllers`.
    """

    controller: str = "histogram"

    def _validate(self) -> None:
        super()._validate()
        check_choice("controller", self.controller, CONTROLLERS)


@dataclass(frozen=True)
class ExDynaOptions(MicroOptions):
    """Options of ExDyna: MiCRO's plus the block partitions.

    Attributes:
        balancer: how partition boundaries move: ``"prefix"`` (default: each boundary by the
            cumulative excess of the partitions left of it) or ``"paper"`` (the published
            pairwise rule). See :mod:`horovod_sparse.methods.micro.partitions`.
        num_blocks: blocks the buffer is cut into (the paper uses 1024).
    """

    balancer: str = "prefix"
    num_blocks: int = 1024

    def _validate(self) -> None:
        super()._validate()
        check_choice("balancer", self.balancer, BALANCERS)
        object.__setattr__(self, "num_blocks", check_int("num_blocks", self.num_blocks, minimum=1))


def share_capacity(options: MicroOptions, k: int, parts: int, numel: int) -> int:
    """The most coordinates a rank sends per group and step: :func:`capacity_count` of its share
    ``ceil(k / parts)`` of the target ``k`` (``numel``: the group's size)."""
    return capacity_count(options, -(-k // parts), numel)


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
