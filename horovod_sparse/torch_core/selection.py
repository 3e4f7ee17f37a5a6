"""Threshold selection over a slice of a flat buffer without full-size temporaries.

``torch.where(x.abs() >= t)`` writes two temporaries of the slice's size (``abs`` and the mask)
and then scans the mask: about 25 times the cost of a read-only pass, most of it memory traffic
and page faults. Here :func:`scan` reduces each block of the slice to its largest ``|x|`` in one
read of the slice (writing one value per block), and :func:`pick` re-reads only the blocks
whose maximum reaches the threshold. The block maxima also feed the histogram controller
(:mod:`horovod_sparse.methods.micro.controllers`), and one scan serves any number of thresholds (DGC
and Gaussian-k retry theirs).

The result is exactly ``{i in [start, end) : |x[i]| >= threshold}``, in ascending order.
:func:`pick_with_magnitudes` also returns the magnitudes, for the histogram controller's
candidates (:mod:`horovod_sparse.methods.micro.candidates`).

The exact top-k built on the scan is :mod:`horovod_sparse.torch_core.top_k`. Gaussian-k takes its
mean and deviation from the same scan (``moments``).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch

from horovod_sparse.common.thresholds import SCAN_CHUNK, mean_std
from horovod_sparse.methods.backend import PAD, Capped, cut

#: A moment of a scan: a float, or a 0-dim float64 tensor left on an accelerator.
Moment = Union[float, torch.Tensor]
#: A threshold: a float, or a 0-dim float32 tensor left on an accelerator.
Threshold = Union[float, torch.Tensor]


@dataclass(frozen=True)
class BlockScan:
    """Block maxima of ``x[start:end]``.

    Attributes:
        x: the flat buffer.
        start, end: the scanned slice.
        block: block length; the last block is partial when ``block`` does not divide the slice.
        block_maxima: largest ``|x|`` of each block, in ``x``'s dtype, when the scan took them
            (None: on an accelerator, taken from :attr:`magnitudes` if :attr:`maxima` is asked for).
        moments: ``(sum x, sum x^2)`` over the slice when the scan was asked for them: on the
            host floats, double-precision sums of single-precision chunk sums (double ones for
            float64); on an accelerator one single-precision sum of the slice each (double for
            float64), as 0-dim float64 tensors left there.
        last_pass: the host's last :class:`HostPass` of the slice, under its threshold and
            comparison (:func:`host_pass`; at most one entry).
        last_reached: the accelerators' last ``(threshold, mask of |x| >= threshold, its
            count)`` (:func:`device_reached`; at most one entry).
    """

    x: torch.Tensor
    start: int
    end: int
    block: int
    block_maxima: Optional[torch.Tensor]
    moments: Optional[Tuple[Moment, Moment]] = None
    last_pass: Dict[Tuple[float, Callable[..., torch.Tensor]], "HostPass"] = field(
        default_factory=dict, compare=False, repr=False)
    last_reached: List[Tuple[Threshold, torch.Tensor, torch.Tensor]] = field(
        default_factory=list, compare=False, repr=False)

    @functools.cached_property
    def maxima(self) -> torch.Tensor:
        """The largest ``|x|`` of each block (:attr:`block_maxima`, or from :attr:`magnitudes`)."""
        if self.block_maxima is not None:
            return self.block_maxima
        full = self.full_blocks * self.block
        whole = full == self.magnitudes.numel()
        body = self.magnitudes if whole else self.magnitudes[:full]  # a slice is an operation too
        maxima = body.view(-1, self.block).amax(1)
        if whole:
            return maxima
        return torch.cat([maxima, self.magnitudes[full:].amax().view(1)])

    @functools.cached_property
    def magnitudes(self) -> torch.Tensor:
        """``|x[start:end]|``, formed once for the accelerators' passes over the slice (a pass
        is cheap there; a threshold's retries each count from it)."""
        whole = self.start == 0 and self.end == self.x.numel()  # a slice is an operation too
        return (self.x if whole else self.x[self.start:self.end]).abs()

    @property
    def full_blocks(self) -> int:
        return (self.end - self.start) // self.block

    def maxima_numpy(self) -> np.ndarray:
        """The block maxima as a float32 NumPy array (for histograms)."""
        return self.maxima.float().cpu().numpy()

    def mean_std(self) -> Tuple[Moment, Moment]:
        """Mean and unbiased standard deviation of the slice, from :attr:`moments`
        (:func:`horovod_sparse.common.thresholds.mean_std`; for moments left on an accelerator
        the same double-precision arithmetic, as 0-dim float64 tensors there)."""
        assert self.moments is not None, "scan(..., moments=True) computes them"
        total, squares = self.moments
        numel = self.end - self.start
        if not isinstance(total, torch.Tensor):
            return mean_std(total, squares, numel)
        mean = total / numel
        if numel == 1:
            return mean, torch.zeros_like(total)
        return mean, ((squares - total * mean).clamp_min(0.0) / (numel - 1)).sqrt()


