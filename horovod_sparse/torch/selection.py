"""Threshold selection over a slice of a flat buffer without full-size temporaries.

``torch.where(x.abs() >= t)`` writes two temporaries of the slice's size (``abs`` and the mask)
and then scans the mask: about 25 times the cost of a read-only pass, most of it memory traffic
and page faults. Here :func:`scan` reduces each block of the slice to its largest ``|x|`` in one
read of the slice (writing one value per block), and :func:`pick` re-reads only the blocks
whose maximum reaches the threshold. The block maxima also feed the histogram controller
(:mod:`horovod_sparse.common.controllers`), and one scan serves any number of thresholds (DGC
and Gaussian-k retry theirs).

The result is exactly ``{i in [start, end) : |x[i]| >= threshold}``, in ascending order.
:class:`Candidates` keeps what lies above a lower bar, so that the histogram controller can count
it before the threshold is known and then filter it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from horovod_sparse.common.controllers import candidate_bar


@dataclass(frozen=True)
class BlockScan:
    """Block maxima of ``x[start:end]``.

    Attributes:
        x: the flat buffer.
        start, end: the scanned slice.
        block: block length; the last block is partial when ``block`` does not divide the slice.
        maxima: largest ``|x|`` of each block, in ``x``'s dtype.
    """

    x: torch.Tensor
    start: int
    end: int
    block: int
    maxima: torch.Tensor

    @property
    def full_blocks(self) -> int:
        return (self.end - self.start) // self.block

    def maxima_numpy(self) -> np.ndarray:
        """The block maxima as a float32 NumPy array (for histograms)."""
        return self.maxima.float().cpu().numpy()


#: Elements per chunk of the CPU scan: the chunk's ``|x|`` stays in a core's cache.
SCAN_CHUNK = 1 << 17


def scan(x: torch.Tensor, start: int, end: int, block: int) -> BlockScan:
    """The largest ``|x|`` of each block of ``block`` elements of ``x[start:end]``.

    On CPU the slice is read once, in chunks of :data:`SCAN_CHUNK` elements whose ``|x|`` goes
    into one small reused buffer before each block's maximum is taken; on an accelerator
    ``|x|`` of the whole slice is formed at once.
    """
    part = x[start:end]
    full = part.numel() // block
    body = part[:full * block]
    if x.is_cuda:
        maxima = body.view(full, block).abs().amax(1)
    else:
        maxima = torch.empty(full, dtype=x.dtype)
        chunk = max(block, SCAN_CHUNK - SCAN_CHUNK % block)
        scratch = torch.empty(min(chunk, body.numel()), dtype=x.dtype)
        for first in range(0, body.numel(), chunk):
            piece = body[first:first + chunk]
            magnitudes = torch.abs(piece, out=scratch[:piece.numel()])
            torch.amax(magnitudes.view(-1, block), 1, out=maxima[first // block:(first + piece.numel()) // block])
    tail = part[full * block:]
    if tail.numel():
        maxima = torch.cat([maxima, tail.abs().amax().view(1)])
    return BlockScan(x, start, end, block, maxima)


def pick(scanned: BlockScan, threshold: float) -> torch.Tensor:
    """Indices into ``x`` (int64, ascending) of ``|x| >= threshold`` within the scanned slice."""
    return pick_with_magnitudes(scanned, threshold)[0]


def pick_with_magnitudes(scanned: BlockScan, threshold: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`pick` and the ``|x|`` of what it picked."""
    hit = torch.nonzero(scanned.maxima >= threshold).squeeze(1)
    x, start, block, full = scanned.x, scanned.start, scanned.block, scanned.full_blocks
    has_tail = hit.numel() > 0 and int(hit[-1]) == full
    rows_hit = hit[:-1] if has_tail else hit
    rows = x[start:start + full * block].view(full, block).index_select(0, rows_hit)  # a copy
    magnitudes = rows.abs_().view(-1)
    flat = torch.nonzero(magnitudes >= threshold).squeeze(1)
    if block & (block - 1) == 0:  # a power of two (always, from scan_block_size): shifts, not divisions
        shift = block.bit_length() - 1
        positions = (rows_hit[flat >> shift] << shift) + (flat & (block - 1))
    else:
        positions = rows_hit[flat // block] * block + flat % block
    found, found_magnitudes = [positions], [magnitudes.take(flat)]
    if has_tail:
        tail = x[start + full * block:scanned.end].abs()
        in_tail = torch.nonzero(tail >= threshold).squeeze(1)
        found.append(in_tail + full * block)
        found_magnitudes.append(tail[in_tail])
    return torch.cat(found) + start, torch.cat(found_magnitudes)


@dataclass(frozen=True)
class Candidates:
    """Every coordinate of a scanned slice at or above ``bar``, the ``budget``-th largest block
    maximum (:func:`horovod_sparse.common.controllers.candidate_bar`): ``indices`` into ``x``
    (ascending) and their ``magnitudes``. Reading them costs one more pass over ``budget``
    blocks; afterwards any threshold at or above the bar is a filter of the candidates."""

    scanned: BlockScan
    bar: float
    indices: torch.Tensor
    magnitudes: torch.Tensor

    @classmethod
    def collect(cls, scanned: BlockScan, budget: int) -> "Candidates":
        bar = candidate_bar(scanned.maxima_numpy(), budget)
        return cls(scanned, bar, *pick_with_magnitudes(scanned, bar))

    def magnitudes_numpy(self) -> np.ndarray:
        """The magnitudes as a float32 NumPy array (for histograms)."""
        return self.magnitudes.float().cpu().numpy()

    def select(self, threshold: float) -> torch.Tensor:
        """Exactly ``pick(scanned, threshold)``: a filter of the candidates when ``threshold`` is
        at or above the bar, a new pick otherwise."""
        if threshold >= self.bar:
            return self.indices[self.magnitudes >= threshold]
        return pick(self.scanned, threshold)


def select(x: torch.Tensor, threshold: float, block: int) -> torch.Tensor:
    """Indices (int64, ascending) of ``|x| >= threshold`` over the whole buffer ``x``."""
    return pick(scan(x, 0, x.numel(), block), threshold)


