"""The histogram controller's device side (MiCRO, ExDyna on an accelerator): windows, local
histograms and readings as tensors left on the device, so that the rounds of
:func:`~horovod_sparse.methods.micro.device_rounds.device_histogram_threshold` read nothing on
the host. Each function computes bitwise what its host counterpart in
:mod:`horovod_sparse.methods.micro.controllers` computes (the same float32 edges and comparisons;
the reading's interpolation in double precision, as the host's)."""
from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple

import torch

from horovod_sparse.methods.micro.controllers import (FINE_CENTRES, FINE_WINDOW_OFFSETS, REFINE_FRACTION,
                                                      HistogramWindow)
from horovod_sparse.common.thresholds import SMALLEST_THRESHOLD
from horovod_sparse.methods.micro.device_rounds import DeviceReading
from horovod_sparse.torch_core.constants import constant, held, steps
from horovod_sparse.torch_core.selection import BlockScan
from horovod_sparse.torch_core.tensor_backend import candidate_bar, to_device

__all__ = ["candidate_bars", "fine_edges", "histograms_above", "read_histograms", "settle", "unpack_reading",
           "window_edges"]


def window_edges(window: HistogramWindow, scanned: BlockScan) -> torch.Tensor:
    """The window's float32 edges on the scanned buffer's device."""
    return to_device(torch.from_numpy(window.edges32()), scanned.x.device)


def fine_edges(reading: torch.Tensor) -> torch.Tensor:
    """The edges of ``HistogramWindow.around(threshold)`` for the threshold of a packed reading
    left on a device (:func:`settle`'s), computed there from its bit pattern (the window's offsets
    copied there once)."""
    centre = reading[:1].clamp(*FINE_CENTRES)
    return (centre + held(FINE_WINDOW_OFFSETS, torch.int32, reading.device)).view(torch.float32)


class Bars(NamedTuple):
    """A rank's candidate bars on the device (:func:`candidate_bars`) and what reaches them."""

    #: The bars (float32, one per budget).
    levels: torch.Tensor
    #: The scanned slice's magnitudes at or above each bar, a row each (compared in the
    #: magnitudes' dtype, as a 0-dim bar is: rounded to bfloat16 for bfloat16).
    reaching: torch.Tensor


def candidate_bars(scanned: BlockScan, budgets: Tuple[int, int]) -> Bars:
    """:func:`~horovod_sparse.methods.micro.controllers.candidate_bar` at each of the two
    ``budgets`` (the host's bars bitwise), left on the device with what reaches them, for both
    rounds of :func:`histograms_above`. Where both budgets are below the number of blocks, one
    sorted ``torch.topk`` of the block maxima holds both bars, viewed with a stride from the
    first's place to the second's (the budgets change from step to step: no index tensor is made
    for them), and one clamp: three operations where a ``kthvalue`` and a clamp a bar and their
    ``stack`` took five; else a bar each."""
    maxima = scanned.maxima.float()
    if max(budgets) < maxima.numel():
        top = torch.topk(maxima, max(budgets)).values
        first, second = (top.storage_offset() + budget - 1 for budget in budgets)
        if first <= second:
            both = top.as_strided((2,), (second - first,), first)
        else:
            both = top.as_strided((2,), (first - second,), second).flip(0)
        levels = both.clamp_min(SMALLEST_THRESHOLD)
    else:
        levels = torch.stack([bar if isinstance(bar, torch.Tensor) else constant(bar, torch.float32, maxima.device)
                              for bar in (candidate_bar(scanned, budget) for budget in budgets)])
    magnitudes = scanned.magnitudes
    return Bars(levels, magnitudes >= levels.to(magnitudes.dtype).unsqueeze(1))


def histograms_above(edges: torch.Tensor, scanned: BlockScan, bars: Bars, rank: int, parts: int) -> torch.Tensor:
    """For each of ``bars`` (:func:`candidate_bars`),
    :func:`~horovod_sparse.methods.micro.controllers.local_histogram` of the scanned slice's
    coordinates at or above it (the host's candidates at that bar), in the window of float32
    ``edges``; one after the other, int32, on the device. Every bar at once, in a constant number
    of operations: one pass bins the slice, one ``index_add_`` counts every bar's histogram into
    one buffer (a coordinate below a bar into a spare place past the end), one ``index_copy_``
    writes every bar's mark."""
    size, count, device = edges.numel(), bars.levels.numel(), edges.device
    width = size + 1 + parts  # a histogram of size + 1 bins, then its marks
    slots = torch.searchsorted(edges, scanned.magnitudes.float(), right=True, out_int32=True)
    starts = constant(tuple((row * width,) for row in range(count)), torch.int32, device)  # a column
    spare = constant(count * width, torch.int32, device)
    placed = torch.where(bars.reaching, slots + starts, spare).view(-1)
    counts = torch.zeros(count * width + 1, dtype=torch.int32, device=device)
    counts.index_add_(0, placed, constant(1, torch.int32, device).expand(placed.numel()))
    marks = steps(size + 1 + rank, count * width, width, torch.int64, device)
    counts.index_copy_(0, marks, torch.searchsorted(edges, bars.levels, right=False, out_int32=True))
    return counts[:-1]


