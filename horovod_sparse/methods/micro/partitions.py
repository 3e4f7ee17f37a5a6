"""Exclusive partitions of a flat buffer (MiCRO, ExDyna) and ExDyna's re-balancing.

Partition tables are lists of ``parts + 1`` element boundaries: partition ``p`` is
``[bounds[p], bounds[p + 1])``; together they are disjoint and cover ``[0, numel)``. At step
``t`` rank ``r`` owns partition ``(t + r) mod n`` (:func:`owned_partition`), so every coordinate
is scanned by every rank in turn and no two ranks select the same coordinate.

MiCRO uses :func:`equal_bounds`. ExDyna cuts the buffer into blocks (:class:`BlockLayout`: 1024
blocks whose size is a multiple of 32, the remainder going to the last partition), gives each
partition a run of blocks, and moves the boundaries between steps so that each partition holds
about the same number of selected coordinates. Both balancers (``balancer=`` option) move a
boundary by at most one block per step, keep at least ``min_blk = num_blocks / (4 n)`` blocks
per partition, and are computed identically on every rank from the gathered per-rank counts:

``"prefix"`` (default)
    Boundary ``j`` (between partitions ``j - 1`` and ``j``) moves one block to the left when
    partitions ``0 .. j - 1`` together selected more than ``j`` shares (``j * total / n``) by over
    5% of a share, and one block to the right when they selected that much less
    (:func:`prefix_rebalance`). An excess is thereby passed along a chain of partitions, so a
    partition within the band between a heavy and a light one does not stop it.
``"paper"``
    The published pairwise rule (:func:`pairwise_rebalance`): adjacent partitions exchange one
    block when one is above ``1.05 k_acc`` and the other below ``k_acc / 1.05``. A partition
    within that band between a heavy and a light neighbour blocks every move.

Small steps matter on real gradients: a block's count depends on the rank that scans it (error
feedback empties what a rank just harvested, so consecutive counts of a block are
anti-correlated), and re-splitting the buffer at once from per-block counts of the gathered
union raised ``load_inc`` above that of static partitions in our runs.

The imbalance is reported as ``load_inc = max(counts) n / sum(counts) - 1`` (:func:`load_inc`),
the padding and straggler overhead of a fixed-size allgather.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from horovod_sparse.common.validation import check_int

#: Names accepted by the ``balancer=`` option, default first.
BALANCERS = ("prefix", "paper")
#: The default balancer moves a boundary when the excess left of it exceeds this fraction of a share.
BAND = 0.05
#: ExDyna's block sizes are multiples of this (when the buffer has at least that many per block).
BLOCK_ALIGN = 32


def equal_bounds(numel: int, parts: int) -> List[int]:
    """``parts`` contiguous partitions of ``[0, numel)``, the first ``numel mod parts`` one longer."""
    size, extra = divmod(numel, parts)
    return [p * size + min(p, extra) for p in range(parts + 1)]


def owned_partition(step: int, rank: int, parts: int) -> int:
    """The partition rank ``rank`` scans at ``step``: ``(step + rank) mod parts``."""
    return (step + rank) % parts


def counts_by_partition(counts_by_rank: Sequence[int], step: int) -> List[int]:
    """Reorder per-rank counts of ``step`` by the partition each rank scanned."""
    parts = len(counts_by_rank)
    by_partition = [0] * parts
    for rank, count in enumerate(counts_by_rank):
        by_partition[owned_partition(step, rank, parts)] = count
    return by_partition


def load_inc(counts: Sequence[int]) -> float:
    """``max(counts) * n / sum(counts) - 1``: 0 when balanced (0 as well when nothing was selected)."""
    total = sum(counts)
    return max(counts) * len(counts) / total - 1.0 if total else 0.0


def allgather_padding(counts: Sequence[int]) -> int:
    """Elements a fixed-size allgather would pad: every rank sending ``max(counts)``."""
    return max(counts) * len(counts) - sum(counts)


@dataclass(frozen=True)
class BlockLayout:
    """ExDyna's blocks: ``num_blocks`` blocks of ``block_size`` elements, then a remainder of
    ``numel - num_blocks * block_size`` elements that always belongs to the last partition."""

    numel: int
    num_blocks: int
    block_size: int

    @classmethod
    def for_buffer(cls, numel: int, num_blocks: int = 1024) -> "BlockLayout":
        """The paper's layout: ``block_size = numel // num_blocks`` rounded down to a multiple of
        32. Buffers with fewer than 32 elements per block keep ``numel // num_blocks`` (at least
        1), and buffers with fewer than ``num_blocks`` elements get one block per element."""
        numel = check_int("numel", numel, minimum=1)
        size = numel // check_int("num_blocks", num_blocks, minimum=1)
        if size >= BLOCK_ALIGN:
            size -= size % BLOCK_ALIGN
        size = max(1, size)
        return cls(numel, min(num_blocks, numel // size), size)

    @property
    def remainder(self) -> int:
        return self.numel - self.num_blocks * self.block_size

    def initial_blocks(self, parts: int) -> List[int]:
        """Blocks per partition at the first step: ``num_blocks // parts``, one more for the first
        ``num_blocks mod parts``."""
        size, extra = divmod(self.num_blocks, parts)
        return [size + (p < extra) for p in range(parts)]

    def min_blocks(self, parts: int) -> float:
        """The paper's minimum partition size in blocks, ``num_blocks / (4 parts)``."""
        return self.num_blocks / (4 * parts)

    def bounds(self, blocks: Sequence[int]) -> List[int]:
        """Element boundaries of partitions holding ``blocks[p]`` blocks each (the remainder
        goes to the last one)."""
        starts = np.concatenate([[0], np.cumsum(blocks)]) * self.block_size
        bounds = [int(b) for b in starts]
        bounds[-1] = self.numel
        return bounds


