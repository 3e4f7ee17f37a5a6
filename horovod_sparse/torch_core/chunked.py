"""PyTorch's primitives of chunked selection and quantized values
(:class:`horovod_sparse.methods.backend.Backend`: ``top_k_chunks``, ``moments``, ``level_codes``,
``bin_means``, ``dequantize``, ``pack_codes``, ``unpack_codes``, ``pack_offsets``,
``unpack_offsets``, ``float32``), for SparseLoCo (:mod:`horovod_sparse.methods.sparseloco`).
Nothing here reads a value on the host: on a device every shape follows from the arguments' shapes
and Python ints.

The quantizer's sums (``moments``, ``bin_means``) are taken in float64 and rounded once to
float32: a reduction for the moments (``torch.sum`` for the mean, a float64
``torch.linalg.vector_norm`` for the deviation), an ``index_add_`` into a float64 buffer per level
for the means. A float64 sum of ``m`` values is within about ``m * 2**-53`` (relative) of
the exact one whatever the order of its additions, so the float32 result is the exact sum's
rounding, and the same on every device and in TensorFlow, except where the float64 sum lies that
close to a float32 rounding boundary (each rank's table still travels with its codes, so every
rank dequantizes alike either way). Added one after the other in float32, the sum of ~16 M
values drifts by percents.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Tuple

import numpy as np

import torch

from horovod_sparse.common.thresholds import SCAN_CHUNK
from horovod_sparse.torch_core.constants import constant, held, kept, made_once, steps
from horovod_sparse.torch_core.selection import on_accelerator, scan
from horovod_sparse.torch_core.top_k import device_top_k, has_keys, ranked_keys, ranked_keys_into

#: Elements of the blocks of :func:`_host_top_k_rows_by_blocks`, the host's selection of rows
#: that keep few coordinates: a row of 4096 has 64 maxima to rank, and keeping ``k`` it keys
#: ``64 k`` candidates (a power of two, so the blocks are the scan's).
SUB_BLOCK = 64
#: From this many elements of full rows on (16 rows of 4096) :func:`_host_top_k_rows_by_blocks`
#: is taken; below, the block scan's fixed cost (a few small operations) outweighs what it saves.
SUB_BLOCKS_FROM = 65_536

__all__ = ["bin_means", "dequantize", "float32", "level_codes", "moments", "pack_codes", "pack_offsets",
           "top_k_chunks", "unpack_codes", "unpack_offsets"]


def top_k_chunks(x: torch.Tensor, chunk: int, k: int, k_last: int) -> torch.Tensor:
    flat = x if x.dim() == 1 else x.reshape(-1)  # a flat buffer's reshape is an operation too
    full = flat.numel() // chunk
    if on_accelerator(flat) and (chosen := _top_k_padded_rows(flat, chunk, k, k_last)) is not None:
        return chosen
    parts = []
    if full and k:
        parts.append(top_k_rows(flat[:full * chunk].reshape(full, chunk), k))
    tail = flat[full * chunk:]
    if k_last:  # the last, shorter chunk: one topk of its keys as well, on any device
        chosen = torch.arange(tail.numel(), device=x.device) if k_last >= tail.numel() else device_top_k(tail, k_last)
        parts.append(chosen + full * chunk)
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=x.device)


def _top_k_padded_rows(flat: torch.Tensor, chunk: int, k: int, k_last: int) -> Optional[torch.Tensor]:
    """:func:`top_k_chunks` of a buffer that ends in a shorter chunk, on the accelerators' paths,
    as one ``torch.topk`` of :func:`~horovod_sparse.torch_core.top_k.ranked_keys` along rows: the
    magnitudes padded with zeros to whole chunks (a pad's key is below every real coordinate's
    of its row: the least magnitude at the highest positions), each row's ``k`` largest, the
    largest first; the last row's places past its ``k_last`` are moved past every position, so
    that the sort of each row's indices puts them last, where the cut leaves them: 14 operations
    for the call as the tests count them, where a pass over the full chunks and one over the last
    took 21, for one more pass over the buffer (the padded copy of its magnitudes: 8 bytes an
    element, about 17 us for a 25 MB bucket at 3 TB/s, against the host time of seven launches).
    None without keys (float64), and where the buffer holds no full chunk (the last one's own
    pass is shorter), ends in no shorter one, or every chunk keeps all it holds (the other paths
    take those)."""
    if not (flat.numel() > chunk and 0 < k_last <= k < chunk):
        return None
    rows = flat.numel() // chunk + 1
    magnitudes = torch.nn.functional.pad(flat.abs(), (0, rows * chunk - flat.numel())).view(rows, chunk)
    keys = ranked_keys(magnitudes)
    if keys is None:
        return None
    chosen = torch.topk(keys, k, dim=1).indices
    dropped = made_once(("chunk tail", rows, k, k_last, flat.device),
                        lambda: torch.arange(rows * k, device=flat.device).view(rows, k) >= (rows - 1) * k + k_last)
    chosen = torch.where(dropped, constant(chunk, torch.int64, flat.device), chosen).sort(dim=1).values
    return chosen.add_(_row_starts(rows, chunk, flat.device)).view(-1)[:(rows - 1) * k + k_last]


def top_k_rows(values: torch.Tensor, k: int, by_blocks: bool = True) -> torch.Tensor:
    """The flat indices of each row's ``k`` largest ``|values|`` (``k > 0``; every index when
    ``k`` reaches a row's length), ties to the lower index, ascending: one ``torch.topk`` of
    :func:`~horovod_sparse.torch_core.top_k.ranked_keys` along the rows where there are keys (on
    the host :func:`_host_top_k_rows`, or :func:`_host_top_k_rows_by_blocks` where it applies,
    unless ``by_blocks`` is False: the benchmark's comparison); else each row's k-th largest
    magnitude, all above it and the first of those equal to it. Exactly ``k`` a row either way,
    so a fixed-size result."""
    full, chunk = values.shape
    if k >= chunk:
        return torch.arange(full * chunk, device=values.device)
    if by_blocks and not on_accelerator(values) and (chosen := _host_top_k_rows_by_blocks(values, k)) is not None:
        return chosen
    if on_accelerator(values) or (chosen := _host_top_k_rows(values, k)) is None:
        rows = values.abs()
        keys = ranked_keys(rows)
        if keys is None:
            return _top_k_rows_by_level(rows, k)
        chosen = torch.topk(keys, k, dim=1, sorted=False).indices
    return chosen.sort(dim=1).values.add_(_row_starts(full, chunk, values.device)).reshape(-1)


def _row_starts(rows: int, chunk: int, device: torch.device) -> torch.Tensor:
    """The flat starts of ``rows`` rows of ``chunk`` elements, a column (int64), made once per
    shape where short (:func:`~horovod_sparse.torch_core.constants.kept`): an ``unsqueeze`` of
    the kept starts would be an operation at each call."""
    return kept(("row starts", rows, chunk, device), rows,
                lambda: torch.arange(0, rows * chunk, chunk, dtype=torch.int64, device=device).unsqueeze(1))


def _host_top_k_rows_by_blocks(values: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """:func:`top_k_rows` on the host where each row keeps few coordinates, by its blocks of
    :data:`SUB_BLOCK`: one block scan (:func:`~horovod_sparse.torch_core.selection.scan`), each
    row's ``k`` blocks of the largest maxima (ties to the lower block), and the top-k of those
    ``k`` blocks' coordinates, read in the order of the row. Exact: a coordinate of a row's top-k
    lies in one of those blocks (a block ranked above its own holds, at its maximum, a coordinate
    that wins against it: larger, or as large and at a lower index; ``k`` such blocks would put
    it out of the top-k). Where a row keeps at most an eighth of its blocks' count, this reads
    the buffer once and keys ``k`` blocks a row, not the whole row (``python -m
    benchmarks.costs.selection_cost`` times both). None elsewhere: rows not of whole blocks,
    keeping more, fewer than :data:`SUB_BLOCKS_FROM` elements, or without keys (float64)."""
    full, chunk = values.shape
    blocks = chunk // SUB_BLOCK
    if chunk % SUB_BLOCK or k * 8 > blocks or full * chunk < SUB_BLOCKS_FROM or not has_keys(values.dtype):
        return None
    flat = values.reshape(-1)
    maxima = scan(flat, 0, flat.numel(), SUB_BLOCK).maxima.view(full, blocks)
    ranked = torch.topk(ranked_keys(maxima), k, dim=1, sorted=False).indices.sort(dim=1).values
    ranked += steps(0, full * blocks, blocks, torch.int64, values.device).unsqueeze(1)
    candidates = flat.view(-1, SUB_BLOCK).index_select(0, ranked.view(-1)).abs_().view(full, k * SUB_BLOCK)
    places = torch.topk(ranked_keys(candidates), k, dim=1, sorted=False).indices
    positions = ranked.gather(1, places // SUB_BLOCK).mul_(SUB_BLOCK).add_(places % SUB_BLOCK)
    return positions.sort(dim=1).values.view(-1)


def _top_k_rows_by_level(rows: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_k_rows` of the magnitudes ``rows`` without keys (float64): each row's k-th
    largest, all above it and the first of those equal to it."""
    full, _ = rows.shape
    kth = torch.topk(rows, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    above, tied = rows > kth, rows == kth
    keep = above | (tied & (tied.cumsum(dim=1) <= k - above.sum(dim=1, keepdim=True)))
    return torch.nonzero_static(keep.reshape(-1), size=full * k).reshape(-1)


def _host_top_k_rows(values: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """Each row's ``k`` largest keys' positions (unordered) on the host, :data:`SCAN_CHUNK`
    elements of rows at a time: their keys (:func:`~horovod_sparse.torch_core.top_k.ranked_keys_into`)
    go into one small int64 buffer reused for every slab, where keys of the whole buffer would be
    a fresh allocation of twice its size at each call (on a CPU, a large fresh buffer costs the
    page faults of its memory first). None where there are no keys."""
    full, chunk = values.shape
    per = max(1, SCAN_CHUNK // chunk)
    buffer = torch.empty(min(per, full), chunk, dtype=torch.int64, device=values.device)
    found = []
    for first in range(0, full, per):
        keys = ranked_keys_into(values[first:first + per], buffer[:min(per, full - first)])
        if keys is None:
            return None
        found.append(torch.topk(keys, k, dim=1, sorted=False).indices)
    return torch.cat(found)


def _sum(values: torch.Tensor) -> torch.Tensor:
    """The 1-element float64 sum of ``values`` (converted to float64), by one reduction (see the
    module docstring)."""
    return torch.sum(values, dim=0, keepdim=True, dtype=torch.float64)


def moments(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = values.numel()
    mean = (_sum(values) / m).float()
    centred = values - mean
    if m <= 1:
        return mean, values.new_zeros(1), centred
    # The norm squares, sums and roots in float64 in one operation (a float32 square is exact there).
    norm = torch.linalg.vector_norm(centred, dim=0, keepdim=True, dtype=torch.float64)
    return mean, (norm / math.sqrt(m - 1)).float(), centred


def level_codes(centred: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    # The scale is a positive spread times a deviation, so +0, +inf or NaN where not usable: usable
    # exactly where it is above 0 once +inf and NaN read as 0 (two operations where isfinite and != 0
    # took six). ``addcdiv`` adds the quotient as it is: ``half + centred / scale`` in one operation.
    usable = scale.nan_to_num(posinf=0.0) > 0
    scale = torch.where(usable, scale, constant(1.0, scale.dtype, scale.device))
    half = constant(float(levels // 2), centred.dtype, centred.device)
    # int64 codes: they index the tables and the levels' sums as they are (uint8 took a cast each).
    return torch.addcdiv(half, centred, scale).round_().clamp_(0, levels - 1).long()


def bin_means(values: torch.Tensor, codes: torch.Tensor, levels: int) -> torch.Tensor:
    index, wide = codes.long(), values.double()
    sums = wide.new_zeros(levels).index_add_(0, index, wide)
    counts = wide.new_zeros(levels).index_add_(0, index, torch.ones_like(wide))  # bincount reads a max on a GPU
    return (sums / counts.clamp_min(1)).float()  # an empty code's sum is +0: its mean +0 / 1


def dequantize(codes: torch.Tensor, tables: torch.Tensor, count: int) -> torch.Tensor:
    # Codes lie below the levels, so a row's whole table is gathered from (no slice of its levels).
    if codes.numel() == count:  # one row: its table taken from as it lies (no reshapes)
        flat = tables if tables.dim() == 1 else tables.view(-1)
        return flat.take(codes.long()) + flat[-1:]
    codes = codes.reshape(-1, count).long()
    tables = tables.reshape(codes.shape[0], -1)
    return (tables.gather(1, codes) + tables[:, -1:]).reshape(-1)


def _shifts(bits: int, like: torch.Tensor) -> torch.Tensor:
    return steps(0, 8, bits, torch.int32, like.device)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    # The codes padded with zero codes to whole bytes in one operation (none where they fill them);
    # shifted (a code shifted stays below 256), a byte's codes sum to its value, summed as bytes.
    per = 8 // bits
    nbytes = -(-codes.numel() // per)
    return (_padded(codes, nbytes * per).view(nbytes, per) << _shifts(bits, codes)).sum(1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per = 8 // bits
    nbytes = -(-count // per)
    codes = (packed.reshape(-1, nbytes, 1).long() >> _shifts(bits, packed)) & (2 ** bits - 1)
    if nbytes * per == count:  # no padding codes to cut
        return codes.view(-1)
    return codes.reshape(-1, nbytes * per)[:, :count].reshape(-1)


def float32(t: torch.Tensor) -> torch.Tensor:
    return t.float()


class Pieces(NamedTuple):
    """How each row of a period of packed offsets (:class:`OffsetWindows`) is made of pieces of
    its sources: a row per value made, a column per piece (int64 tables). A piece is the
    ``source``-th value (an offset of the period, or a byte), shifted ``right`` to drop its bits
    below the piece, cut by ``mask`` (0 in an unused column) and shifted ``left`` into place. A
    row's pieces lie in bits of their own, so they sum to its value."""

    source: np.ndarray
    right: np.ndarray
    mask: np.ndarray
    left: np.ndarray

    def placed(self, sources: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows made from the int64 ``sources``, a period along the last dimension: one gather
        of every piece, shifted and cut in place, summed in ``dtype`` (a row's value fits it)."""
        source, right, mask, left = (held(table, torch.int64, sources.device) for table in self)
        taken = sources[..., source]
        return taken.bitwise_right_shift_(right).bitwise_and_(mask).bitwise_left_shift_(left).sum(-1, dtype=dtype)


class OffsetWindows(NamedTuple):
    """One period of a stream of packed ``width``-bit offsets: ``lcm(width, 8)`` bits, ``bytes``
    bytes holding exactly ``offsets`` offsets, and the :class:`Pieces` that ``pack`` a period's
    bytes from its offsets and ``unpack`` its offsets from its bytes."""

    bytes: int
    offsets: int
    pack: Pieces
    unpack: Pieces


@functools.lru_cache(maxsize=None)
def offset_windows(width: int) -> OffsetWindows:
    """The :class:`OffsetWindows` of ``width``-bit offsets (little-endian: bit ``b`` of offset
    ``j`` is bit ``(j * width + b) % 8`` of byte ``(j * width + b) // 8``), made once per width."""
    period = math.lcm(width, 8)

    def pieces(size: int, other: int) -> Pieces:
        # Row i is bits [i * size, (i + 1) * size) of the period, made of the sources of ``other``
        # bits each that overlap them, the first source (i * size) // other.
        rows = np.arange(period // size)
        first = rows * size // other
        columns = int((((rows + 1) * size - 1) // other - first).max()) + 1
        source = first[:, None] + np.arange(columns)
        start = source * other - rows[:, None] * size  # the source's bit 0, within the row
        used = start < size  # else the column's source starts past the row (or the period: 0 stands in)
        left = np.maximum(start, 0)
        return Pieces(np.where(used, source, 0), np.maximum(-start, 0),
                      np.where(used, ((1 << size) - 1) >> left, 0), left)

    return OffsetWindows(period // 8, period // width, pieces(8, width), pieces(width, 8))


def pack_offsets(idx: torch.Tensor, chunk: int, width: int) -> torch.Tensor:
    # A period's bytes from its offsets (:func:`offset_windows`), and back in unpack_offsets: a
    # tensor of every offset's bits (12 elements for an offset of 12 bits) took 1.3 to 9 times as
    # long from 100,000 offsets on (python -m benchmarks.costs.sparseloco_wire; docs/benchmarks.md).
    windows = offset_windows(width)
    count = idx.numel()
    periods = -(-count // windows.offsets)
    offsets = _padded(idx % chunk, periods * windows.offsets).view(periods, windows.offsets)
    packed = windows.pack.placed(offsets, torch.uint8).view(-1)
    nbytes = -(-count * width // 8)
    return packed if packed.numel() == nbytes else packed[:nbytes]


def unpack_offsets(packed: torch.Tensor, chunk: int, k: int, width: int, count: int) -> torch.Tensor:
    windows = offset_windows(width)
    nbytes = -(-count * width // 8)
    periods = -(-count // windows.offsets)
    rows = packed.reshape(-1, nbytes)
    periodic = _padded(rows, periods * windows.bytes).view(rows.shape[0], periods, windows.bytes)
    offsets = windows.unpack.placed(periodic.long(), torch.int64).view(rows.shape[0], -1)
    # Offset j lies in chunk j // k (k per full chunk, in chunk order, then the last's k_last <= k).
    starts = kept(("chunk starts", count, k, chunk, packed.device), count,
                  lambda: steps(0, count, 1, torch.int64, packed.device).div(k, rounding_mode="floor").mul_(chunk))
    return ((offsets if offsets.shape[1] == count else offsets[:, :count]) + starts).view(-1)


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` padded with zeros along its last dimension to ``length`` (itself where it is that long)."""
    extra = length - t.shape[-1]
    return torch.nn.functional.pad(t, (0, extra)) if extra else t
