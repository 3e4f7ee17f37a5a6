"""Threshold selection over a slice of a flat buffer (TensorFlow), with the block maxima the
histogram controller reads.

The counterpart of :mod:`horovod_sparse.torch.selection`, with the same results:
:func:`scan` gives the largest ``|x|`` of each block of ``block`` elements of ``x[start:end]``
(the last block partial), :func:`pick` exactly ``{i in [start, end) : |x[i]| >= threshold}`` in
ascending order (int64). Here :func:`pick` compares the slice directly: the PyTorch side's
block-skipping is a CPU memory-traffic optimisation that does not change the result. So is its
:func:`horovod_sparse.torch.selection.top_k`: :func:`top_k` here finds the same set, under the
same tie rule, from the ``k``-th largest ``|x|`` over the whole buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np
import tensorflow as tf

from horovod_sparse.common.controllers import candidate_bar


@dataclass(frozen=True)
class BlockScan:
    """Block maxima of ``x[start:end]``: ``maxima[b]`` is the largest ``|x|`` of block ``b``."""

    x: tf.Tensor
    start: int
    end: int
    block: int
    maxima: tf.Tensor

    def maxima_numpy(self) -> np.ndarray:
        """The block maxima as a float32 NumPy array (for histograms)."""
        return self.maxima.numpy().astype(np.float32)


def scan(x: tf.Tensor, start: int, end: int, block: int) -> BlockScan:
    """The largest ``|x|`` of each block of ``block`` elements of ``x[start:end]``."""
    part = tf.abs(x[start:end])
    full = (end - start) // block
    maxima = tf.reduce_max(tf.reshape(part[:full * block], [full, block]), axis=1)
    if (end - start) % block:
        maxima = tf.concat([maxima, tf.reshape(tf.reduce_max(part[full * block:]), [1])], 0)
    return BlockScan(x, start, end, block, maxima)


def pick(scanned: BlockScan, threshold: float) -> tf.Tensor:
    """Indices into ``x`` (int64, ascending) of ``|x| >= threshold`` within the scanned slice."""
    return select(scanned.x[scanned.start:scanned.end], threshold) + scanned.start


def select(x: tf.Tensor, threshold: Union[float, tf.Tensor]) -> tf.Tensor:
    """Indices (int64, ascending) of ``|x| >= threshold`` over the whole buffer ``x`` (traceable)."""
    magnitude = tf.abs(x)
    return tf.where(magnitude >= tf.cast(threshold, magnitude.dtype))[:, 0]


@dataclass(frozen=True)
class Candidates:
    """Every coordinate of a scanned slice at or above ``bar``, the ``budget``-th largest block
    maximum (:func:`horovod_sparse.common.controllers.candidate_bar`): ``indices`` into ``x``
    (ascending) and their ``magnitudes``; any threshold at or above the bar is then a filter of
    the candidates. As :class:`horovod_sparse.torch.selection.Candidates`."""

    scanned: BlockScan
    bar: float
    indices: tf.Tensor
    magnitudes: tf.Tensor

    @classmethod
    def collect(cls, scanned: BlockScan, budget: int) -> "Candidates":
        bar = candidate_bar(scanned.maxima_numpy(), budget)
        indices = pick(scanned, bar)
        return cls(scanned, bar, indices, tf.abs(tf.gather(scanned.x, indices)))

    def magnitudes_numpy(self) -> np.ndarray:
        """The magnitudes as a float32 NumPy array (for histograms)."""
        return self.magnitudes.numpy().astype(np.float32)

    def select(self, threshold: float) -> tf.Tensor:
        """Exactly ``pick(scanned, threshold)``: a filter of the candidates when ``threshold`` is
        at or above the bar, a new pick otherwise."""
        if threshold >= self.bar:
            return tf.boolean_mask(self.indices, self.magnitudes >= tf.cast(threshold, self.magnitudes.dtype))
        return pick(self.scanned, threshold)


def top_k(x: tf.Tensor, k: Union[int, tf.Tensor]) -> tf.Tensor:
    """Indices (int64, ascending) of the ``k`` largest ``|x|`` of ``tf.reshape(x, [-1])``.

    Tie rule, as :func:`horovod_sparse.torch.selection.top_k`: among equal magnitudes the lower
    index wins, so the result is the first ``k`` indices in the order of ``(-|x[i]|, i)``.
    ``k <= 0`` gives nothing, ``k >= numel`` every index; ``x`` must hold no NaN. When exactly
    ``k`` coordinates reach the ``k``-th largest ``|x|``, ``tf.math.top_k``'s set is the answer;
    otherwise (ties at the ``k``-th value) it is every coordinate above that value, then the
    first of those equal to it, whatever order ``tf.math.top_k`` gives ties. Traceable, with
    ``k`` a Python int or a scalar tensor.
    """
    magnitude = tf.abs(tf.reshape(x, [-1]))
    k = tf.clip_by_value(tf.cast(k, tf.int32), 0, tf.size(magnitude))
    values, indices = tf.math.top_k(magnitude, k, sorted=False)
    kth = tf.reduce_min(values)  # +inf when k = 0

    def ties_to_the_lower_index() -> tf.Tensor:
        above = magnitude > kth
        tied = tf.cast(magnitude == kth, tf.int32)
        room = k - tf.reduce_sum(tf.cast(above, tf.int32))
        return tf.where(above | ((tied > 0) & (tf.cumsum(tied) <= room)))[:, 0]

    unambiguous = tf.equal(tf.reduce_sum(tf.cast(magnitude >= kth, tf.int32)), k)
    return tf.cond(unambiguous, lambda: tf.sort(tf.cast(indices, tf.int64)), ties_to_the_lower_index)