def pairwise_rebalance(blocks: Sequence[int], counts: Sequence[int], k_prev: int, layout: BlockLayout,
                       min_blocks: float) -> List[int]:
    """The paper's rule, as the authors' code runs it.

    Args:
        blocks: blocks per partition used at the previous step.
        counts: coordinates selected in each partition at the previous step.
        k_prev: their sum (the global count).
        layout: the block layout (for the estimated load of one block).
        min_blocks: no partition shrinks below this many blocks.

    With ``k_acc = int(k_prev / n)``, pairs ``(i, i + 1)`` are swept left to right: if ``i`` is
    above ``1.05 k_acc`` and ``i + 1`` below ``k_acc / 1.05`` one block moves from ``i`` to
    ``i + 1`` (mirror case likewise), and the estimated loads move by one block's worth
    (``int(block_size * k_prev / numel)``) before the next pair is looked at. When
    ``k_prev < n`` (``k_acc == 0``, a division by zero in the reference) nothing moves.
    """
    blocks, loads = list(blocks), list(counts)
    k_acc = int(k_prev / len(blocks))
    if k_acc == 0:
        return blocks
    moved = int(layout.block_size * (k_prev / layout.numel))
    for i in range(len(blocks) - 1):
        left, right = loads[i] / k_acc, loads[i + 1] / k_acc
        if left > 1.05 and right < 0.95238:
            if blocks[i] - 1 < min_blocks:
                continue
            blocks[i] -= 1
            blocks[i + 1] += 1
            loads[i] -= moved
            loads[i + 1] += moved
        if left < 0.95238 and right > 1.05:
            if blocks[i + 1] - 1 < min_blocks:
                continue
            blocks[i] += 1
            blocks[i + 1] -= 1
            loads[i] += moved
            loads[i + 1] -= moved
    return blocks


def prefix_rebalance(blocks: Sequence[int], counts: Sequence[int], min_blocks: float) -> List[int]:
    """The default balancer.

    Args:
        blocks: blocks per partition used at the previous step.
        counts: coordinates selected in each partition at the previous step.
        min_blocks: no partition shrinks below this many blocks.

    With ``share = sum(counts) / n`` and ``E_j = sum(counts[:j]) - j * share`` (what the
    partitions left of boundary ``j`` selected beyond their shares), boundary ``j`` moves one
    block to the left when ``E_j > BAND * share`` and one to the right when
    ``E_j < -BAND * share``, unless the partition it would take from is at its minimum. When
    fewer coordinates than partitions were selected, nothing moves.
    """
    parts, total = len(blocks), sum(counts)
    blocks = list(blocks)
    if total < parts:
        return blocks
    share = total / parts
    excess = 0.0
    for j in range(1, parts):
        excess += counts[j - 1] - share
        if excess > BAND * share and blocks[j - 1] - 1 >= min_blocks:
            blocks[j - 1] -= 1
            blocks[j] += 1
        elif excess < -BAND * share and blocks[j] - 1 >= min_blocks:
            blocks[j - 1] += 1
            blocks[j] -= 1
    return blocks
