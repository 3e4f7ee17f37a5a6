"""SparseLoCo's selection (arXiv 2508.15706; the authors' reference optimizer is CCLoco): top-k
within fixed-size chunks of ``g+e``, the selected values quantized to ``2**bits`` levels by
CCLoco's statistical quantizer, with error feedback (the quantization error stays in the
residual)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from horovod_sparse.common.options import SparsifierOptions, target_count
from horovod_sparse.common.registry import implements
from horovod_sparse.common.validation import check_int, check_positive_float
from horovod_sparse.methods.backend import Backend, Tensor
from horovod_sparse.methods.base import Exchange, Sparsifier, Step
from horovod_sparse.methods.comm import Comm
from horovod_sparse.methods.sparseloco_blocks import BlockLayout, block_layout

#: The code widths a byte holds a whole number of (``8 // bits`` codes per byte).
BITS = (1, 2, 4, 8)


def chunk_counts(density: float, numel: int, chunk_size: int) -> Tuple[int, int, int, int]:
    """How a group of ``numel`` elements is cut: ``(full, k, last, k_last)``: ``full`` chunks of
    ``chunk_size`` keep ``k`` each, and a shorter last chunk of ``last`` elements (0: none) keeps
    ``k_last``; a chunk of ``L`` elements keeps ``min(L, max(1, int(density * L)))``."""
    full, last = divmod(numel, chunk_size)
    return (full, min(chunk_size, target_count(density, chunk_size)), last,
            min(last, target_count(density, last)) if last else 0)


def offset_width(chunk_size: int) -> int:
    """Bits of an index's offset inside its chunk on the wire: ``max(1, ceil(log2(chunk_size)))``
    (12 for chunks of 4096; a shorter last chunk's offsets fit too)."""
    return max(1, (chunk_size - 1).bit_length())


@dataclass(frozen=True)
class SparseLoCoOptions(SparsifierOptions):
    """Options of SparseLoCo's selection. The defaults are the paper's: 64 of every 4096
    coordinates (``density = 1/64``), 2-bit values over 6 standard deviations.

    Attributes:
        chunk_size: the chunk length: each chunk of ``chunk_size`` consecutive elements of a
            group's flat buffer (the last one may be shorter) keeps its own top
            ``max(1, int(density * L))``.
        bits: the width of a quantized value's code (1, 2, 4 or 8: ``2**bits`` levels, ``8 // bits``
            codes per byte on the wire); None sends the values unquantized (as they are, or float16
            with ``fp16_values``).
        quantization_range: the quantizer's range in standard deviations of the selected values
            (the levels are ``quantization_range * std / 2**bits`` apart).
        error_decay: ``beta`` of error feedback with decay, ``e <- beta * e + g`` (the paper's and
            Templar's 0.95): after every delivered step each group's residual is multiplied by it
            (:attr:`~horovod_sparse.methods.base.Sparsifier.residual_decay`), so what was not sent
            fades; 1 (the default) keeps everything: nothing is lost. In ``(0, 1]``; the PyTorch
            front ends apply it.
        blocks: cut each parameter of two or more dimensions into 2-D blocks of ``sqrt(chunk_size)``
            squared elements (64 x 64 at 4096: Templar's layout;
            :mod:`~horovod_sparse.methods.sparseloco_blocks`) and each 1-D one into runs of
            ``chunk_size``, instead of cutting the group's flat buffer into runs (False, the
            default). Needs the group's parameters whole: the PyTorch front ends' groups
            (Horovod's optimizer, the DDP hook, outer steps); refused in two tiers (a node's
            slice), on FSDP2's shards and in TensorFlow. ``chunk_size`` a square.
    """

    density: float = 1 / 64
    chunk_size: int = 4096
    bits: Optional[int] = 2
    quantization_range: float = 6.0
    error_decay: float = 1.0
    blocks: bool = False

    def _validate(self) -> None:
        object.__setattr__(self, "chunk_size", check_int("chunk_size", self.chunk_size, minimum=1))
        if self.bits is not None and (type(self.bits) is not int or self.bits not in BITS):  # not True, not 2.0
            raise ValueError(f"bits must be one of {', '.join(map(str, BITS))} (codes that fill a byte), or None "
                             f"to send the values unquantized; got {self.bits!r}; for example bits=2")
        object.__setattr__(self, "quantization_range",
                           check_positive_float("quantization_range", self.quantization_range))
        decay = self.error_decay
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0.0 < float(decay) <= 1.0:
            raise ValueError(f"error_decay must be a number in (0, 1] (the factor each residual keeps after a "
                             f"step; 1 keeps everything), got {decay!r}; for example error_decay=0.95")
        object.__setattr__(self, "error_decay", float(decay))
        if not isinstance(self.blocks, bool):
            raise TypeError(f"blocks must be True or False, got {self.blocks!r}")
        if self.blocks and math.isqrt(self.chunk_size) ** 2 != self.chunk_size:
            raise ValueError(f"blocks=True cuts blocks of sqrt(chunk_size) x sqrt(chunk_size) elements: chunk_size "
                             f"must be a square, got {self.chunk_size}; for example chunk_size=4096 (64 x 64)")
        if self.density_schedule is not None:
            raise ValueError("sparseloco keeps a fixed count per chunk (every rank knows every rank's count "
                             f"from the group's size): density_schedule={self.density_schedule!r} is not "
                             "supported; give density_schedule=None")

    def count(self, numel: int, step: Optional[int] = None) -> int:
        """The sum over the group's chunks of what each keeps (:func:`chunk_counts`); with
        ``blocks`` the count depends on the shapes too: the exchange records its own
        (:attr:`BlockLayout.count`) as the group's target."""
        full, k, last, k_last = chunk_counts(self.density, numel, self.chunk_size)
        return full * k + k_last


def quantize(B: Backend, values: Tensor, bits: int, spread: float) -> Tuple[Tensor, Tensor]:
    """CCLoco's statistical quantizer of ``m`` float32 ``values``: ``(codes, table)``.

    ``shift = mean(v)``, ``c = v - shift``, ``std = ||c|| / sqrt(m - 1)`` (0 for ``m <= 1``),
    ``scale = spread * std / 2**bits`` (1 where that is 0 or not finite), ``code = clamp(round(c /
    scale + 2**bits // 2), 0, 2**bits - 1)``; the ``table`` holds the mean of ``c`` over each code's
    values (0 for an empty one), then ``shift``: ``2**bits + 1`` float32 values. A value is
    delivered as ``table[code] + shift`` (:meth:`~horovod_sparse.methods.backend.Backend.dequantize`).
    """
    bins = 2 ** bits
    shift, std, centred = B.moments(values)
    codes = B.level_codes(centred, std * np.float32(spread) / np.float32(bins), bins)
    return codes, B.concat([B.bin_means(centred, codes, bins), shift])


@implements("sparseloco", SparseLoCoOptions,
            "top-k within fixed chunks (64 of 4096), values quantized to 2**bits levels; allgather, fixed count")
class SparseLoCo(Sparsifier):
    """SparseLoCo's selection: each chunk of ``chunk_size`` consecutive elements of ``x = g + e``
    keeps its ``max(1, int(density * L))`` largest ``|x|`` (ties to the lower index:
    :meth:`~horovod_sparse.methods.backend.Backend.top_k_chunks`), so every rank's count is known
    from the group's size (:meth:`SparseLoCoOptions.count`): no count is exchanged and nothing is
    read on the host.

    With ``bits``, each rank quantizes its ``m`` selected values (:func:`quantize`, in float32: a
    float16 or bfloat16 group's values are cast to float32 first, and the residual subtracts the
    dequantized values rounded to the group's dtype, so that rounding stays in the residual too)
    and allgathers its indices as offsets inside their chunks, :func:`offset_width` bits each
    (:meth:`~horovod_sparse.methods.backend.Backend.pack_offsets`: ``ceil(m * w / 8)`` bytes, the
    ``indices`` bytes; every rank knows each offset's chunk from its position), its codes packed
    ``8 // bits`` to a byte (:meth:`~horovod_sparse.methods.backend.Backend.pack_codes`: ``ceil(m *
    bits / 8)`` bytes, the ``values`` bytes) and its table (``2**bits + 1`` float32, the ``meta``
    bytes). Every rank unpacks every rank's indices and dequantizes its values with that rank's
    table, scatter-adds them in rank order and scales by ``comm.scale``. The residual is ``x`` minus
    the dequantized values at the selected indices: the quantization error is kept, nothing is
    lost. With ``bits=None`` the values travel as Top-k's do, unquantized, with int32 global
    indices (int64 from 2**31 elements). Traceable.

    With ``blocks`` the chunks are the blocks of :func:`~horovod_sparse.methods.sparseloco_blocks.block_layout`
    (from ``comm.shapes``): ``x`` gathered into block order, each run of equal blocks a chunked
    top-k, an offset inside its block on the wire, placed by every rank from its position (the
    blocks' starts) and the block order; the group's count recorded as its target.
    """

    options: SparseLoCoOptions

    def __init__(self, options: SparseLoCoOptions, backend: Backend) -> None:
        super().__init__(options, backend)
        #: Each group's blocks as the backend's tensors: ``(order, starts of n ranks, layout)``,
        #: by its shapes, its device and ``n``.
        self._blocks: Dict[Tuple[Any, ...], Tuple[Tensor, Tensor, BlockLayout]] = {}

    @property
    def residual_decay(self) -> float:
        """:attr:`SparseLoCoOptions.error_decay`."""
        return self.options.error_decay

    @property
    def needs_shapes(self) -> bool:
        """:attr:`SparseLoCoOptions.blocks`."""
        return self.options.blocks

    def exchange(self, x: Tensor, comm: Comm, state: Any, step: Step) -> Exchange:
        B, options = self.B, self.options
        numel = B.numel(x)
        if options.blocks:
            order, starts, layout = self._layout(comm.shapes, x, comm.size)
            m = layout.count
            comm.stats.target = m
            with comm.timer("select"):
                blocked = B.gather(x, order)
                at = B.concat([B.top_k_chunks(blocked[start:end], length, keep, 0) + start
                               for start, end, length, keep in layout.runs])
                idx = B.gather(order, at)
            chunk, k, width = layout.largest, m, offset_width(layout.largest)
            offsets = at - starts[:m]  # inside their blocks
        else:
            full, k, last, k_last = chunk_counts(options.density, numel, options.chunk_size)
            m = full * k + k_last
            with comm.timer("select"):
                idx = B.top_k_chunks(x, options.chunk_size, k, k_last)
            chunk, width, offsets = options.chunk_size, offset_width(options.chunk_size), idx
        if options.bits is None:
            return (yield from self.allgather_exchange(x, idx, comm, fixed_count=m))
        with comm.timer("quantize"):
            codes, table = quantize(B, B.float32(B.gather(x, idx)), options.bits, options.quantization_range)
            delivered = B.dequantize(codes, table, m)
            packed = B.pack_codes(codes, options.bits)
            offsets = B.pack_offsets(offsets, chunk, width)
        n = comm.size
        pendings: List[Any] = [
            comm.allgather(packed, "codes", "values", rows=[B.numel(packed)] * n),
            comm.allgather(table, "tables", "meta", rows=[B.numel(table)] * n),
            comm.allgather(offsets, "indices", "indices", rows=[B.numel(offsets)] * n)]
        comm.stats.selected = m
        residual = comm.remove_delivered(x, idx, delivered)
        packed, tables, offsets = yield pendings
        with comm.timer("apply"):
            values = B.dequantize(B.unpack_codes(packed, options.bits, m), tables, m)
            indices = B.unpack_offsets(offsets, chunk, k, width, m)  # with blocks: offsets (k = m)
            if options.blocks:
                indices = B.gather(order, indices + starts)
            update = B.scatter_chunks(comm.output(x), indices, values, B.chunk_counts(m, n, fixed=True), comm.scale)
            self.note_union(comm, indices, numel)
        return update, residual

    def _layout(self, shapes: Optional[Sequence[Sequence[int]]], x: Tensor, n: int
                ) -> Tuple[Tensor, Tensor, BlockLayout]:
        """The group's :class:`BlockLayout` (made once per shapes, device and ``n``) with its
        ``order`` and its ``starts`` repeated for ``n`` ranks as tensors like ``x``'s."""
        if shapes is None:
            raise ValueError("sparseloco's blocks=True cuts whole parameters into 2-D blocks and needs their shapes: "
                             "the Horovod PyTorch optimizer, the DDP hook and outer steps exchange whole parameters; "
                             "two tiers (a node's slice), FSDP2 (shards) and TensorFlow do not: give blocks=False")
        key = (tuple(tuple(s) for s in shapes), str(getattr(x, "device", "")), n)
        if key not in self._blocks:
            layout = block_layout(shapes, self.options.chunk_size, self.options.density)
            if layout.order.size != self.B.numel(x):
                raise ValueError(f"the group's shapes {list(key[0])} hold {layout.order.size} elements, its buffer "
                                 f"{self.B.numel(x)}")
            self._blocks[key] = (self.B.as_index(self.B.from_numpy(layout.order, x)),
                                 self.B.as_index(self.B.from_numpy(np.tile(layout.starts, n), x)), layout)
        return self._blocks[key]
