"""The histogram controller's device side (MiCRO, ExDyna on an accelerator): windows, local
histograms and readings as tensors left on the device, so that the rounds of
:func:`~horovod_sparse.methods.micro.device_rounds.device_histogram_threshold` read nothing on
the host. Each function computes bitwise what its host counterpart in
:mod:`horovod_sparse.methods.micro.controllers` computes (the same float32 edges and comparisons;
the reading's interpolation in double precision, as the host's)."""
from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch

from horovod_sparse.methods.micro.controllers import (FINE_CENTRES, FINE_WINDOW_OFFSETS, REFINE_FRACTION,
                                                      HistogramWindow)
from horovod_sparse.methods.micro.device_rounds import DeviceReading
from horovod_sparse.common.thresholds import SMALLEST_THRESHOLD
from horovod_sparse.torch_core.constants import constant, held, steps
from horovod_sparse.torch_core.selection import BlockScan
from horovod_sparse.torch_core.tensor_backend import to_device

__all__ = ["choose", "fine_edges", "histograms_above", "read_histograms", "window_edges"]


def window_edges(window: HistogramWindow, scanned: BlockScan) -> torch.Tensor:
    """The window's float32 edges on the scanned buffer's device."""
    return to_device(torch.from_numpy(window.edges32()), scanned.x.device)


def fine_edges(threshold: torch.Tensor) -> torch.Tensor:
    """The edges of ``HistogramWindow.around(threshold)`` for a 0-dim float32 threshold left on
    a device, computed there from its bit pattern (the window's offsets copied there once)."""
    centre = threshold.reshape(1).to(torch.float32).view(torch.int32).long().clamp(*FINE_CENTRES)
    offsets = held(FINE_WINDOW_OFFSETS, torch.int64, threshold.device)
    return (centre + offsets).to(torch.int32).view(torch.float32)


def histograms_above(edges: torch.Tensor, scanned: BlockScan, bars: Sequence[Union[float, torch.Tensor]],
                     rank: int, parts: int) -> torch.Tensor:
    """For each of ``bars``, :func:`~horovod_sparse.methods.micro.controllers.local_histogram`
    of the scanned slice's coordinates at or above it (the host's candidates at that bar), in
    the window of float32 ``edges``; one after the other, int32, on the device. Every bar at
    once, in a constant number of operations: one pass bins the slice, one compares it with
    every bar, one ``index_add_`` counts every bar's histogram into one buffer (a coordinate
    below a bar into a spare place past the end), one ``index_copy_`` writes every bar's mark."""
    magnitudes = scanned.magnitudes
    size, count, device = edges.numel(), len(bars), edges.device
    width = size + 1 + parts  # a histogram of size + 1 bins, then its marks
    levels = torch.stack([bar if isinstance(bar, torch.Tensor) else constant(bar, torch.float32, device)
                          for bar in bars])
    slots = torch.searchsorted(edges, magnitudes.float(), right=True, out_int32=True)
    # A bar compared in the magnitudes' dtype, as a 0-dim bar is (rounded to bfloat16 for bfloat16).
    reaching = magnitudes >= levels.to(magnitudes.dtype).unsqueeze(1)
    starts = steps(0, count * width, width, torch.int32, device).unsqueeze(1)
    spare = constant(count * width, torch.int32, device)
    placed = torch.where(reaching, slots + starts, spare).view(-1)
    counts = torch.zeros(count * width + 1, dtype=torch.int32, device=device)
    counts.index_add_(0, placed, constant(1, torch.int32, device).expand(placed.numel()))
    marks = steps(size + 1 + rank, count * width, width, torch.int64, device)
    counts.index_copy_(0, marks, torch.searchsorted(edges, levels, right=False, out_int32=True))
    return counts[:-1]


def read_histograms(edges: torch.Tensor, summed: torch.Tensor, target: int, count: int) -> Tuple[DeviceReading, ...]:
    """:func:`~horovod_sparse.methods.micro.controllers.threshold_from_histogram` of each of the
    ``count`` local histograms :func:`histograms_above` put one after the other (summed over
    ranks), in the window of float32 ``edges``, all at once on the device."""
    size = edges.numel()
    histograms = summed.view(count, -1)
    lowest = histograms[:, size + 1:].amax(1).long()
    tails = histograms[:, :size + 1].long().flip(1).cumsum(1).flip(1)[:, 1:]  # tails[:, j] = T(edge j)
    top = (tails[:, -1] >= target).logical_or_(lowest >= size)
    low = lowest.clamp(max=size - 1).unsqueeze(1)
    short_here = tails.gather(1, low).squeeze(1) < target
    j = ((tails >= target).sum(1, keepdim=True) - 1).clamp_(0, max(0, size - 2))
    rows = torch.cat([j, (j + 1).clamp_(max=size - 1)], 1)  # the bin [edge j, edge j + 1)
    above, beyond = tails.gather(1, rows).double().unbind(1)
    fraction = torch.where(beyond > 0, torch.log(above / target) / torch.log(above / beyond), (above - target) / above)
    lo, hi = edges.take(rows).unbind(1)
    value = lo.double() * (hi.double() / lo.double()) ** fraction
    inside = torch.minimum(torch.maximum(value.float().clamp_min_(SMALLEST_THRESHOLD), lo), hi)
    threshold = torch.where(top, edges[-1], torch.where(short_here, edges.take(low.squeeze(1)), inside))
    bounded = top.logical_not().logical_and_(short_here)
    coarse = top.logical_or(short_here).logical_not_().logical_and_(above - beyond > REFINE_FRACTION * target)
    outside = top.logical_or(bounded.logical_and(lowest == 0))
    short = bounded.logical_and(lowest > 0)
    return tuple(DeviceReading(*fields) for fields in zip(threshold, outside, short, coarse))


def choose(flag: torch.Tensor, a: Union[torch.Tensor, DeviceReading], b: Union[torch.Tensor, DeviceReading]
           ) -> Union[torch.Tensor, DeviceReading]:
    """``a`` where the bool 0-dim ``flag`` holds, else ``b``, on the device: two tensors, or two
    :class:`DeviceReading` field by field (a ``where`` each)."""
    if isinstance(a, torch.Tensor):
        return torch.where(flag, a, b)
    return DeviceReading(*(torch.where(flag, x, y) for x, y in zip(a, b)))
