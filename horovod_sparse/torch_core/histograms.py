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
from horovod_sparse.torch_core.selection import BlockScan
from horovod_sparse.torch_core.tensor_backend import to_device

__all__ = ["choose", "fine_edges", "histograms_above", "read_histograms", "window_edges"]


def window_edges(window: HistogramWindow, scanned: BlockScan) -> torch.Tensor:
    """The window's float32 edges on the scanned buffer's device."""
    return to_device(torch.from_numpy(window.edges32()), scanned.x.device)


def fine_edges(threshold: torch.Tensor) -> torch.Tensor:
    """The edges of ``HistogramWindow.around(threshold)`` for a 0-dim float32 threshold left on
    a device, computed there from its bit pattern."""
    centre = threshold.reshape(1).to(torch.float32).view(torch.int32).long().clamp(*FINE_CENTRES)
    offsets = to_device(torch.from_numpy(FINE_WINDOW_OFFSETS), threshold.device)
    return (centre + offsets).to(torch.int32).view(torch.float32)


def histograms_above(edges: torch.Tensor, scanned: BlockScan, bars: Sequence[Union[float, torch.Tensor]],
                     rank: int, parts: int) -> torch.Tensor:
    """For each of ``bars``, :func:`~horovod_sparse.methods.micro.controllers.local_histogram`
    of the scanned slice's coordinates at or above it (the host's candidates at that bar), in
    the window of float32 ``edges``; one after the other, int32, on the device: one pass bins
    the slice, one per bar counts it."""
    magnitudes = scanned.magnitudes
    size = edges.numel()
    slots = torch.searchsorted(edges, magnitudes.float(), right=True)
    ones = torch.ones_like(slots, dtype=torch.int32)
    parts_of: list = []
    for bar in bars:
        level = bar.reshape(1).float() if isinstance(bar, torch.Tensor) else torch.full((1,), bar, device=edges.device)
        counted = torch.where(magnitudes >= bar, slots, size + 1)  # below the bar: a bin dropped below
        counts = torch.zeros(size + 2, dtype=torch.int32, device=edges.device).index_add_(0, counted, ones)
        marks = torch.zeros(parts, dtype=torch.int32, device=edges.device)
        marks[rank:rank + 1] = torch.searchsorted(edges, level, right=False).to(torch.int32)
        parts_of += [counts[:size + 1], marks]
    return torch.cat(parts_of)


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


def choose(flag: torch.Tensor, a: DeviceReading, b: DeviceReading) -> DeviceReading:
    """``a`` where the bool 0-dim ``flag`` holds, else ``b``, field by field, on the device."""
    return DeviceReading(*(torch.where(flag, x, y) for x, y in zip(a, b)))

