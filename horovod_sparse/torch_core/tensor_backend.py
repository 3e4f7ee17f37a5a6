"""PyTorch's tensor primitives of :class:`horovod_sparse.methods.backend.Backend`, for every
PyTorch front end: :mod:`horovod_sparse.torch.backend` (Horovod) and
:mod:`horovod_sparse.distributed.backend` (``torch.distributed``) add their host collectives to these.
Nothing here imports Horovod.

Primitives named for an ``out`` or ``x`` argument write into it and return it, so a step
allocates nothing of a buffer's size (the front end reuses each group's residual and output).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from horovod_sparse.methods.backend import PAD, Capped
from horovod_sparse.methods.micro import controllers
from horovod_sparse.common import threshold_baselines
from horovod_sparse.common.threshold_baselines import band_factor
from horovod_sparse.common.thresholds import SMALLEST_THRESHOLD, as_float32
from horovod_sparse.torch_core.constants import constant
from horovod_sparse.torch_core.chunked import (bin_means, dequantize, float32, level_codes, moments,  # noqa: F401
                                               pack_codes, pack_offsets, top_k_chunks, unpack_codes,
                                               unpack_offsets)  # (backend API)
from horovod_sparse.torch_core.selection import (BlockScan, count_reaching, device_reached, host_count,
                                                 on_accelerator, pick, pick_capped, pick_with_magnitudes, scan,
                                                 select)
from horovod_sparse.torch_core.top_k import top_k

__all__ = ["DEFERS_STATISTICS", "UNION_BY_MARKS", "all_finite", "as_index", "as_threshold", "at_least", "band",
           "bin_means", "both", "candidate_bar", "chunk_counts", "clone", "coalesce", "concat", "copy_at",
           "count_reaching", "count_true", "counts_at", "decides_on_device", "delivered", "dequantize",
           "device_reached", "distinct", "embed", "first_settled", "float32", "from_numpy", "from_saved",
           "from_wire_mask", "gather", "host_call", "index_dtype", "isin", "kept", "kth_magnitude", "level_codes",
           "local_histogram", "lowered_thresholds", "mask", "masked_union", "moments", "momentum_step", "numel",
           "outside_trace", "pack_codes", "pack_offsets", "pick", "pick_capped", "pick_with_magnitudes",
           "reshape_one", "saved", "scan", "scatter_chunks", "scatter_set", "select", "size", "splits_to",
           "sum_chunks", "synchronize", "to_numpy", "to_wire", "to_wire_mask", "top_k", "top_k_capped",
           "top_k_chunks", "unpack_codes", "unpack_offsets", "unpadded", "wire_index"]

#: Statistics may be worked out when read (``Backend.DEFERS_STATISTICS``): a PyTorch step is not traced.
DEFERS_STATISTICS = True

#: :func:`distinct` counts by sorting while the indices are fewer than ``1 / UNION_BY_MARKS`` of
#: the buffer (sorting ``n k`` indices costs about as much as marking and counting ``16 n k``
#: bytes).
UNION_BY_MARKS = 16


def numel(x: torch.Tensor) -> int:
    return x.numel()


def size(t: torch.Tensor) -> int:
    return t.numel()


def decides_on_device(x: torch.Tensor) -> bool:
    return on_accelerator(x)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def from_numpy(array: np.ndarray, like: Optional[torch.Tensor]) -> torch.Tensor:
    return to_device(torch.from_numpy(array), None if like is None else like.device)


def to_device(host: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """A host tensor on ``device`` (None: the host), copied without waiting for the device: on
    CUDA through pinned memory (PyTorch's caching host allocator keeps it until the copy ran)."""
    if device is None or device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def saved(t: torch.Tensor) -> torch.Tensor:
    return t


def from_saved(saved: torch.Tensor) -> torch.Tensor:
    return saved


def reshape_one(n: Union[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if isinstance(n, torch.Tensor):  # a count left on the device: a fill would read it on the host
        return n.reshape(1).to(torch.int64)
    return torch.full((1,), n, dtype=torch.int64, device=like.device)  # a fill: no copy from the host


def chunk_counts(counts: Any, size: int, fixed: bool) -> List[int]:
    return [counts] * size if fixed else counts.tolist()


def host_call(decide: Callable[..., Any], args: Sequence[Any], dtype: str) -> Any:
    return decide(*args)


def outside_trace() -> ContextManager[None]:
    return nullcontext()


def at_least(t: torch.Tensor, threshold: float) -> torch.Tensor:
    return t >= threshold


def clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x[idx]


def delivered(x: torch.Tensor, capped: Capped) -> Tuple[torch.Tensor, torch.Tensor]:
    if not capped.padded:
        return capped.idx, x[capped.idx]
    real = capped.idx != PAD
    index = capped.idx.clamp_min(0)
    return index, torch.where(real, x[index], constant(0.0, x.dtype, x.device))


def unpadded(indices: torch.Tensor) -> torch.Tensor:
    return indices.clamp_min(0)


def to_wire(values: torch.Tensor, fp16: bool) -> torch.Tensor:
    if fp16:
        return values.to(torch.float16)
    return values.float() if values.dtype == torch.bfloat16 else values


def wire_index(idx: torch.Tensor, numel: int) -> torch.Tensor:
    return idx.to(index_dtype(numel))


def as_index(t: torch.Tensor) -> torch.Tensor:
    return t.long()


def scatter_chunks(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, counts: Sequence[int],
                   scale: float) -> torch.Tensor:
    """One race-free ``index_add_`` per rank's chunk, in rank order: bitwise identical on every
    rank, on CPU and on GPU (where one ``index_add_`` with repeated indices adds in a
    non-deterministic order)."""
    values = values.to(out.dtype)
    if len(counts) == 1:
        return out.index_add_(0, indices, values, alpha=scale)
    for index_chunk, value_chunk in zip(indices.split(list(counts)), values.split(list(counts))):
        out.index_add_(0, index_chunk, value_chunk, alpha=scale)
    return out


def sum_chunks(out: torch.Tensor, values: torch.Tensor, size: int, scale: float) -> torch.Tensor:
    values = values.to(out.dtype)
    if scale != 1:  # index_add_'s alpha: the scale in the values' dtype, a product, then a sum
        values.mul_(constant(scale, out.dtype, out.device))
    for chunk in values.split(out.numel()) if size > 1 else (values,):
        out.add_(chunk)
    return out


def masked_union(values: torch.Tensor, size: int) -> torch.Tensor:
    sent = values != 0
    return (sent.view(size, -1).any(0) if size > 1 else sent).sum()


def scatter_set(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    values = values.to(out.dtype)
    return out.index_copy_(0, idx.long(), values * scale if scale != 1 else values)


def distinct(indices: torch.Tensor, numel: int, padded: bool = False) -> Union[int, torch.Tensor]:
    """By sorting when the indices are few, else by marking a buffer's coordinates (one read
    of ``numel`` bytes instead of sorting ``n k`` indices). On an accelerator
    (:func:`~horovod_sparse.torch_core.selection.on_accelerator`) always by marking, and the count
    stays there as a 0-dim tensor, read when the step's statistics settle: the statistic
    costs no host synchronisation. ``padded``: :data:`~horovod_sparse.methods.backend.PAD`
    rows mark one place past the buffer, not counted."""
    if not on_accelerator(indices) and indices.numel() * UNION_BY_MARKS < numel:
        return int(torch.unique(indices).numel())
    marks = torch.zeros(numel + padded, dtype=torch.bool, device=indices.device)
    # index_put_ of a True made once per device: it takes the wire's int32 indices (index_fill_
    # takes int64 only: a cast), and not marks[indices] = True, which copies True from the host.
    # A PAD (-1) marks marks[-1], the place past the buffer, as an index does in Python.
    marks.index_put_((indices,), constant(True, torch.bool, indices.device))
    marked = marks[:numel] if padded else marks
    return marked.sum() if on_accelerator(indices) else host_count(marked)


def coalesce(idx: torch.Tensor, values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    if not on_accelerator(idx):
        unique, position = torch.unique(idx, sorted=True, return_inverse=True)
        summed = torch.zeros(unique.numel(), dtype=values.dtype, device=values.device)
        return unique, summed.index_add_(0, position, values)
    # Fixed size: each sorted index goes to its run's place (runs of equal indices, in order).
    ordered, order = torch.sort(idx, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    place = first.cumsum(0) - 1
    unique = torch.zeros_like(ordered).scatter_(0, place, ordered)
    return unique, torch.zeros_like(values).index_add_(0, place, values[order])


def isin(values: torch.Tensor, ascending: torch.Tensor) -> torch.Tensor:
    if not on_accelerator(values):
        return torch.isin(values, ascending)
    if ascending.numel() == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    # torch.isin sorts through a host-synchronising unique on CUDA; a binary search does not.
    position = torch.searchsorted(ascending, values).clamp_(max=ascending.numel() - 1)
    return ascending.take(position) == values


def mask(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return t[keep]


def both(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.logical_and(b)


def kept(values: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    return values if keep is None else torch.where(keep, values, constant(0.0, values.dtype, values.device))


def count_true(keep: Optional[torch.Tensor], total: int) -> Union[int, torch.Tensor]:
    if keep is None:
        return total
    return keep.sum() if on_accelerator(keep) else host_count(keep)


def to_wire_mask(keep: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if keep is None:
        return torch.ones(like.shape[0], dtype=torch.uint8, device=like.device)
    return keep.to(torch.uint8)


def from_wire_mask(t: torch.Tensor) -> torch.Tensor:
    return t.bool()


def concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(tensors))


def splits_to(size: int, target: Optional[int], tensor: torch.Tensor) -> List[int]:
    return [tensor.shape[0] if rank == target else 0 for rank in range(size)]


def embed(out: torch.Tensor, lo: int, values: torch.Tensor) -> torch.Tensor:
    target = out[lo:lo + values.numel()]
    if values.data_ptr() == target.data_ptr():  # that slice, changed in place after an earlier embed
        return out
    out[:lo].zero_()
    out[lo + values.numel():].zero_()
    target.copy_(values)
    return out


def copy_at(out: torch.Tensor, capped: Capped, source: Optional[torch.Tensor]) -> torch.Tensor:
    idx = capped.idx
    if not capped.padded:
        return out.index_fill_(0, idx, 0.0) if source is None else out.index_copy_(0, idx, source[idx])
    # A padded row writes what the first row writes (with no row sent, ``out[0]`` itself), so
    # every write to one place writes the same value: deterministic, and no host read.
    first = idx[:1]
    index = torch.where(idx == PAD, first.clamp_min(0), idx)
    written = (idx != PAD).logical_or_(first != PAD)
    value = torch.zeros_like(out[index]) if source is None else source[index]
    return out.index_put_((index,), torch.where(written, value, out[index]))


def synchronize(like: torch.Tensor) -> None:
    if like.is_cuda:
        torch.cuda.synchronize(like.device)


def momentum_step(x: torch.Tensor, velocity: Optional[torch.Tensor], accumulated: Optional[torch.Tensor],
                  momentum: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if velocity is None or accumulated is None:
        velocity, accumulated = torch.zeros_like(x), torch.zeros_like(x)
    # Restored from a checkpoint loaded elsewhere (map_location="cpu"): to the gradient's device.
    velocity, accumulated = velocity.to(x.device), accumulated.to(x.device)
    x.sub_(accumulated)
    velocity.mul_(momentum).add_(x)
    accumulated.add_(velocity)
    return x.copy_(accumulated), velocity, accumulated


def kth_magnitude(values: torch.Tensor, k: int) -> Union[float, torch.Tensor]:
    kth = torch.topk(values.abs(), k, sorted=False).values.min()
    if on_accelerator(values):  # not read on the host: pick and the statistics take the tensor
        return kth.to(torch.float32).clamp_min(SMALLEST_THRESHOLD)
    return as_float32(float(kth))


def candidate_bar(scanned: BlockScan, budget: int) -> Union[float, torch.Tensor]:
    if not on_accelerator(scanned.maxima):
        return controllers.candidate_bar(scanned.maxima_numpy(), budget)
    maxima = scanned.maxima.float()
    if maxima.numel() <= budget:
        return SMALLEST_THRESHOLD
    return torch.kthvalue(maxima, maxima.numel() - budget + 1).values.clamp_min(SMALLEST_THRESHOLD)


def local_histogram(window: controllers.HistogramWindow, magnitudes: torch.Tensor, bar: float, rank: int,
                    parts: int) -> torch.Tensor:
    """On the host (an accelerator's rounds take :func:`histograms_above` instead)."""
    return from_numpy(controllers.local_histogram(window, to_numpy(magnitudes).astype(np.float32), float(bar),
                                                  rank, parts), magnitudes)


def band(count: Union[int, torch.Tensor], low: float, high: float, below: float,
         above: float) -> Union[float, torch.Tensor]:
    if low > high:
        raise ValueError(f"band: low ({low}) must not exceed high ({high})")
    if not isinstance(count, torch.Tensor):
        return band_factor(count, low, high, below, above)
    # A count (a whole number) is below ``low`` exactly when it is below ceil(low), above ``high``
    # when at or above floor(high) + 1: its place among those two integers (``bucketize``, exact
    # whatever its size, no cast; in order, as ``low <= high``) picks the factor, two operations
    # where two comparisons and two ``where`` took four.
    bounds = constant((math.ceil(low), math.floor(high) + 1), count.dtype, count.device)
    factors = constant((below, 1.0, above), torch.float64, count.device)
    return factors.take(torch.bucketize(count, bounds, right=True))


def lowered_thresholds(threshold: Union[float, torch.Tensor], factor: float,
                       times: int) -> Union[List[float], torch.Tensor]:
    if not isinstance(threshold, torch.Tensor):
        return threshold_baselines.lowered_thresholds(threshold, factor, times)
    powers = constant(threshold_baselines.powers(factor, times), torch.float64, threshold.device)
    # The float64 powers give the product their dtype: the float32 threshold is widened (exactly)
    # inside the multiplication, no cast of its own.
    return (threshold * powers).float().clamp_min(SMALLEST_THRESHOLD)


def counts_at(scanned: BlockScan, thresholds: torch.Tensor) -> torch.Tensor:
    """One pass (two on a CUDA device under ``torch.use_deterministic_algorithms``, whose
    ``histc`` has no deterministic kernel: :func:`counts_at_each` there): each magnitude's place
    among the ascending thresholds (``bucketize``), a histogram of the places with those below
    every threshold left out (most magnitudes, so nearly none is added), and the counts summed
    from the highest threshold down. Counted in float32 below 2**24 magnitudes (exact there),
    else in float64."""
    magnitudes = scanned.magnitudes
    if magnitudes.is_cuda and torch.are_deterministic_algorithms_enabled():
        return counts_at_each(magnitudes, thresholds)
    # Compared in the magnitudes' precision, as ``magnitudes >= threshold`` does.
    places = torch.bucketize(magnitudes, thresholds.flip(0).to(magnitudes.dtype), right=True, out_int32=True)
    levels = thresholds.numel()
    reached = torch.histc(places.to(_count_dtype(magnitudes)), bins=levels, min=0.5, max=levels + 0.5)
    return reached.flip(0).cumsum(0)


def counts_at_each(magnitudes: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """:func:`counts_at` of ``|x|`` (``magnitudes``) in a pass per threshold, the same counts in
    the same dtype: the plain twin the tests hold it equal to."""
    counts = [(magnitudes >= threshold).sum() for threshold in thresholds.unbind()]
    return torch.stack(counts).to(_count_dtype(magnitudes))


def _count_dtype(magnitudes: torch.Tensor) -> torch.dtype:
    """A float dtype that counts up to ``magnitudes.numel()`` exactly."""
    return torch.float32 if magnitudes.numel() < 2 ** 24 else torch.float64


def first_settled(thresholds: Union[Sequence[float], torch.Tensor], counts: Union[Sequence[int], torch.Tensor],
                  low: float, high: float, checks: int) -> Tuple[Union[float, torch.Tensor], Union[bool, torch.Tensor]]:
    if not isinstance(counts, torch.Tensor):
        return threshold_baselines.first_settled(thresholds, counts, low, high, checks)
    # Every threshold was counted (:func:`counts_at`). The thresholds never rise, so the counts
    # never fall: the first settled threshold is the one after every checked count below ``low``
    # (``checks`` of them when none settles: the last threshold, never cut). The cut is kept where
    # its count exceeds ``high``, read among the checked counts: where none settles, their last,
    # below ``low`` and so not above ``high`` (ceil(low) <= floor(high) + 1). Seven operations on
    # the device (a view among them), where a cumulative search and a test of ``first < checks``
    # took ten. The counts (whole numbers, float32 below 2**24) are compared with ceil(low) and
    # floor(high): a fractional bound rounded to float32 could land on a count (from 2**23 on) and
    # decide it otherwise than the host.
    if checks == 0:  # nothing checked: the only threshold, never cut
        return thresholds[0], constant(False, torch.bool, counts.device)
    checked = counts[:checks]
    first = (checked < math.ceil(low)).sum()
    # Taken, not indexed: a 0-dim index is read on the host.
    return thresholds.take(first), checked.take(first.clamp_max(checks - 1)) > math.floor(high)


def top_k_capped(x: torch.Tensor, capped: Capped, k: int, cut: Union[bool, torch.Tensor]) -> Capped:
    idx = capped.idx
    if cut is False:  # not cut, decided on the host (on an accelerator ``cut`` is a tensor)
        return capped
    if not capped.padded:
        chosen = idx[top_k(x[idx], k)]  # idx is ascending: ties to the lower index
        return Capped(chosen, chosen.numel(), capped.overflow, padded=False)
    capacity = idx.numel()
    if k >= capacity:
        return capped
    # The top-k of the payload's rows (a padded row's +0.0 is below any selected magnitude), in
    # no order (the exchange needs none: a sort fewer), padded again, taken where ``cut`` says so:
    # no host read.
    rows = torch.where(idx != PAD, x[idx.clamp_min(0)], constant(0.0, x.dtype, x.device))
    chosen = idx[top_k(rows, k, ascending=False)]
    chosen = torch.nn.functional.pad(chosen, (0, capacity - k), value=PAD)  # one operation, not a fill and a cat
    return Capped(torch.where(cut, chosen, idx), torch.where(cut, capped.sent.clamp(max=k), capped.sent),
                  capped.overflow, padded=True)


def as_threshold(value: Union[float, torch.Tensor]) -> Union[float, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value.float().clamp_min(SMALLEST_THRESHOLD)
    return as_float32(value)


def index_dtype(numel: int) -> torch.dtype:
    """int32 for buffers below 2**31 elements, int64 beyond."""
    return torch.int32 if numel < 2 ** 31 else torch.int64


def finite_flag(*tensors: torch.Tensor) -> torch.Tensor:
    """Whether every element of every one of ``tensors`` (on one device) is finite, as a 0-dim
    bool tensor on that device: :func:`all_finite` without its host read, for accelerators (an
    exact pass per tensor is cheap there; a host read stalls the queue). One tensor or more.
    The largest magnitude (``vector_norm`` of order inf: a max, which a NaN anywhere makes NaN and
    which overflows nowhere) is below +inf exactly when every element is finite: one reduction per
    tensor, reading it once and writing nothing of its size, and a comparison; ``t.mul(0).sum()``
    took three operations and a temporary of the tensor's size, ``isfinite(t).all()`` five. An
    empty tensor (which has no largest magnitude) is finite. On CUDA the order-inf norm is the
    reduction kernel of ``sum`` and ``amax`` (``gpu_reduce_kernel``, NaN propagating); a CPU runs it
    as a scalar loop, many times slower than ``amax``, which only the accelerators' paths forced on CPU
    tensors (:func:`~horovod_sparse.torch_core.selection.accelerator_paths`) pay."""
    largest = [torch.linalg.vector_norm(t, math.inf) for t in tensors if t.numel()]
    if not largest:
        return constant(True, torch.bool, tensors[0].device)
    return (largest[0] if len(largest) == 1 else torch.stack(largest).amax()).lt(math.inf)


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of every one of ``tensors`` (on the CPU: the host's check; an
    accelerator's is :func:`finite_flag`) is finite. A NaN or Inf anywhere makes a sum
    non-finite, so one summing pass and its read settle the usual case (two operations a tensor;
    ``torch.isfinite(t).all()`` costs about 20 times more on a CPU: it writes a bool tensor of the
    full size); only a non-finite sum, which finite values near the dtype's maximum can also
    produce, takes the exact check."""
    return all(math.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32))
               or bool(torch.isfinite(t).all()) for t in tensors)
