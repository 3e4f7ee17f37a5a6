"""Slow reference of SparseLoCo's selection (tests only), written from its definition in
docs/methods.md with loops over chunks, values and ranks, in float32 (NumPy scalars: every
operation rounds to float32, in the order written here) but for the quantizer's sums, which are
exact (``math.fsum``) and rounded once, as the workers' float64 sums are but where such a sum
lies within its ``m * 2**-53`` of a float32 rounding boundary: the results match the workers'
bit for bit.

* chunk ``c`` of length ``L`` (``chunk_size`` consecutive elements, the last one may be shorter)
  keeps its ``min(L, max(1, int(density * L)))`` largest ``|x|``, ties to the lower index; with
  ``blocks`` (the group's parameters' ``shapes`` given) a chunk is instead a block of a parameter:
  rows ``r0 .. r0 + s`` and columns ``c0 .. c0 + s`` (``s = sqrt(chunk_size)``, cut at the edges)
  of a parameter of two or more dimensions seen as ``shape[0]`` rows, or a run of ``chunk_size``
  of a 1-D one;
* each rank's ``m`` selected values ``v``: ``shift = mean(v)``, ``c = v - shift``, ``std = ||c|| /
  sqrt(m - 1)`` (0 for ``m <= 1``), ``scale = range * std / 2**bits`` (1 when 0 or not finite),
  ``code = clamp(round(c / scale + 2**bits // 2), 0, 2**bits - 1)``, ``lookup[b]`` the mean of the
  ``c`` with code ``b`` (0 for none); delivered: ``lookup[code] + shift``;
* the update adds every rank's delivered values at its indices, times ``1/n``, rank after rank;
  each residual loses what its rank delivered.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tests.support.reference import error_feedback_steps

F = np.float32
#: The method's defaults (the paper's settings).
DEFAULTS = {"density": 1 / 64, "chunk_size": 4096, "bits": 2, "quantization_range": 6.0}


def chunk_select(x: np.ndarray, density: float, chunk_size: int) -> List[int]:
    """The selected indices of the flat ``x``, ascending."""
    chosen: List[int] = []
    for start in range(0, x.size, chunk_size):
        length = min(chunk_size, x.size - start)
        keep = min(length, max(1, int(density * length)))
        by_magnitude = sorted(range(start, start + length), key=lambda i: (-abs(float(x[i])), i))
        chosen.extend(sorted(by_magnitude[:keep]))
    return chosen


def block_select(x: np.ndarray, shapes: Sequence[Sequence[int]], density: float, chunk_size: int) -> List[int]:
    """The selected indices of the flat ``x`` holding parameters of ``shapes``, cut into blocks,
    ascending."""
    side = int(round(math.sqrt(chunk_size)))
    chosen: List[int] = []
    offset = 0
    for shape in shapes:
        numel = int(np.prod(shape))
        if len(shape) < 2:
            blocks = [range(offset + s, offset + min(s + chunk_size, numel)) for s in range(0, numel, chunk_size)]
        else:
            rows, cols = shape[0], numel // shape[0]
            blocks = [[offset + r * cols + c
                       for r in range(r0, min(r0 + side, rows)) for c in range(c0, min(c0 + side, cols))]
                      for r0 in range(0, rows, side) for c0 in range(0, cols, side)]
        for block in blocks:
            keep = min(len(block), max(1, int(density * len(block))))
            chosen.extend(sorted(block, key=lambda i: (-abs(float(x[i])), i))[:keep])
        offset += numel
    return sorted(chosen)


def quantize(values: Sequence[np.float32], bits: int, spread: float) -> Tuple[List[int], List[np.float32]]:
    """``(codes, table)``: the table holds the ``2**bits`` level values and then the shift."""
    m, bins = len(values), 2 ** bits
    shift = F(math.fsum(values) / m)
    centred = [F(v - shift) for v in values]
    # float(c) * float(c) is exact (24-bit significands); the root and the division in float64.
    std = F(math.sqrt(math.fsum(float(c) * float(c) for c in centred)) / math.sqrt(m - 1)) if m > 1 else F(0)
    scale = F(F(std * F(spread)) / F(bins))
    if scale == 0 or not np.isfinite(scale):
        scale = F(1)
    codes = [int(min(max(np.round(F(F(c / scale) + F(bins // 2))), 0), bins - 1)) for c in centred]
    table = []
    for level in range(bins):
        members = [c for c, code in zip(centred, codes) if code == level]
        table.append(F(math.fsum(members) / len(members)) if members else F(0))
    return codes, table + [shift]


def delivered(x: np.ndarray, options: Dict, shapes: Optional[Sequence[Sequence[int]]] = None
              ) -> Tuple[List[int], List[np.float32]]:
    """What one rank delivers from its buffer ``x`` (holding parameters of ``shapes``, read with
    ``blocks``): its indices and the values it sends."""
    o = {**DEFAULTS, **options}
    idx = (block_select(x, shapes, o["density"], o["chunk_size"]) if o.get("blocks")
           else chunk_select(x, o["density"], o["chunk_size"]))
    values = [F(x[i]) for i in idx]
    if o["bits"] is None:
        return idx, values
    codes, table = quantize(values, o["bits"], o["quantization_range"])
    return idx, [F(table[code] + table[-1]) for code in codes]


def sparseloco_step(xs: List[np.ndarray], step: int, options: Dict, scale: np.float32,
                    shapes: Optional[Sequence[Sequence[int]]] = None) -> np.ndarray:
    """One exchange on the ranks' float32 buffers ``xs = e + g`` (each changed in place into its
    residual, multiplied by ``error_decay`` when the options give one: ``e <- beta * e + g`` at the
    next step; ``shapes``: the parameters the buffers hold, for ``blocks``); returns the update."""
    out = np.zeros_like(xs[0])
    decay = F(options.get("error_decay", 1.0))
    for x in xs:
        idx, values = delivered(x, options, shapes)
        for i, v in zip(idx, values):
            out[i] = F(out[i] + F(scale * v))
            x[i] = F(x[i] - v)
        if decay != 1:
            for i in range(x.size):
                x[i] = F(x[i] * decay)
    return out


def packed_size(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` bits, ``8 // bits`` to a byte."""
    return -(-count * bits // 8)


def offset_width(chunk_size: int) -> int:
    """The fewest bits (at least 1) that hold every offset below ``chunk_size``."""
    width = 1
    while 2 ** width < chunk_size:
        width += 1
    return width


def packed_offsets(indices: Sequence[int], chunk_size: int, width: int) -> List[int]:
    """The bytes of ``indices`` sent as their offsets inside their chunks (``i % chunk_size``),
    ``width`` bits each, little-endian: the bit string of each offset, lowest bit first, one
    after the other, cut into bytes of 8 (the first bit the lowest), the last one padded with 0."""
    stream = "".join(str((i % chunk_size) >> b & 1) for i in indices for b in range(width))
    stream += "0" * (-len(stream) % 8)
    return [int(stream[start:start + 8][::-1], 2) for start in range(0, len(stream), 8)]


def sparseloco_method(grads: Sequence[Sequence[np.ndarray]],
                      options: Dict) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """Error feedback over the steps of one group (``grads[t][r]``: rank r's flat gradient at step
    t): (the update of each step, each rank's final residual)."""
    return error_feedback_steps(grads, np.float32, True,
                                lambda xs, step, scale: sparseloco_step(xs, step, options, scale))