def scan(x: torch.Tensor, start: int, end: int, block: int, moments: bool = False) -> BlockScan:
    """The largest ``|x|`` of each block of ``block`` elements of ``x[start:end]``, and with
    ``moments`` the sums of ``x`` and ``x^2`` (:attr:`BlockScan.moments`).

    On CPU the slice is read once, in chunks of :data:`SCAN_CHUNK` elements whose ``|x|`` goes
    into one small reused buffer before each block's maximum (and the chunk's sums) is taken;
    on an accelerator ``|x|`` of the whole slice is formed at once, and without ``moments`` nothing
    is read until a selection asks (:attr:`BlockScan.magnitudes`, :attr:`BlockScan.maxima`): a
    threshold's passes there count from the magnitudes, not the block maxima.
    """
    if on_accelerator(x):
        return _device_scan(x, start, end, block, moments)
    part = x[start:end]
    full = part.numel() // block
    body = part[:full * block]
    sums: List[float] = [0.0, 0.0]
    accumulator = torch.float64 if x.dtype == torch.float64 else torch.float32

    def add_moments(values: torch.Tensor, magnitudes: torch.Tensor) -> None:
        if moments:  # in double precision
            norm = float(torch.linalg.vector_norm(magnitudes, dtype=accumulator))
            sums[0] = sums[0] + float(values.sum(dtype=accumulator))
            sums[1] = sums[1] + norm * norm

    maxima = torch.empty(full, dtype=x.dtype)
    chunk = max(block, SCAN_CHUNK - SCAN_CHUNK % block)
    scratch = torch.empty(min(chunk, body.numel()), dtype=x.dtype)
    for first in range(0, body.numel(), chunk):
        piece = body[first:first + chunk]
        magnitudes = torch.abs(piece, out=scratch[:piece.numel()])
        torch.amax(magnitudes.view(-1, block), 1, out=maxima[first // block:(first + piece.numel()) // block])
        add_moments(piece, magnitudes)
    tail = part[full * block:]
    if tail.numel():
        magnitudes = tail.abs()
        maxima = torch.cat([maxima, magnitudes.amax().view(1)])
        add_moments(tail, magnitudes)
    return BlockScan(x, start, end, block, maxima, (sums[0], sums[1]) if moments else None)


def _device_scan(x: torch.Tensor, start: int, end: int, block: int, moments: bool) -> BlockScan:
    """:func:`scan` on an accelerator: nothing is read without ``moments``; with them ``|x|`` of
    the whole slice is formed once (kept as :attr:`BlockScan.magnitudes` for the passes that
    follow) and the moments come from it and the slice in one sum each, left on the device."""
    if not moments:
        return BlockScan(x, start, end, block, None)
    part = x if start == 0 and end == x.numel() else x[start:end]  # a slice is an operation too
    magnitudes = part.abs()
    accumulator = torch.float64 if x.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(magnitudes, dtype=accumulator).double()
    scanned = BlockScan(x, start, end, block, None, (part.sum(dtype=accumulator).double(), norm * norm))
    scanned.__dict__["magnitudes"] = magnitudes  # the cached property's value, formed here once
    return scanned


def pick(scanned: BlockScan, threshold: Threshold) -> torch.Tensor:
    """Indices into ``x`` (int64, ascending) of ``|x| >= threshold`` within the scanned slice."""
    return pick_with_magnitudes(scanned, threshold)[0]


def pick_with_magnitudes(scanned: BlockScan, threshold: Threshold,
                         strict: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`pick` and the ``|x|`` of what it picked; ``strict``: ``|x| > threshold`` instead."""
    reaches = torch.gt if strict else torch.ge
    if on_accelerator(scanned.x):
        return device_pick(scanned, threshold, reaches)
    return host_pick(scanned, host_pass(scanned, threshold, reaches))


def host_pick(scanned: BlockScan, hits: "HostPass",
              enough: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The indices into ``x`` (ascending) and magnitudes of what the host's pass ``hits`` of
    ``scanned`` reaches; with ``enough``, its slabs are read only until that many are found
    (the result then holds at least its ``enough`` lowest indices)."""
    block = scanned.block
    found, found_magnitudes = [], []
    picked = 0
    for rows, magnitudes, reached in hits.read():
        flat = torch.nonzero(reached).squeeze(1)
        if block & (block - 1) == 0:  # a power of two (always, from scan_block_size): shifts, not divisions
            shift = block.bit_length() - 1
            found.append((rows[flat >> shift] << shift) + (flat & (block - 1)))
        else:
            found.append(rows[flat // block] * block + flat % block)
        found_magnitudes.append(magnitudes.take(flat))
        picked += flat.numel()
        if enough is not None and picked >= enough:
            break
    if hits.tail is not None and (enough is None or picked < enough):
        in_tail = torch.nonzero(hits.tail_reached).squeeze(1)
        found.append(in_tail + scanned.full_blocks * block)
        found_magnitudes.append(hits.tail[in_tail])
    if not found:
        return torch.empty(0, dtype=torch.int64), scanned.x.new_empty(0)
    return torch.cat(found) + scanned.start, torch.cat(found_magnitudes)


#: A slab of a host pass: the rows (indices of full blocks) it read, ``|x|`` of their blocks
#: (flat) and the mask of those that reach the pass's threshold.
Slab = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class HostPass:
    """What one threshold reaches in a scanned slice on the host: the pass a count and a pick
    share (:func:`host_pass`).

    Attributes:
        read: the :class:`Slab` of the full blocks whose maximum reaches, in ascending order of
            their rows, at each call: a pass of one slab holds it, a larger one reads its blocks
            again (:func:`host_slabs`).
        tail: ``|x|`` of the partial last block when its maximum reaches, else None.
        tail_reached: the mask of ``tail`` that reaches (None with ``tail``).
        counted: the count, once taken (:meth:`count`).
    """

    read: Callable[[], Iterable[Slab]]
    tail: Optional[torch.Tensor]
    tail_reached: Optional[torch.Tensor]
    counted: List[int] = field(default_factory=list, compare=False)

    def count(self) -> int:
        """How many magnitudes reach, read on the host (once)."""
        if not self.counted:
            found = sum(host_count(reached) for _, _, reached in self.read())
            self.counted.append(found if self.tail_reached is None else found + host_count(self.tail_reached))
        return self.counted[0]


def host_count(mask: torch.Tensor) -> int:
    """How many of the bool ``mask`` hold, read on the host. ``torch.count_nonzero``: a CPU's
    ``.sum()`` of a bool tensor widens every element to int64 as it adds, many times slower
    over a large mask (the accelerators' paths keep ``.sum()``, whose count stays there)."""
    return int(torch.count_nonzero(mask))


def host_pass(scanned: BlockScan, threshold: float,
              reaches: Callable[[torch.Tensor, float], torch.Tensor] = torch.ge) -> HostPass:
    """The :class:`HostPass` of ``reaches(|x|, threshold)`` (``torch.ge`` or ``torch.gt``) in
    the host's scanned slice: the blocks whose maximum reaches re-read, the others skipped, at
    most :data:`SCAN_CHUNK` elements at a time (:func:`host_slabs`). The last pass of a scan is
    kept with it, with its count once taken: a pick at the threshold just counted (DGC's and
    Gaussian-k's final one) knows the count, and where the pass is one slab does not read the
    blocks again."""
    key = (threshold, reaches)
    kept = scanned.last_pass
    if key in kept:
        return kept[key]
    hit = torch.nonzero(reaches(scanned.maxima, threshold)).squeeze(1)
    x, full = scanned.x, scanned.full_blocks
    has_tail = hit.numel() > 0 and int(hit[-1]) == full
    rows = hit[:-1] if has_tail else hit
    tail = x[scanned.start + full * scanned.block:scanned.end].abs() if has_tail else None
    read: Callable[[], Iterable[Slab]] = functools.partial(host_slabs, scanned, rows, threshold, reaches)
    if rows.numel() * scanned.block <= SCAN_CHUNK:
        read = functools.partial(iter, list(read()))
    found = HostPass(read, tail, None if tail is None else reaches(tail, threshold))
    kept.clear()
    kept[key] = found
    return found


def host_slabs(scanned: BlockScan, rows: torch.Tensor, threshold: float,
               reaches: Callable[..., torch.Tensor]) -> Iterator[Slab]:
    """The full blocks ``rows`` of the host's scanned slice as :class:`Slab`, :data:`SCAN_CHUNK`
    elements at a time, each slab's ``|x|`` and mask written into two buffers of a slab's size
    that the next slab reuses (a slab's tensors are valid until the next is asked for): a
    buffer of a large pass's size, fresh at each pass, costs the page faults of its memory
    first, and Gaussian-k's corrections on a heavy-tailed gradient re-read a large share of the
    blocks at each count (the ``select`` phase of ``benchmarks.emulated.synthetic`` on VGG,
    docs/benchmarks.md)."""
    x, block, full = scanned.x, scanned.block, scanned.full_blocks
    blocks = x[scanned.start:scanned.start + full * block].view(full, block)
    per = max(1, SCAN_CHUNK // block)
    size = min(per, rows.numel())
    magnitudes = torch.empty(size, block, dtype=x.dtype)
    reached = torch.empty(size * block, dtype=torch.bool)
    for first in range(0, rows.numel(), per):
        part = rows[first:first + per]
        read = torch.index_select(blocks, 0, part, out=magnitudes[:part.numel()]).abs_().view(-1)
        yield part, read, reaches(read, threshold, out=reached[:read.numel()])


def device_pick(scanned: BlockScan, threshold: Threshold,
                reaches: Callable[[torch.Tensor, float], torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`pick_with_magnitudes` in one pass over the slice, for accelerators: the only host
    read is the size of the result."""
    magnitudes = scanned.magnitudes
    found = torch.nonzero(reaches(magnitudes, threshold)).squeeze(1)
    return found + scanned.start, magnitudes.take(found)


def pick_capped(scanned: BlockScan, threshold: Threshold, capacity: int) -> Capped:
    """:func:`pick` cut to its ``capacity`` lowest indices (:class:`~horovod_sparse.methods.backend.Capped`).
    On the host the pass's slabs are read until ``capacity`` are found and the selection counted
    (:meth:`HostPass.count`: once per pass, so not again after :func:`count_reaching` at the same
    threshold); on an accelerator one pass over the slice
    writes the first ``capacity`` indices into a payload of that size (``nonzero_static``, padded
    with :data:`~horovod_sparse.methods.backend.PAD`) and counts the selection on the device:
    nothing is read on the host. A capacity of the whole slice (the hard threshold's default)
    holds every selection: what was found is sent and nothing overflows, with no operation to
    say so."""
    if not on_accelerator(scanned.x):
        hits = host_pass(scanned, threshold)
        idx = host_pick(scanned, hits, capacity)[0]
        return cut(idx, hits.count() if idx.numel() >= capacity else idx.numel(), capacity)
    reaches, found = device_reached(scanned, threshold)
    idx = torch.nonzero_static(reaches, size=capacity, fill_value=PAD).squeeze(1)
    if scanned.start:
        idx = torch.where(idx == PAD, idx, idx + scanned.start)
    if capacity >= scanned.end - scanned.start:
        return Capped(idx, found, 0, padded=True)
    sent = found.clamp(max=capacity)
    return Capped(idx, sent, found - sent, padded=True)


def count_reaching(scanned: BlockScan, threshold: Threshold) -> Union[int, torch.Tensor]:
    """How many ``|x| >= threshold`` the scanned slice holds: on an accelerator a 0-dim int64
    tensor left there (one pass), else an int from the :func:`host_pass` that a :func:`pick` at
    the same threshold then finishes."""
    if on_accelerator(scanned.x):
        return device_reached(scanned, threshold)[1]
    return host_pass(scanned, threshold).count()


def device_reached(scanned: BlockScan, threshold: Threshold) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(|x| >= threshold, its count)`` over the accelerators' scanned slice, the count a 0-dim
    int64 tensor left there. The last threshold's are kept with the scan, so a pick at the
    threshold just counted (Gaussian-k's final one) neither compares nor counts again; the
    threshold is recognised by identity (the same object), not by value (a 0-dim tensor's ``==``
    would be read on the host)."""
    kept = scanned.last_reached
    if kept and kept[0][0] is threshold:
        return kept[0][1], kept[0][2]
    reached = scanned.magnitudes >= threshold
    found = reached.sum()
    kept[:] = [(threshold, reached, found)]
    return reached, found


def select(x: torch.Tensor, threshold: float, block: int) -> torch.Tensor:
    """Indices (int64, ascending) of ``|x| >= threshold`` over the whole buffer ``x``."""
    return pick(scan(x, 0, x.numel(), block), threshold)


#: Whether the accelerators' paths also run on CPU tensors (:func:`accelerator_paths`).
_FORCED = False


def on_accelerator(t: torch.Tensor) -> bool:
    """Whether ``t``'s work takes the accelerators' paths, which read nothing on the host: on a
    GPU, or anywhere inside :func:`accelerator_paths`."""
    return t.is_cuda or _FORCED


@contextmanager
def accelerator_paths() -> Iterator[None]:
    """Run the accelerators' paths on CPU tensors too, inside the block: how the tests count
    the host reads of a step as a GPU would make them (``tests/support/host_reads.py``)."""
    global _FORCED
    previous, _FORCED = _FORCED, True
    try:
        yield
    finally:
        _FORCED = previous
