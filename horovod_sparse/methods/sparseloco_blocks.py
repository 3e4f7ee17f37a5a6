"""SparseLoCo's 2-D blocks (``blocks=True``; Templar's layout for Covenant-72B): each parameter of
two or more dimensions, viewed as a matrix of ``shape[0]`` rows, cut into blocks of ``side x
side`` elements (``side = sqrt(chunk_size)``: 64 x 64 at the default 4096; the blocks of the last
block row and column are shorter or narrower where the shape does not divide), and each 1-D
parameter into runs of ``chunk_size``; each block of ``L`` elements keeps its ``min(L, max(1,
int(density * L)))`` largest ``|x|`` as a run does (:func:`block_layout`).

The selection works on the group's flat buffer gathered into *block order*: the blocks of equal
size next to each other (largest first, then the parameters' and the blocks' order), each block's
elements in the parameter's order, so that every run of equal blocks is a chunked top-k of its
own and a kept coordinate travels as its offset inside its block, ``offset_width(largest block)``
bits (12 at 64 x 64). Everything here is NumPy, computed once per group from its shapes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from horovod_sparse.common.options import target_count


@dataclass(frozen=True)
class BlockLayout:
    """A group's blocks (:func:`block_layout`).

    Attributes:
        order: int64, one per element: the flat index of the group's buffer at each position of the
            block order.
        runs: ``(start, end, length, keep)`` per run of equal blocks, in block order: positions
            ``start:end`` hold ``(end - start) // length`` blocks of ``length`` elements, each keeping
            ``keep``.
        starts: int64, one per kept coordinate (a rank's, in the order they are selected): the
            position in block order where its block starts.
        largest: the largest block's length (the offsets' range on the wire).
    """

    order: np.ndarray
    runs: Tuple[Tuple[int, int, int, int], ...]
    starts: np.ndarray
    largest: int

    @property
    def count(self) -> int:
        """The coordinates a rank keeps: the sum over the blocks."""
        return int(self.starts.size)


def _blocks_of(flat: np.ndarray, shape: Sequence[int], chunk_size: int, side: int) -> List[np.ndarray]:
    """One parameter's blocks, each a ``(blocks, length)`` array of flat indices (``flat``: the
    parameter's indices in the group's buffer, in its order), in block-row-major order."""
    if len(shape) < 2:
        full = flat.size // chunk_size * chunk_size
        return [flat[:full].reshape(-1, chunk_size), flat[full:].reshape(1, -1)]
    rows = int(shape[0])
    grid = flat.reshape(rows, -1)
    cols = grid.shape[1]
    parts = []
    for r0 in range(0, rows, side):
        band = grid[r0:r0 + side]
        height, full = band.shape[0], cols // side * side
        parts.append(band[:, :full].reshape(height, -1, side).transpose(1, 0, 2).reshape(-1, height * side))
        parts.append(band[:, full:].reshape(1, -1))
    return parts


def block_layout(shapes: Sequence[Sequence[int]], chunk_size: int, density: float) -> BlockLayout:
    """The blocks of a group whose flat buffer holds parameters of ``shapes``, one after the other
    (the module docstring; ``chunk_size`` a square)."""
    side = math.isqrt(chunk_size)
    by_length: Dict[int, List[np.ndarray]] = {}
    offset = 0
    for shape in shapes:
        numel = int(np.prod(shape, dtype=np.int64))
        for part in _blocks_of(np.arange(offset, offset + numel, dtype=np.int64), shape, chunk_size, side):
            if part.size:
                by_length.setdefault(part.shape[1], []).append(part)
        offset += numel
    order, runs, starts, position = [], [], [], 0
    for length in sorted(by_length, reverse=True):
        blocks = np.concatenate(by_length[length])
        keep = min(length, target_count(density, length))
        end = position + blocks.size
        order.append(blocks.reshape(-1))
        runs.append((position, end, length, keep))
        starts.append(np.repeat(np.arange(position, end, length, dtype=np.int64), keep))
        position = end
    empty = np.zeros(0, np.int64)
    return BlockLayout(np.concatenate(order) if order else empty, tuple(runs),
                       np.concatenate(starts) if starts else empty, max(by_length, default=1))
