"""Threshold selection over a slice of a flat buffer (TensorFlow), with the block maxima the
histogram controller reads.

The counterpart of :mod:`horovod_sparse.torch_core.selection`, with the same results:
:func:`scan` gives the largest ``|x|`` of each block of ``block`` elements of ``x[start:end]``
(the last block partial), :func:`pick` exactly ``{i in [start, end) : |x[i]| >= threshold}`` in
ascending order (int64). Here :func:`pick` compares the slice directly: the PyTorch side's
block-skipping is a CPU memory-traffic optimisation that does not change the result.
:func:`top_k` finds the same set as :func:`horovod_sparse.torch_core.top_k.top_k`, under the same
tie rule and by the same method (block maxima, a candidate level, the top-k of the blocks that
reach it), at a few read passes of the buffer instead of ``tf.math.top_k``'s dozens.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from horovod_sparse.common.thresholds import mean_std
from horovod_sparse.common.thresholds import LEVEL_MARGIN, LEVEL_SAMPLE, SCAN_CHUNK


@dataclass(frozen=True)
class BlockScan:
    """Block maxima of ``x[start:end]``: ``maxima[b]`` is the largest ``|x|`` of block ``b``;
    ``moments`` as :class:`horovod_sparse.torch_core.selection.BlockScan`'s."""

    x: tf.Tensor
    start: int
    end: int
    block: int
    maxima: tf.Tensor
    moments: Optional[Tuple[float, float]] = None

    def maxima_numpy(self) -> np.ndarray:
        """The block maxima as a float32 NumPy array (for histograms)."""
        return self.maxima.numpy().astype(np.float32)

    def mean_std(self) -> Tuple[float, float]:
        """Mean and unbiased standard deviation of the slice
        (:func:`horovod_sparse.common.threshold_baselines.mean_std`)."""
        assert self.moments is not None, "scan(..., moments=True) computes them"
        return mean_std(*self.moments, self.end - self.start)


def scan(x: tf.Tensor, start: int, end: int, block: int, moments: bool = False) -> BlockScan:
    """The largest ``|x|`` of each block of ``block`` elements of ``x[start:end]``, and with
    ``moments`` the sums of ``x`` and ``x^2`` over the slice (single-precision sums, double for
    float64; eager mode)."""
    values = x[start:end]
    part = tf.abs(values)
    full = (end - start) // block
    maxima = tf.reduce_max(tf.reshape(part[:full * block], [full, block]), axis=1)
    if (end - start) % block:
        maxima = tf.concat([maxima, tf.reshape(tf.reduce_max(part[full * block:]), [1])], 0)
    sums = None
    if moments:
        accumulate = tf.float64 if x.dtype == tf.float64 else tf.float32
        values = tf.cast(values, accumulate)
        sums = (float(tf.reduce_sum(values)), float(tf.reduce_sum(tf.square(values))))
    return BlockScan(x, start, end, block, maxima, sums)


def pick(scanned: BlockScan, threshold: float) -> tf.Tensor:
    """Indices into ``x`` (int64, ascending) of ``|x| >= threshold`` within the scanned slice."""
    return select(scanned.x[scanned.start:scanned.end], threshold) + scanned.start


def select(x: tf.Tensor, threshold: Union[float, tf.Tensor]) -> tf.Tensor:
    """Indices (int64, ascending) of ``|x| >= threshold`` over the whole buffer ``x`` (traceable)."""
    magnitude = tf.abs(x)
    return tf.where(magnitude >= tf.cast(threshold, magnitude.dtype))[:, 0]


def pick_with_magnitudes(scanned: BlockScan, threshold: float) -> Tuple[tf.Tensor, tf.Tensor]:
    """:func:`pick` and the ``|x|`` of what it picked."""
    indices = pick(scanned, threshold)
    return indices, tf.abs(tf.gather(scanned.x, indices))