def read_histograms(edges: torch.Tensor, summed: torch.Tensor, target: int, count: int) -> torch.Tensor:
    """:func:`~horovod_sparse.methods.micro.controllers.threshold_from_histogram` of each of the
    ``count`` local histograms :func:`histograms_above` put one after the other (summed over
    ranks), in the window of float32 ``edges``, all at once on the device: an int32 row each, the
    fields of :data:`~horovod_sparse.methods.micro.device_rounds.READING_FIELDS` (the threshold as
    its float32 bit pattern, the flags 0 or 1).

    With ``reached`` the edges ``T`` reaches the target at (``T`` non-increasing) and ``lowest``
    the highest rank's bar, the reading's bin is ``[edge max(reached - 1, lowest), edge
    max(reached, lowest)]``, clamped into the window: the interpolation's bin when ``reached >
    lowest`` (and short of the window's end), else one edge, both ends the same (the window's
    last when the answer lies above it, the bar's when it stops short there), so that one clamp
    of the interpolated value gives the threshold of every case. The answer is outside the window
    when that bin's upper end is the window's first edge or past its last; short when it stopped
    at a bar (``reached <= lowest``) inside the window; coarse when interpolated (neither) in a bin
    holding more than :data:`~horovod_sparse.methods.micro.controllers.REFINE_FRACTION` of the
    target."""
    size = edges.numel()
    histograms = summed.view(count, -1)
    # Each pair of columns taken apart by one split (a view each, one call), not two slices.
    bins, marks = histograms.split([size + 1, histograms.shape[1] - size - 1], 1)
    lowest = marks.amax(1, keepdim=True)
    tails = bins.flip(1).cumsum(1, dtype=torch.int64).flip(1)[:, 1:]  # tails[:, j] = T(edge j)
    reached = (tails >= target).sum(1, keepdim=True)
    ends = torch.maximum(reached + constant(((-1, 0),), torch.int64, reached.device), lowest)
    rows = ends.clamp_max(size - 1)
    counts = tails.gather(1, rows).double()
    above, beyond = counts.split(1, 1)
    fraction = torch.where(beyond > 0, torch.log(above / target) / torch.log(above / beyond), (above - target) / above)
    lo, hi = edges.double().take(rows).split(1, 1)
    # At one edge (lo == hi) the interpolation is lo * 1 ** fraction: lo, whatever the fraction there.
    threshold = torch.clamp(lo * (hi / lo) ** fraction, lo, hi).float().view(torch.int32)
    bounded = reached <= lowest  # below, ``a > b`` of two flags: a and not b
    outside = ends[:, 1:].remainder(size) == 0
    coarse = (above - beyond > REFINE_FRACTION * target) > bounded.logical_or(outside)
    return torch.cat([threshold, outside, bounded > outside, coarse], 1)


def settle(readings: torch.Tensor, places: Sequence[Tuple[int, int]], rows: Sequence[int]
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The packed reading (1-D) at row ``rows[f]`` of ``readings`` (:func:`read_histograms`'
    rows), ``f`` the flags at ``places`` (row, column) read as a binary number, the first the
    highest bit; and those flags (1-D). On the device, in a constant number of operations."""
    device = readings.device
    flags = readings.take(constant(tuple(row * readings.shape[1] + column for row, column in places),
                                   torch.int64, device))
    number = (flags * constant(tuple(1 << bit for bit in reversed(range(len(places)))), torch.int32,
                               device)).sum(0, keepdim=True)
    row = constant(tuple(rows), torch.int64, device).take(number)
    return readings.index_select(0, row).view(-1), flags


def unpack_reading(reading: torch.Tensor) -> DeviceReading:
    """A packed reading (:func:`settle`'s) as a :class:`DeviceReading` of 0-dim tensors."""
    bits, outside, short, coarse = reading.unbind()
    return DeviceReading(bits.view(torch.float32), outside, short, coarse)
