"""The exact top-k of every method that needs the ``k`` largest ``|x|`` (Top-k, gTop-k, LAGS,
DGC's final pick, SparseLoCo's chunks), with one tie rule that
:func:`horovod_sparse.tensorflow.selection.top_k` follows too: among equal magnitudes the lower
index wins.

Two paths give the same set. The block scan (:func:`scanned_top_k`, on a CPU buffer of
:data:`DEVICE_TOP_K_BELOW` elements or more) costs a scan of
:mod:`horovod_sparse.torch_core.selection`, one pick of about ``k`` candidates and a top-k of those,
instead of ``torch.topk`` over the whole buffer (about 80 times a read pass at 25.6M elements,
k = 25,600, on one CPU thread), and reads a few values on the host. The device path
(:func:`device_top_k`, on a GPU and on smaller CPU buffers) is one ``torch.topk`` of int64 keys that
hold the tie rule (:func:`ranked_keys`), whole-buffer passes that read nothing on the host.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from horovod_sparse.common.thresholds import LEVEL_MARGIN, LEVEL_SAMPLE, SCAN_CHUNK, scan_block_size
from horovod_sparse.torch_core.constants import steps
from horovod_sparse.torch_core.selection import host_count, on_accelerator, pick_with_magnitudes, scan


#: Below this many elements a CPU buffer's :func:`top_k` takes :func:`device_top_k` too: its
#: whole-buffer passes cost less there than the block scan's fixed cost, several small operations
#: and host reads (0.2-0.7x of its time up to 32,768 elements, 0.8-1.0x at 49,152, mostly 1-4x from
#: 65,792 on, where its int64 keys outgrow the caches: ``python -m benchmarks.costs.top_k_paths``).
DEVICE_TOP_K_BELOW = 49_152


def top_k(x: torch.Tensor, k: int, ascending: bool = True) -> torch.Tensor:
    """Indices (int64, ascending) of the ``k`` largest ``|x|`` of ``x.reshape(-1)``; with
    ``ascending=False`` the same set in an order left unspecified (a sort fewer on an accelerator).

    Tie rule: among equal magnitudes the lower index wins, so the result is the first ``k``
    indices in the order of ``(-|x[i]|, i)``, on every rank and device and in both frameworks.
    It is the set ``torch.topk(x.abs(), k)`` returns whenever that set is unambiguous
    (``torch.topk`` promises no order among ties). ``k <= 0`` gives nothing, ``k >= numel``
    every index. ``x`` must hold no NaN. On a GPU, and on a CPU below :data:`DEVICE_TOP_K_BELOW`
    elements, by :func:`device_top_k` (no host read); on a larger CPU buffer by
    :func:`scanned_top_k`.
    """
    flat = x if x.dim() == 1 else x.reshape(-1)  # a flat buffer's reshape is an operation too
    numel = flat.numel()
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if k >= numel:
        return torch.arange(numel, device=x.device)
    if on_accelerator(flat) or numel < DEVICE_TOP_K_BELOW:
        return device_top_k(flat, k, ascending)
    return scanned_top_k(flat, k)


def scanned_top_k(flat: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_k` of the flat ``flat`` (``0 < k < numel``) by one block scan, ascending (a
    non-contiguous ``flat`` is copied once).

    How (exact for any input): one block scan, and a level at or below the ``k``-th largest
    block maximum (:func:`candidate_level`): at least ``k`` coordinates reach it (one in each
    of ``k`` blocks), and the at most ``2k`` blocks whose maximum exceeds it hold every
    coordinate above it. If ``k`` or more are above the level, the answer is their top-k under
    the tie rule; otherwise it is all of them and the lowest-index coordinates equal to the
    level (:func:`first_at`: in the order of the buffer, up to the last one needed). Blocks are
    of :func:`horovod_sparse.methods.micro.controllers.scan_block_size` elements, fewer when the buffer
    holds less than ``k`` such blocks. Nothing of the buffer's size is allocated for a
    contiguous ``flat``: the block maxima and a copy of at most ``2k`` candidate blocks.
    """
    numel = flat.numel()
    flat = flat.contiguous()
    scanned = scan(flat, 0, numel, min(scan_block_size(k / numel), numel // k))
    level = candidate_level(scanned.maxima, k)
    indices, magnitudes = pick_with_magnitudes(scanned, level, strict=True)
    if indices.numel() >= k:
        return indices[top_k_positions(magnitudes, k)]
    return torch.cat([indices, first_at(flat, level, k - indices.numel())]).sort().values


#: The signed integer type of each float type's width: the bits of a magnitude (sign bit clear),
#: read as this type, order as the magnitudes do (+0 lowest, +inf highest).
_MAGNITUDE_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
#: What a magnitude's bits are scaled by in a selection key, above the 31 bits of its index.
_INDEX_BITS = 31
_INDEX_SPAN = 2 ** _INDEX_BITS


def has_keys(dtype: torch.dtype) -> bool:
    """Whether :func:`ranked_keys` keys magnitudes of ``dtype`` (float32, float16, bfloat16)."""
    return dtype in _MAGNITUDE_BITS


def ranked_keys(magnitudes: torch.Tensor) -> Optional[torch.Tensor]:
    """int64 keys that order the coordinates of ``magnitudes``' last dimension (``|x|``, float32,
    float16 or bfloat16) as the tie rule does: a magnitude's bits times 2**31 plus
    ``2**31 - 1 - i`` for position ``i``, so every key of a row is distinct and among equal
    magnitudes the lower position has the larger key; the ``k`` largest keys of a row are its
    top-k, ties to the lower index (on the accelerators' paths two operations, one ``torch.topk``;
    the positions are made once per row length up to
    :data:`~horovod_sparse.torch_core.constants.KEPT_RANGE`, a third operation beyond). None for
    float64, whose bits leave no room for a position, and for rows of more than 2**31 elements.

    On the host the bits are widened first and the positions or-ed below them (the same keys: the
    bits are not negative, the positions below 2**31): a CPU's add of int32 bits to int64 positions
    casts element by element, and the three operations take 0.56-0.71 of its time from 65,536
    elements on (``python -m benchmarks.costs.top_k_paths --keys``)."""
    bits = _MAGNITUDE_BITS.get(magnitudes.dtype)
    width = magnitudes.shape[-1]
    if bits is None or width > _INDEX_SPAN:
        return None
    positions = steps(_INDEX_SPAN - 1, _INDEX_SPAN - 1 - width, -1, torch.int64, magnitudes.device)
    if on_accelerator(magnitudes):
        return torch.add(positions, magnitudes.view(bits), alpha=_INDEX_SPAN)
    return magnitudes.view(bits).long().bitwise_left_shift_(_INDEX_BITS).bitwise_or_(positions)


def ranked_keys_into(values: torch.Tensor, out: torch.Tensor) -> Optional[torch.Tensor]:
    """:func:`ranked_keys` of ``values.abs()`` on the host, written into ``out`` (int64, of
    ``values``' shape) and formed from the signed ``values`` themselves: a magnitude's bits are the
    value's with the sign bit cleared, so no ``|x|`` is made. None where :func:`ranked_keys` gives
    none."""
    bits = _MAGNITUDE_BITS.get(values.dtype)
    width = values.shape[-1]
    if bits is None or width > _INDEX_SPAN:
        return None
    positions = steps(_INDEX_SPAN - 1, _INDEX_SPAN - 1 - width, -1, torch.int64, values.device)
    sign_clear = torch.iinfo(bits).max
    return out.copy_(values.view(bits)).bitwise_and_(sign_clear).bitwise_left_shift_(_INDEX_BITS).bitwise_or_(positions)


def device_top_k(flat: torch.Tensor, k: int, ascending: bool = True) -> torch.Tensor:
    """:func:`top_k` of the flat ``flat`` (``0 < k < numel``) in whole-buffer passes that read
    nothing on the host, for accelerators (on a GPU each host read stalls the queue; passes over
    the buffer are cheap; on a CPU too below :data:`DEVICE_TOP_K_BELOW` elements and for
    SparseLoCo's last chunk), ascending unless ``ascending`` is False. The same set as
    :func:`scanned_top_k`, tie rule included: one ``torch.topk`` of :func:`ranked_keys` where there
    are keys (six operations whatever the data, five unordered), else :func:`_top_k_by_level`
    (ascending)."""
    magnitudes = flat.abs()
    keys = ranked_keys(magnitudes)
    if keys is None:
        return _top_k_by_level(magnitudes, k)
    chosen = torch.topk(keys, k, sorted=False).indices
    return chosen.sort().values if ascending else chosen


def _top_k_by_level(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`device_top_k` of the flat ``magnitudes`` without :func:`ranked_keys`: the ``k``-th
    largest from ``torch.topk``, every coordinate above it, and the lowest-index coordinates
    equal to it, up to ``k`` in all, ascending, out of ``torch.nonzero_static``, whose size,
    ``k``, is known."""
    kth = torch.topk(magnitudes, k, sorted=False).values.min()
    above = magnitudes > kth
    tied = magnitudes == kth
    room = k - above.sum()
    keep = above.logical_or_(tied.logical_and_(tied.cumsum(0) <= room))
    return torch.nonzero_static(keep, size=k).squeeze(1)


def candidate_level(maxima: torch.Tensor, k: int) -> float:
    """A value that at least ``k`` of the block ``maxima`` reach and at most ``2k`` exceed
    (``k <= maxima.numel()``): the estimate from a strided sample of the maxima (about
    :data:`LEVEL_SAMPLE` of those it looks for, aiming :data:`LEVEL_MARGIN` above ``k``) when
    it passes both counts, else exactly the ``k``-th largest maximum."""
    stride = max(1, k // LEVEL_SAMPLE)
    sample = maxima[::stride]
    level = kth_largest(sample, min(sample.numel(), math.ceil(LEVEL_MARGIN * k / stride)))
    if host_count(maxima >= level) >= k and host_count(maxima > level) <= 2 * k:
        return level
    return kth_largest(maxima, k)


def kth_largest(values: torch.Tensor, k: int) -> float:
    """The ``k``-th largest of the 1-D ``values`` (``1 <= k <= values.numel()``), exactly."""
    return float(torch.kthvalue(values, values.numel() - k + 1).values)


def top_k_positions(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (ascending) of the ``k`` largest of the 1-D ``magnitudes`` (``k <= numel``),
    ties to the lower position: all those above the ``k``-th largest value, then the first of
    those equal to it."""
    if magnitudes.numel() == k:
        return torch.arange(k, device=magnitudes.device)
    kth = kth_largest(magnitudes, k)
    keep = magnitudes > kth
    tied = torch.nonzero(magnitudes == kth).squeeze(1)
    keep[tied[:k - host_count(keep)]] = True
    return torch.nonzero(keep).squeeze(1)


def first_at(x: torch.Tensor, level: float, count: int) -> torch.Tensor:
    """The ``count`` lowest indices of ``|x| == level`` in the flat ``x`` (which holds at least
    that many), read in chunks of :data:`SCAN_CHUNK` up to the last one needed."""
    found = []
    for first in range(0, x.numel(), SCAN_CHUNK):
        hits = torch.nonzero(x[first:first + SCAN_CHUNK].abs() == level).squeeze(1)[:count] + first
        found.append(hits)
        count -= hits.numel()
        if count == 0:
            break
    return torch.cat(found)