def top_k(x: tf.Tensor, k: Union[int, tf.Tensor], ascending: bool = True) -> tf.Tensor:
    """Indices (int64, ascending) of the ``k`` largest ``|x|`` of ``tf.reshape(x, [-1])``
    (``ascending`` is the PyTorch side's: here they are ascending either way).

    Tie rule, as :func:`horovod_sparse.torch_core.top_k.top_k`: among equal magnitudes the lower
    index wins, so the result is the first ``k`` indices in the order of ``(-|x[i]|, i)``.
    ``k <= 0`` gives nothing, ``k >= numel`` every index; ``x`` must hold no NaN. Traceable
    (``tf.cond``, no Python branch on values), with ``k`` a Python int or a scalar tensor.

    How (exact for any input), when ``2k <= numel``, as the PyTorch side: the buffer is cut into
    ``numel // B`` full blocks of ``B = min(scan_block_size(k / numel), numel // k)`` elements
    (:func:`_block_length`; a view, no copy) and a partial tail of ``numel % B``. One read pass
    gives each full block's largest ``|x|`` (:func:`_block_maxima`, a chunk at a time). The
    ``level`` is a value that at least ``k`` block maxima reach and at most ``2k`` exceed
    (:func:`_candidate_level`: an estimate from a strided sample of the maxima, else the exact
    ``k``-th largest maximum). At least ``k`` coordinates reach the level (one in each of ``k``
    blocks) and every coordinate of a block whose maximum is below it is below it, so the answer
    lies among the coordinates ``>= level`` of the blocks whose maximum reaches it and of the
    tail, which is always searched. Those blocks are gathered in ascending order, their
    coordinates ``>= level`` kept with their positions (global index ``block * B + offset``,
    then ``numel // B * B + offset`` in the tail, so ascending), and the answer is their top-``k``
    under the tie rule (:func:`_top_k_positions`: ``tf.math.top_k`` for the ``k``-th value, then
    ``tf.where``). Besides the result it allocates the block maxima (``numel / B`` values),
    ``|x|`` of one chunk of ``SCAN_CHUNK`` elements at a time, a copy of the gathered blocks
    and of their magnitudes (about ``k B`` to ``2k B`` elements each, more when many maxima tie
    at the level, up to the buffer's size when all do), ``|tail|``, and the values and int64
    positions of the coordinates ``>= level`` (about ``k`` for continuous data). ``k <= 0``
    gives an empty tensor and ``k >= numel`` ``tf.range(numel)``; for ``numel / 2 < k < numel``
    :func:`_top_k_positions` runs over ``|x|`` of the whole buffer (a buffer-sized copy).
    The work runs in a ``tf.function`` per dtype over a flat buffer of any length, so an eager
    call runs as one graph and costs what a traced one does.
    """
    flat = tf.reshape(x, [-1])
    return _top_k_function(flat.dtype)(flat, tf.cast(k, tf.int64))


@functools.lru_cache(maxsize=None)
def _top_k_function(dtype: tf.DType) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """:func:`_top_k_flat` as a ``tf.function`` over a flat buffer of ``dtype`` of any length
    (one per dtype): eager calls run it as one graph, traced calls nest it. Its branches and
    loop are ``tf.cond`` / ``tf.while_loop`` already, so AutoGraph is off: tracing it is
    plain Python, without AutoGraph's conversion."""
    return tf.function(_top_k_flat, input_signature=[tf.TensorSpec([None], dtype), tf.TensorSpec([], tf.int64)],
                       autograph=False)


