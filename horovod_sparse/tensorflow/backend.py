"""TensorFlow's backend: the primitives of :class:`horovod_sparse.methods.backend.Backend`.

Tensors are immutable here, so every primitive returns a new tensor. Those the traceable methods
use take tensors for counts and steps as well as Python numbers, so a method runs both eagerly
and inside ``tf.function``.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from horovod_sparse.tensorflow.collectives import (allgather_array, allgather_bytes, allgather_payload,  # noqa: F401
                                                   index_dtype)  # (backend API)
from horovod_sparse.methods.backend import Capped, cut
from horovod_sparse.methods.micro import controllers
from horovod_sparse.common import threshold_baselines
from horovod_sparse.common.threshold_baselines import band_factor
from horovod_sparse.common.thresholds import as_float32
from horovod_sparse.tensorflow import selection
from horovod_sparse.tensorflow.selection import pick, pick_with_magnitudes, scan, top_k  # noqa: F401 (backend API)

name = "tensorflow"
DEFERS_STATISTICS = False

STOCK_REFUSAL = (
    "{cls} is a horovod_sparse sparsifier: it sends (values, indices) payloads and keeps an "
    "error-feedback residual per gradient, which horovod.tensorflow's DistributedGradientTape and "
    "DistributedOptimizer cannot do (they allreduce one dense tensor per gradient and would "
    "silently drop what is not sent). Use horovod_sparse.tensorflow.DistributedGradientTape(tape, "
    "compression=...) or horovod_sparse.tensorflow.keras.DistributedOptimizer(optimizer, "
    "compression=...) instead; they take the same arguments."
)

_DTYPES = {"int32": tf.int32, "int64": tf.int64, "float64": tf.float64}


def numel(x: tf.Tensor) -> int:
    return int(x.shape[0])


def size(t: tf.Tensor) -> Union[int, tf.Tensor]:
    counted = tf.size(t, out_type=tf.int64)
    return int(counted) if tf.executing_eagerly() else counted


def to_numpy(t: tf.Tensor) -> np.ndarray:
    return t.numpy()


def from_numpy(array: np.ndarray, like: Optional[tf.Tensor]) -> tf.Tensor:
    return tf.constant(array)


def saved(t: tf.Tensor) -> np.ndarray:
    return t.numpy()


def from_saved(saved: np.ndarray) -> tf.Tensor:
    return tf.constant(saved)


def outside_trace() -> ContextManager[None]:
    return tf.init_scope()


def reshape_one(n: Union[int, tf.Tensor], like: tf.Tensor) -> tf.Tensor:
    return tf.reshape(tf.cast(n, tf.int64), [1])


def chunk_counts(counts: Any, size: int, fixed: bool) -> Union[List[int], tf.Tensor]:
    """A list for a fixed Python count; else a tensor of ``size`` entries (a static length, so
    the chunks can be split when traced)."""
    if isinstance(counts, int):
        return [counts] * size
    return tf.fill([size], tf.reshape(counts, [])) if fixed else tf.reshape(counts, [size])


def host_call(decide: Callable[..., Any], args: Sequence[Any], dtype: str) -> Any:
    """Eager: ``decide`` now, on Python numbers (NumPy arrays for non-scalars), its result as
    is. Traced: ``decide`` runs through ``tf.py_function`` each time the step runs, and its
    result is a ``dtype`` tensor. So a decision is written once, in Python, for both modes."""
    if tf.executing_eagerly():
        return decide(*[_host_value(a) for a in args])

    def run(*values: tf.Tensor) -> Any:
        return decide(*[_host_value(v) for v in values])

    return tf.py_function(run, inp=list(args), Tout=_DTYPES[dtype], name="horovod_sparse_decision")


def _host_value(value: Any) -> Any:
    if isinstance(value, (tf.Tensor, tf.Variable)):
        value = value.numpy()
        return value.item() if value.ndim == 0 else value
    return value


def select(x: tf.Tensor, threshold: Union[float, tf.Tensor], block: int) -> tf.Tensor:
    """:func:`horovod_sparse.tensorflow.selection.select` (traceable; ``block`` is unused: the
    block-skipping of PyTorch's scan saves CPU memory traffic, the result is the same)."""
    return selection.select(x, threshold)


def pick_capped(scanned: selection.BlockScan, threshold: Union[float, tf.Tensor],
                capacity: Union[int, tf.Tensor]) -> Capped:
    """Never padded: the payload's length travels with it (traceable: a traced step's counts
    are tensors)."""
    idx = pick(scanned, threshold)
    found = size(idx)
    if isinstance(found, int) and isinstance(capacity, int):
        return cut(idx, found, capacity)
    capacity = tf.cast(capacity, tf.int64)
    return Capped(idx[:capacity], tf.minimum(found, capacity), tf.maximum(found - capacity, 0), padded=False)


def count_reaching(scanned: selection.BlockScan, threshold: float) -> Union[int, tf.Tensor]:
    magnitude = tf.abs(scanned.x[scanned.start:scanned.end])
    counted = tf.math.count_nonzero(magnitude >= tf.cast(threshold, magnitude.dtype), dtype=tf.int64)
    return int(counted) if tf.executing_eagerly() else counted


def first_settled(thresholds: Sequence[float], counts: Sequence[int], low: float, high: float,
                  checks: int) -> Tuple[float, bool]:
    return threshold_baselines.first_settled(thresholds, counts, low, high, checks)


def top_k_capped(x: tf.Tensor, capped: Capped, k: int, cut: bool) -> Capped:
    if not cut:
        return capped
    chosen = tf.gather(capped.idx, top_k(tf.gather(x, capped.idx), k))  # idx is ascending: ties to the lower index
    return Capped(chosen, size(chosen), capped.overflow, padded=False)


def copy_at(out: tf.Tensor, capped: Capped, source: Optional[tf.Tensor]) -> tf.Tensor:
    idx = capped.idx
    values = tf.zeros_like(tf.gather(out, idx)) if source is None else tf.gather(source, idx)
    return tf.tensor_scatter_nd_update(out, tf.expand_dims(idx, 1), values)


def band(count: int, low: float, high: float, below: float, above: float) -> float:
    return band_factor(count, low, high, below, above)


def as_threshold(value: float) -> float:
    return as_float32(value)


def delivered(x: tf.Tensor, capped: Capped) -> Tuple[tf.Tensor, tf.Tensor]:
    return capped.idx, tf.gather(x, capped.idx)


def unpadded(indices: tf.Tensor) -> tf.Tensor:
    return indices  # never padded (pick_capped)


def at_least(t: tf.Tensor, threshold: float) -> tf.Tensor:
    return t >= tf.cast(threshold, t.dtype)


def clone(t: tf.Tensor) -> tf.Tensor:
    return t  # immutable


def gather(x: tf.Tensor, idx: tf.Tensor) -> tf.Tensor:
    return tf.gather(x, idx)


def to_wire(values: tf.Tensor, fp16: bool) -> tf.Tensor:
    if fp16:
        return tf.cast(values, tf.float16)
    return tf.cast(values, tf.float32) if values.dtype == tf.bfloat16 else values


def wire_index(idx: tf.Tensor, numel: int) -> tf.Tensor:
    return tf.cast(idx, index_dtype(numel))


def as_index(t: tf.Tensor) -> tf.Tensor:
    return tf.cast(t, tf.int64)


def scatter_chunks(out: tf.Tensor, indices: tf.Tensor, values: tf.Tensor, counts: Union[Sequence[int], tf.Tensor],
                   scale: float) -> tf.Tensor:
    """One scatter-add per rank's chunk, in rank order: bitwise identical on every rank and
    device (one scatter with repeated indices adds in an unspecified order on GPUs)."""
    values = tf.cast(values, out.dtype)
    ranks = len(counts) if isinstance(counts, (list, tuple)) else int(counts.shape[0])
    for index_chunk, value_chunk in zip(tf.split(indices, counts, num=ranks), tf.split(values, counts, num=ranks)):
        out = tf.tensor_scatter_nd_add(out, tf.expand_dims(index_chunk, 1), value_chunk * scale)
    return out


def scatter_set(out: tf.Tensor, idx: tf.Tensor, values: tf.Tensor, scale: float) -> tf.Tensor:
    return tf.tensor_scatter_nd_update(out, tf.expand_dims(idx, 1), tf.cast(values, out.dtype) * scale)


def distinct(indices: tf.Tensor, numel: int, padded: bool = False) -> Union[int, tf.Tensor]:
    return size(tf.unique(indices).y)


def coalesce(idx: tf.Tensor, values: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    order = tf.argsort(idx, stable=True)
    unique, position = tf.unique(tf.gather(idx, order), out_idx=tf.int64)
    summed = tf.math.unsorted_segment_sum(tf.gather(values, order), position, tf.size(unique, out_type=tf.int64))
    return unique, summed


def isin(values: tf.Tensor, ascending: tf.Tensor) -> tf.Tensor:
    """By binary search (a -1 sentinel keeps the lookup in range when nothing is found)."""
    position = tf.searchsorted(ascending, values, side="left", out_type=tf.int64)
    padded = tf.concat([ascending, tf.constant([-1], dtype=ascending.dtype)], 0)
    return tf.equal(tf.gather(padded, position), values)


def mask(t: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
    return tf.boolean_mask(t, keep)


def both(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    return tf.logical_and(a, b)


def kept(values: tf.Tensor, keep: Optional[tf.Tensor]) -> tf.Tensor:
    return values if keep is None else tf.where(keep, values, tf.zeros_like(values))


def count_true(keep: Optional[tf.Tensor], total: Union[int, tf.Tensor]) -> Union[int, tf.Tensor]:
    if keep is None:
        return total
    counted = tf.reduce_sum(tf.cast(keep, tf.int64))
    return int(counted) if tf.executing_eagerly() else counted


def to_wire_mask(keep: Optional[tf.Tensor], like: tf.Tensor) -> tf.Tensor:
    if keep is None:
        return tf.ones(tf.shape(like)[:1], tf.uint8)
    return tf.cast(keep, tf.uint8)


def from_wire_mask(t: tf.Tensor) -> tf.Tensor:
    return tf.cast(t, tf.bool)


def concat(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    return tf.concat(list(tensors), 0)


def splits_to(size: int, target: Optional[int], tensor: tf.Tensor) -> Union[List[int], tf.Tensor]:
    """A list when the row count is static, else (traced, with a scheduled ``k``) a tensor."""
    rows = tensor.shape[0]
    if target is None:
        return [0] * size
    if rows is not None:
        return [rows if rank == target else 0 for rank in range(size)]
    return tf.one_hot(target, size, dtype=tf.int32) * tf.shape(tensor)[0]


def embed(out: tf.Tensor, lo: int, values: tf.Tensor) -> tf.Tensor:
    total, length = numel(out), numel(values)
    return tf.concat([tf.zeros([lo], out.dtype), values, tf.zeros([total - lo - length], out.dtype)], 0)


def momentum_step(x: tf.Tensor, velocity: Optional[tf.Tensor], accumulated: Optional[tf.Tensor],
                  momentum: float) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    if velocity is None or accumulated is None:
        velocity, accumulated = tf.zeros_like(x), tf.zeros_like(x)
    velocity = velocity * momentum + (x - accumulated)
    accumulated = accumulated + velocity
    return accumulated, velocity, accumulated


def synchronize(like: tf.Tensor) -> None:
    if "GPU" in like.device.upper():
        like[:1].numpy()  # a host read waits for the ops that produced ``like``


def kth_magnitude(values: tf.Tensor, k: int) -> float:
    return as_float32(float(tf.reduce_min(tf.math.top_k(tf.abs(values), k, sorted=False).values)))


lowered_thresholds = threshold_baselines.lowered_thresholds


def decides_on_device(x: tf.Tensor) -> bool:
    """Never: TensorFlow's decisions are made on the host or traced into the graph."""
    return False


def candidate_bar(scanned: selection.BlockScan, budget: int) -> float:
    return controllers.candidate_bar(scanned.maxima_numpy(), budget)


def local_histogram(window: controllers.HistogramWindow, magnitudes: tf.Tensor, bar: float, rank: int,
                    parts: int) -> tf.Tensor:
    return tf.constant(controllers.local_histogram(window, to_numpy(magnitudes).astype(np.float32), bar, rank, parts))


# -- chunked selection and quantized values (SparseLoCo; contracts in methods.backend) ----------
def top_k_chunks(x: tf.Tensor, chunk: int, k: int, k_last: int) -> tf.Tensor:
    """Traceable (static shapes): ``tf.math.top_k`` puts the lower index first among ties."""
    flat = tf.reshape(x, [-1])
    full = numel(flat) // chunk
    parts = []
    if full and k:
        if k >= chunk:
            parts.append(tf.range(full * chunk, dtype=tf.int64))
        else:
            rows = tf.abs(tf.reshape(flat[:full * chunk], [full, chunk]))
            order = tf.sort(tf.cast(tf.math.top_k(rows, k, sorted=True).indices, tf.int64), axis=1)
            parts.append(tf.reshape(order + tf.range(0, full * chunk, chunk, dtype=tf.int64)[:, None], [-1]))
    if k_last:
        parts.append(top_k(flat[full * chunk:], k_last) + full * chunk)
    # The count is static (top_k's traced result is not): the quantizer and the packing need it.
    return tf.reshape(tf.concat(parts, 0), [full * k + k_last]) if parts else tf.zeros([0], tf.int64)


def _sum(values: tf.Tensor) -> tf.Tensor:
    """The 1-element float64 sum of ``values`` (converted to float64), by one reduction (the
    float32 rounding of an exact sum but near a boundary: see :mod:`horovod_sparse.torch_core.chunked`)."""
    return tf.reshape(tf.reduce_sum(tf.cast(values, tf.float64)), [1])


def moments(values: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    m = numel(values)
    mean = tf.cast(_sum(values) / m, tf.float32)
    centred = values - mean
    if m <= 1:
        return mean, tf.zeros([1], tf.float32), centred
    wide = tf.cast(centred, tf.float64)
    return mean, tf.cast(tf.sqrt(_sum(wide * wide)) / np.sqrt(m - 1), tf.float32), centred


def level_codes(centred: tf.Tensor, scale: tf.Tensor, levels: int) -> tf.Tensor:
    scale = tf.where(tf.math.is_finite(scale) & tf.not_equal(scale, 0.0), scale, tf.ones_like(scale))
    return tf.cast(tf.clip_by_value(tf.round(centred / scale + levels // 2), 0.0, levels - 1.0), tf.uint8)


def bin_means(values: tf.Tensor, codes: tf.Tensor, levels: int) -> tf.Tensor:
    index = tf.cast(codes, tf.int32)
    sums = tf.math.unsorted_segment_sum(tf.cast(values, tf.float64), index, levels)
    counts = tf.cast(tf.math.bincount(index, minlength=levels, maxlength=levels), tf.float64)
    return tf.cast(tf.where(counts > 0, sums / tf.maximum(counts, 1.0), tf.zeros_like(sums)), tf.float32)


def dequantize(codes: tf.Tensor, tables: tf.Tensor, count: int) -> tf.Tensor:
    codes = tf.reshape(tf.cast(codes, tf.int32), [-1, count])  # rows: static or not (a traced allgather's)
    tables = tf.reshape(tables, [tf.shape(codes)[0], -1])
    return tf.reshape(tf.gather(tables[:, :-1], codes, batch_dims=1) + tables[:, -1:], [-1])


def pack_codes(codes: tf.Tensor, bits: int) -> tf.Tensor:
    per = 8 // bits
    m = numel(codes)
    nbytes = -(-m // per)
    padded = tf.reshape(tf.pad(tf.cast(codes, tf.int32), [[0, nbytes * per - m]]), [nbytes, per])
    return tf.cast(tf.reduce_sum(tf.bitwise.left_shift(padded, tf.range(0, 8, bits)), axis=1), tf.uint8)


def unpack_codes(packed: tf.Tensor, bits: int, count: int) -> tf.Tensor:
    per = 8 // bits
    nbytes = -(-count // per)
    shifted = tf.bitwise.right_shift(tf.reshape(tf.cast(packed, tf.int32), [-1, nbytes, 1]), tf.range(0, 8, bits))
    codes = tf.bitwise.bitwise_and(shifted, 2 ** bits - 1)
    return tf.cast(tf.reshape(tf.reshape(codes, [-1, nbytes * per])[:, :count], [-1]), tf.uint8)


def _offset_dtype(width: int) -> tf.DType:
    """The narrowest integer type holding ``width``-bit offsets and their shifts."""
    return tf.int32 if width < 32 else tf.int64


def pack_offsets(idx: tf.Tensor, chunk: int, width: int) -> tf.Tensor:
    """Traceable: every shape follows from ``idx``'s static length and Python ints."""
    dtype = _offset_dtype(width)
    offsets = tf.cast(tf.math.floormod(idx, chunk), dtype)
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(offsets[:, None], tf.range(width, dtype=dtype)), 1)
    stream = tf.reshape(tf.cast(bits, tf.int32), [-1])
    stream = tf.reshape(tf.pad(stream, [[0, -(numel(idx) * width) % 8]]), [-1, 8])
    return tf.cast(tf.reduce_sum(tf.bitwise.left_shift(stream, tf.range(8)), axis=1), tf.uint8)


def unpack_offsets(packed: tf.Tensor, chunk: int, k: int, width: int, count: int) -> tf.Tensor:
    dtype = _offset_dtype(width)
    nbytes = -(-count * width // 8)
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.reshape(tf.cast(packed, tf.int32), [-1, nbytes, 1]),
                                                         tf.range(8)), 1)
    bits = tf.cast(tf.reshape(tf.reshape(bits, [-1, nbytes * 8])[:, :count * width], [-1, count, width]), dtype)
    offsets = tf.reduce_sum(tf.bitwise.left_shift(bits, tf.range(width, dtype=dtype)), axis=2)
    starts = tf.range(count, dtype=tf.int64) // k * chunk  # offset j lies in chunk j // k
    return tf.reshape(tf.cast(offsets, tf.int64) + starts, [-1])


def float32(t: tf.Tensor) -> tf.Tensor:
    return tf.cast(t, tf.float32)