def _top_k_flat(flat: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
    """:func:`top_k` of the 1-D ``flat``: the block path when ``1 <= k`` and ``2k <= numel``,
    else :func:`_top_k_positions` over ``|flat|``."""
    numel = tf.size(flat, out_type=tf.int64)
    k = tf.clip_by_value(k, 0, numel)

    def whole_buffer() -> tf.Tensor:
        return tf.cond(k == numel, lambda: tf.range(numel),
                       lambda: tf.cast(_top_k_positions(tf.abs(flat), tf.cast(k, tf.int32)), tf.int64))

    return tf.cond(k == 0, lambda: tf.zeros([0], tf.int64),
                   lambda: tf.cond(2 * k <= numel, lambda: _top_k_of_blocks(flat, numel, k), whole_buffer))


def _block_length(numel: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
    """``min(scan_block_size(k / numel), numel // k)`` as an int64 tensor (``1 <= k <= numel``):
    a power of two near ``numel / (16 k)`` in [32, 512], at most ``numel // k``."""
    ratio = tf.cast(numel, tf.float64) / (16.0 * tf.cast(k, tf.float64))
    exponent = tf.clip_by_value(tf.round(tf.math.log(ratio) / np.log(2.0)), 5.0, 9.0)
    return tf.minimum(tf.cast(tf.pow(tf.constant(2.0, tf.float64), exponent), tf.int64), numel // k)


def _top_k_of_blocks(flat: tf.Tensor, numel: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
    """:func:`top_k` of the 1-D ``flat`` through its block maxima (``1 <= k``, ``2k <= numel``),
    as described there."""
    block = _block_length(numel, k)
    full = numel // block
    blocks = tf.reshape(tf.slice(flat, tf.zeros([1], tf.int64), tf.reshape(full * block, [1])),
                        tf.stack([full, block]))  # a view: no copy
    tail = tf.abs(flat[full * block:])
    maxima = _block_maxima(blocks)
    level = _candidate_level(maxima, k)
    chosen = tf.where(maxima >= level)[:, 0]  # ascending, at least k blocks
    magnitudes = tf.reshape(tf.abs(tf.gather(blocks, chosen)), [-1])
    in_blocks = tf.where(magnitudes >= level)[:, 0]  # positions in the gathered blocks
    in_tail = tf.where(tail >= level)[:, 0]
    gathered = tf.size(magnitudes, out_type=tf.int64)
    reach = tf.concat([in_blocks, gathered + in_tail], 0)  # at least k, ascending
    values = tf.concat([tf.gather(magnitudes, in_blocks), tf.gather(tail, in_tail)], 0)
    picked = tf.gather(reach, _top_k_positions(values, tf.cast(k, tf.int32)))
    row = tf.minimum(picked // block, tf.size(chosen, out_type=tf.int64) - 1)
    in_a_block = tf.gather(chosen, row) * block + picked % block
    return tf.where(picked < gathered, in_a_block, full * block + (picked - gathered))


def _block_maxima(blocks: tf.Tensor) -> tf.Tensor:
    """``reduce_max(|blocks|, axis=1)`` of the 2-D ``blocks`` (at least one row), a chunk of
    about ``SCAN_CHUNK`` elements at a time, so that ``|x|`` of a chunk is read back from
    the cache and nothing of the buffer's size is allocated."""
    rows = tf.maximum(tf.constant(SCAN_CHUNK, tf.int64) // tf.shape(blocks, out_type=tf.int64)[1], 1)
    chunks = tf.cast((tf.shape(blocks, out_type=tf.int64)[0] + rows - 1) // rows, tf.int32)

    def body(chunk, found):
        first = tf.cast(chunk, tf.int64) * rows
        return chunk + 1, found.write(chunk, tf.reduce_max(tf.abs(blocks[first:first + rows]), axis=1))

    found = tf.TensorArray(blocks.dtype, size=chunks, infer_shape=False, element_shape=[None])
    _, found = tf.while_loop(lambda chunk, _: chunk < chunks, body, [tf.constant(0), found])
    return found.concat()


def _kth_largest(values: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
    """The ``k``-th largest of the 1-D ``values`` (``1 <= k <= size``), exactly."""
    return tf.reduce_min(tf.math.top_k(values, tf.cast(k, tf.int32), sorted=False).values)


def _candidate_level(maxima: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
    """A value that at least ``k`` of the block ``maxima`` reach and at most ``2k`` exceed
    (``k <= size``), as :func:`horovod_sparse.torch_core.top_k.candidate_level`: the estimate
    from every ``max(1, k // LEVEL_SAMPLE)``-th maximum, aiming :data:`LEVEL_MARGIN` above
    ``k``, when ``k`` to ``2k`` maxima reach it; the ``k``-th largest maximum otherwise (of
    those that reach the estimate when more than ``2k`` do, of all when fewer than ``k``)."""
    stride = tf.maximum(tf.constant(1, tf.int64), k // LEVEL_SAMPLE)
    sample = maxima[::stride]
    wanted = tf.cast(tf.math.ceil(LEVEL_MARGIN * tf.cast(k, tf.float64) / tf.cast(stride, tf.float64)), tf.int64)
    estimate = _kth_largest(sample, tf.minimum(tf.size(sample, out_type=tf.int64), wanted))
    reach = maxima >= estimate
    count = tf.reduce_sum(tf.cast(reach, tf.int64))
    return tf.cond(count < k, lambda: _kth_largest(maxima, k),
                   lambda: tf.cond(count > 2 * k, lambda: _kth_largest(tf.boolean_mask(maxima, reach), k),
                                   lambda: estimate))


def _top_k_positions(magnitudes: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
    """Positions (int64, ascending) of the ``k`` largest of the 1-D ``magnitudes``
    (``0 <= k <= size``, int32), ties to the lower position. When exactly ``k`` values reach
    the ``k``-th largest, ``tf.math.top_k``'s set is the answer; otherwise (ties at the ``k``-th
    value) it is every position above that value, then the first of those equal to it, whatever
    order ``tf.math.top_k`` gives ties."""
    kth = tf.reduce_min(tf.math.top_k(magnitudes, k, sorted=False).values)

    def ties_to_the_lower_position() -> tf.Tensor:
        above = magnitudes > kth
        tied = tf.cast(magnitudes == kth, tf.int32)
        room = k - tf.reduce_sum(tf.cast(above, tf.int32))
        return tf.where(above | ((tied > 0) & (tf.cumsum(tied) <= room)))[:, 0]

    reach = magnitudes >= kth
    unambiguous = tf.equal(tf.reduce_sum(tf.cast(reach, tf.int32)), k)
    return tf.cond(unambiguous, lambda: tf.where(reach)[:, 0], ties_to_the_lower_position)
