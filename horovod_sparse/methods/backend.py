"""The backend protocol: the tensor primitives every method is written against.

A method (:mod:`horovod_sparse.methods`) never imports a framework. It receives a backend, one
module per front end (:mod:`horovod_sparse.torch.backend`, :mod:`horovod_sparse.tensorflow.backend`,
:mod:`horovod_sparse.distributed.backend`) that provides the functions below, and a communicator for the collectives
(:class:`horovod_sparse.methods.comm.Comm`).

Contracts shared by every primitive:
    * tensors are 1-D unless said otherwise; index tensors hold int64 unless said otherwise;
    * a primitive whose first argument is named ``out`` (or ``x`` for the residual updates) may
      write into it and return it (PyTorch does, to avoid a buffer-sized allocation per step) or
      return a new tensor (TensorFlow): the caller uses the returned tensor and never the
      argument again;
    * the results are the same in both frameworks up to float rounding, and bitwise identical
      on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Protocol, Sequence, Tuple

import numpy as np

Tensor = Any

#: The index that fills a padded payload's unused rows (:class:`Capped`).
PAD = -1


@dataclass(frozen=True)
class Capped:
    """A selection cut to the payload's capacity (:meth:`Backend.pick_capped`).

    Attributes:
        idx: the selection's lowest indices, ascending, at most the capacity of them; when
            ``padded``, exactly the capacity, :data:`PAD` after the first ``sent`` (cut to its
            top-k by :meth:`Backend.top_k_capped`: those first ``sent`` in no order).
        sent: how many indices of the selection ``idx`` holds (an int, or a 0-dim tensor left
            on an accelerator).
        overflow: how many the selection held beyond the capacity (left in the residual).
        padded: whether ``idx`` is padded to the capacity (an accelerator: a payload of fixed
            size, whose count nobody reads on the host).
    """

    idx: Tensor
    sent: Any
    overflow: Any
    padded: bool


def cut(idx: Any, found: int, capacity: int) -> Capped:
    """A selection of ``found`` ascending indices known on the host, cut to its ``capacity``
    lowest (not padded)."""
    return Capped(idx[:capacity], min(found, capacity), max(0, found - capacity), padded=False)


class DeviceRounds(Protocol):
    """The histogram controller's primitives on an accelerator, part of :class:`Backend` (a
    backend whose ``decides_on_device`` is always False provides that method alone; see
    :mod:`horovod_sparse.methods.micro.device_rounds`)."""

    def decides_on_device(self, x: Tensor) -> bool:
        """Whether work on ``x`` takes the accelerators' paths, where decisions stay tensors on
        the device until the step's figures are read."""

    def window_edges(self, window: Any, scanned: Any) -> Tensor:
        """A ``HistogramWindow``'s float32 edges on the scanned buffer's device."""

    def fine_edges(self, reading: Tensor) -> Tensor:
        """The edges of ``HistogramWindow.around(threshold)`` for the threshold of a packed
        reading on a device (:meth:`settle`'s)."""

    def candidate_bars(self, scanned: Any, budgets: Tuple[int, int]) -> Any:
        """``candidate_bar`` at each of the two ``budgets``, left on the device with what reaches
        them (for both rounds of :meth:`histograms_above`)."""

    def histograms_above(self, edges: Tensor, scanned: Any, bars: Any, rank: int, parts: int) -> Tensor:
        """For each of :meth:`candidate_bars`' bars, ``local_histogram`` of the scanned slice's
        coordinates at or above it, in the window of ``edges``, one after the other."""

    def read_histograms(self, edges: Tensor, summed: Tensor, target: int, count: int) -> Tensor:
        """``threshold_from_histogram`` of each of ``count`` summed :meth:`histograms_above`
        parts, packed a row each on the device (``device_rounds.READING_FIELDS``: the threshold's
        float32 bit pattern, then the flags)."""

    def settle(self, readings: Tensor, places: Sequence[Tuple[int, int]], rows: Sequence[int]
               ) -> Tuple[Tensor, Tensor]:
        """The packed reading (1-D) at row ``rows[f]`` of ``readings``, ``f`` the flags at
        ``places`` ((row, column) pairs) read as a binary number, the first the highest bit; and
        those flags (1-D), on the device."""

    def unpack_reading(self, reading: Tensor) -> Any:
        """A packed reading (:meth:`settle`'s) as a ``DeviceReading`` of 0-dim tensors."""


class ChunkedValues(Protocol):
    """SparseLoCo's primitives, part of :class:`Backend`: top-k within chunks and values
    quantized to levels, packed on the wire (:mod:`horovod_sparse.methods.sparseloco`)."""

    def top_k_chunks(self, x: Tensor, chunk: int, k: int, k_last: int) -> Tensor:
        """The ``k`` largest ``|x|`` of each full chunk of ``chunk`` consecutive elements of the flat
        ``x`` and the ``k_last`` largest of the shorter chunk that ends it (when ``numel`` is not a
        multiple of ``chunk``), ties to the lower index: ascending int64 indices, ``numel // chunk * k
        + k_last`` of them (``k <= chunk``, ``k_last`` at most the last chunk's length). ``x`` must
        hold no NaN."""

    def float32(self, t: Tensor) -> Tensor:
        """``t`` as float32 (rounded to nearest from float64; exact from float16 and bfloat16)."""

    def moments(self, values: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(mean, std, centred)`` of the ``m`` float32 ``values``: ``centred = values - mean``
        (float32, as the quantizer codes them), and 1-element float32 tensors: ``mean`` the
        float32 rounding of ``S(v) / m``, ``std`` that of ``sqrt(S(c * c)) / sqrt(m - 1)`` (0 for ``m
        <= 1``), where ``c = v - mean`` in float32, squared, summed, rooted and divided in float64,
        and ``S`` a float64 sum in any order (a reduction: within about ``m * 2**-53`` of the exact
        sum, relative). So each result is the float32 rounding of the exact formula's but where
        that lies within ``S``'s error of a float32 rounding boundary; frameworks and devices agree
        bitwise except there."""

    def level_codes(self, centred: Tensor, scale: Tensor, levels: int) -> Tensor:
        """Integer codes ``clamp(round(centred / scale + levels // 2), 0, levels - 1)`` (round half to
        even) of float32 ``centred``, with the 1-element ``scale`` taken as 1 where it is 0 or not
        finite (PyTorch's int64, which index as they are; TensorFlow's uint8)."""

    def bin_means(self, values: Tensor, codes: Tensor, levels: int) -> Tensor:
        """For each code ``b < levels``, the mean of the float32 ``values`` whose code is ``b``: the
        float32 rounding of their float64 sum (in any order, as in :meth:`moments`) divided in
        float64 by their count; 0 when there is none. A float32 tensor of ``levels`` values."""

    def dequantize(self, codes: Tensor, tables: Tensor, count: int) -> Tensor:
        """Rows of ``count`` codes each, one table of ``levels + 1`` float32 per row (the level's
        value, then the row's shift): ``table[code] + table[levels]`` for each code, float32, in the
        order of ``codes``."""

    def pack_codes(self, codes: Tensor, bits: int) -> Tensor:
        """Integer codes below ``2**bits`` (``bits`` in 1, 2, 4, 8) packed ``8 // bits`` to a byte: code
        ``i`` in byte ``i // (8 // bits)`` at bit ``(i % (8 // bits)) * bits``, the unused high bits
        of the last byte 0; ``ceil(m * bits / 8)`` uint8 for ``m`` codes."""

    def unpack_codes(self, packed: Tensor, bits: int, count: int) -> Tensor:
        """The codes of rows of :meth:`pack_codes` of ``count`` codes each, concatenated (integers of
        :meth:`level_codes`'s type, ``count`` per row, in row order)."""

    def pack_offsets(self, idx: Tensor, chunk: int, width: int) -> Tensor:
        """The ``m`` int64 indices ``idx`` as offsets inside their chunks of ``chunk`` elements
        (``idx % chunk``, below ``2**width``), ``width`` bits each, packed into ``ceil(m * width / 8)``
        uint8. Little-endian bit order: bit ``b`` of offset ``j`` is bit ``s = j * width + b`` of
        the stream, which is bit ``s % 8`` of byte ``s // 8``; the unused high bits of the last byte
        are 0. Shapes follow from ``m`` and the ints alone (nothing read on the host; traceable)."""

    def unpack_offsets(self, packed: Tensor, chunk: int, k: int, width: int, count: int) -> Tensor:
        """The global indices of rows of :meth:`pack_offsets` of ``count`` offsets each (``chunk``
        and ``width`` as packed) of :meth:`top_k_chunks`'s indices, concatenated: int64, ``count``
        per row, in row order. Offset ``j`` of a row lies in chunk ``j // k`` (``k`` per full chunk,
        in chunk order, then the last chunk's ``k_last <= k``), so its index is ``(j // k) * chunk``
        plus the offset: no more is sent."""


class Backend(DeviceRounds, ChunkedValues, Protocol):
    """What every front end's backend module provides (module attributes; see the module
    docstring for the shared contracts)."""

    #: The framework's name, as the registry and the ``Compression`` namespaces know it.
    name: str
    #: The message a sparsifier raises inside the framework's stock Horovod wrapper.
    STOCK_REFUSAL: str
    #: Whether a statistic may be left to be worked out when the statistics are read
    #: (:class:`~horovod_sparse.common.stats.Deferred`): not where a step may be traced
    #: (TensorFlow), whose figures are computed in the step.
    DEFERS_STATISTICS: bool

    # -- sizes and host values ---------------------------------------------------------------
    def numel(self, x: Tensor) -> int:
        """Number of elements of ``x`` (static)."""

    def size(self, t: Tensor) -> Any:
        """Number of elements of ``t``: a Python int, or an int64 scalar while traced."""

    def to_numpy(self, t: Tensor) -> np.ndarray:
        """``t``'s values on the host (bfloat16 ones as float32 where NumPy lacks the type)."""

    def from_numpy(self, array: np.ndarray, like: Optional[Tensor]) -> Tensor:
        """``array`` as a tensor on ``like``'s device (the host's when ``like`` is None)."""

    def saved(self, t: Tensor) -> Any:
        """``t`` as a checkpoint holds it: the tensor itself in PyTorch (``torch.load`` with
        ``weights_only=True`` reads tensors), a NumPy copy in TensorFlow."""

    def from_saved(self, saved: Any) -> Tensor:
        """The tensor :meth:`saved` made ``saved`` from."""

    def reshape_one(self, n: Any, like: Tensor) -> Tensor:
        """A 1-element int64 tensor holding ``n`` (an int, or a scalar tensor while traced)."""

    def chunk_counts(self, counts: Any, size: int, fixed: bool) -> Any:
        """Per-rank chunk lengths for :meth:`scatter_chunks`: the allgathered ``counts`` tensor,
        or with ``fixed`` ``size`` copies of one count (an int, or a scalar tensor)."""

    def host_call(self, decide: Callable[..., Any], args: Sequence[Any], dtype: str) -> Any:
        """``decide(*args)`` on the host with Python values; while traced, a ``dtype`` tensor
        computed when the step runs (``"int32"``, ``"float64"``)."""

    def outside_trace(self) -> ContextManager[None]:
        """A context for tensors that outlive the step (a group's method state): TensorFlow's
        lifts them out of a ``tf.function`` being traced (``tf.init_scope``); PyTorch's does
        nothing."""

    # -- selection (ascending int64 indices; ties to the lower index) ------------------------
    def top_k(self, x: Tensor, k: Any, ascending: bool = True) -> Tensor:
        """The ``k`` largest ``|x|`` (``ascending=False``: in any order, where a backend can
        spare the sort)."""

    def select(self, x: Tensor, threshold: Any, block: int) -> Tensor:
        """``|x| >= threshold`` over the whole ``x`` (``block``: the scan's block length)."""

    def scan(self, x: Tensor, start: int, end: int, block: int, moments: bool = False) -> Any:
        """Block maxima of ``x[start:end]`` (a ``BlockScan``; with ``moments`` it also has
        ``mean_std()``)."""

    def pick(self, scanned: Any, threshold: float) -> Tensor:
        """``|x| >= threshold`` within a scanned slice."""

    def pick_capped(self, scanned: Any, threshold: Any, capacity: Any) -> Capped:
        """``pick(scanned, threshold)`` cut to its ``capacity`` lowest indices; on an accelerator
        padded to ``capacity`` (``capacity``: an int, or a scalar tensor while traced)."""

    def device_reached(self, scanned: Any, threshold: Any) -> Tuple[Tensor, Any]:
        """On an accelerator (not needed where ``decides_on_device`` is always False):
        ``(|x| >= threshold, its count)`` over the scanned slice, the count a 0-dim tensor left
        there."""

    def count_reaching(self, scanned: Any, threshold: Any) -> Any:
        """How many ``|x| >= threshold`` the scanned slice holds: an int, or on an accelerator a
        0-dim tensor from one pass. Counting picks nothing: the pick (:meth:`pick_capped`) waits
        for the threshold the counts settle on, and on the host it finishes the count's pass
        when that threshold is the one counted last."""

    def lowered_thresholds(self, threshold: Any, factor: float, times: int) -> Any:
        """:func:`~horovod_sparse.common.threshold_baselines.lowered_thresholds` of a threshold of
        :meth:`kth_magnitude`'s kind: a list of floats, or on an accelerator a 1-D float32 tensor
        of the same values left there (one product)."""

    def counts_at(self, scanned: Any, thresholds: Any) -> Any:
        """On an accelerator (a backend whose ``decides_on_device`` is always False need not
        provide it): how many ``|x| >= t`` the scanned slice holds for each of the descending
        :meth:`lowered_thresholds` ``t``, a 1-D float tensor of exact counts from one pass."""

    def first_settled(self, thresholds: Any, counts: Any, low: float, high: float,
                      checks: int) -> Tuple[Any, Any]:
        """Of thresholds tried in turn and their counts (lists on the host, the thresholds' first
        ``len(counts)``; on an accelerator every threshold's, :meth:`counts_at`: non-decreasing, as
        the thresholds do not increase), the first among
        the first ``checks`` whose count is at least ``low`` (else the last), and whether its count
        exceeds ``high`` (never for the unchecked last): ``(threshold, cut)``, Python values, or
        on an accelerator 0-dim tensors left there."""

    def top_k_capped(self, x: Tensor, capped: Capped, k: int, cut: Any) -> Capped:
        """Where ``cut`` (of :meth:`first_settled`'s kind) holds, the ``k`` largest ``|x|`` among
        the indices ``capped`` holds (ties to the lower index; its overflow kept), else
        ``capped``."""

    def band(self, count: Any, low: float, high: float, below: float, above: float) -> Any:
        """:func:`~horovod_sparse.common.threshold_baselines.band_factor` of ``count`` (of
        :meth:`count_reaching`'s kind): a float, or a 0-dim float64 tensor left on the accelerator."""

    def as_threshold(self, value: Any) -> Any:
        """:func:`~horovod_sparse.common.thresholds.as_float32` of ``value``: a float, or for a
        float64 tensor on an accelerator a 0-dim float32 tensor left there (what :meth:`pick`
        takes)."""

    def pick_with_magnitudes(self, scanned: Any, threshold: float) -> Tuple[Tensor, Tensor]:
        """``pick(scanned, threshold)`` and the ``|x|`` at the picked indices."""

    def at_least(self, t: Tensor, threshold: float) -> Tensor:
        """The mask ``t >= threshold`` (``threshold`` compared in ``t``'s dtype)."""

    def candidate_bar(self, scanned: Any, budget: int) -> Any:
        """:func:`~horovod_sparse.methods.micro.controllers.candidate_bar` of a scan's block maxima: a
        float, or on an accelerator a 0-dim float32 tensor left there (what :meth:`pick` and
        :meth:`local_histogram` take)."""

    def local_histogram(self, window: Any, magnitudes: Tensor, bar: float, rank: int, parts: int) -> Tensor:
        """:func:`~horovod_sparse.methods.micro.controllers.local_histogram` as an int32 tensor
        (on the host paths)."""

    # -- gathers, scatters and casts ---------------------------------------------------------
    def clone(self, t: Tensor) -> Tensor:
        """A copy of ``t`` that writes to either leave the other unchanged."""

    def gather(self, x: Tensor, idx: Tensor) -> Tensor:
        """``x[idx]``."""

    def delivered(self, x: Tensor, capped: Capped) -> Tuple[Tensor, Tensor]:
        """What a rank delivers of ``capped``: ``(index, x[index])``, where a padded row has index
        0 and value +0.0 (adding it changes nothing)."""

    def unpadded(self, indices: Tensor) -> Tensor:
        """Gathered indices with the :data:`PAD` rows sent to index 0 (whose values are +0.0)."""

    def to_wire(self, values: Tensor, fp16: bool) -> Tensor:
        """Values as they travel: float16 with ``fp16``, bfloat16 as float32, else as they are."""

    def wire_index(self, idx: Tensor, numel: int) -> Tensor:
        """``idx`` as it travels: int32 below 2**31 elements, else int64."""

    def as_index(self, t: Tensor) -> Tensor:
        """``t`` as int64 indices."""

    def scatter_chunks(self, out: Tensor, indices: Tensor, values: Tensor, counts: Any, scale: float) -> Tensor:
        """``out[indices] += scale * values``, one rank's chunk (``counts[r]`` entries, distinct
        indices within a chunk) at a time, in rank order; ``indices`` int32 or int64, as they came
        off the wire (:meth:`wire_index`)."""

    def sum_chunks(self, out: Tensor, values: Tensor, size: int, scale: float) -> Tensor:
        """On an accelerator (not needed where ``decides_on_device`` is always False):
        ``out += scale * chunk`` for each of the ``size`` equal chunks of ``values`` (every rank's
        masked payload, as they came off the wire), in rank order, onto the zeroed ``out``; each
        chunk is scaled before it is added, as :meth:`scatter_chunks` does, so the sum is bitwise
        what it writes from the chunks' nonzero rows. ``values`` may be changed."""

    def masked_union(self, values: Tensor, size: int) -> Any:
        """On an accelerator (not needed where ``decides_on_device`` is always False): how many
        coordinates are nonzero in at least one of the ``size`` equal chunks of ``values`` (the
        ranks' masked payloads), a 0-dim tensor left there."""

    def scatter_set(self, out: Tensor, idx: Tensor, values: Tensor, scale: float) -> Tensor:
        """``out[idx] = scale * values`` (distinct ``idx``)."""

    def distinct(self, indices: Tensor, numel: int, padded: bool = False) -> Any:
        """Number of distinct ``indices`` (int32 or int64, all in ``[0, numel)``, or :data:`PAD`
        when ``padded``, which is not counted)."""

    # -- what gTop-k and DGC need ------------------------------------------------------------
    def coalesce(self, idx: Tensor, values: Tensor) -> Tuple[Tensor, Tensor]:
        """The distinct ``idx`` in ascending order and the sum of ``values`` at each (added to
        zero in the order of ``values``). On an accelerator the result keeps the input's length,
        so nothing is read on the host: the distinct indices first, then index 0 with a sum of
        +0.0 in every remaining place."""

    def isin(self, values: Tensor, ascending: Tensor) -> Tensor:
        """Mask of the entries of ``values`` present in the ascending ``ascending``."""

    def both(self, a: Tensor, b: Tensor) -> Tensor:
        """The boolean masks' elementwise and."""

    def kept(self, values: Tensor, keep: Optional[Tensor]) -> Tensor:
        """``values`` where the boolean ``keep`` holds, +0.0 elsewhere (all of them for None)."""

    def count_true(self, keep: Optional[Tensor], total: Any) -> Any:
        """How many of ``keep`` hold (``total`` for None): an int, or on an accelerator a 0-dim
        tensor left there."""

    def to_wire_mask(self, keep: Optional[Tensor], like: Tensor) -> Tensor:
        """The boolean ``keep`` as it travels (uint8; all ones, one per entry of ``like``, for None)."""

    def from_wire_mask(self, t: Tensor) -> Tensor:
        """A mask received from :meth:`to_wire_mask` as a boolean mask."""

    def concat(self, tensors: Sequence[Tensor]) -> Tensor:
        """The tensors one after the other."""

    def mask(self, t: Tensor, keep: Tensor) -> Tensor:
        """``t[keep]`` for a boolean mask ``keep``."""

    def splits_to(self, size: int, target: Optional[int], tensor: Tensor) -> Any:
        """Alltoall splits sending all of ``tensor``'s rows to rank ``target`` only (none when
        None): a list of ints, read without touching a device (or, traced in TensorFlow with a
        scheduled ``k``, a tensor)."""

    def embed(self, out: Tensor, lo: int, values: Tensor) -> Tensor:
        """``out`` holding ``values`` from position ``lo`` on and zeros everywhere else. ``values``
        may be that very slice of ``out``, changed in place since an earlier ``embed`` of it
        (a residual): then ``out`` is returned as it is, its zeros already there."""

    def copy_at(self, out: Tensor, capped: Capped, source: Optional[Tensor]) -> Tensor:
        """``out`` with ``source`` (zeros when None) at the indices ``capped`` holds (its padding
        writes nothing)."""

    def momentum_step(self, x: Tensor, velocity: Optional[Tensor], accumulated: Optional[Tensor],
                      momentum: float) -> Tuple[Tensor, Tensor, Tensor]:
        """DGC's momentum correction: with ``x = v + g`` on entry, ``u = m u + g``, ``v = v + u``;
        returns ``(v, u, v)`` (the new ``x``, velocity and accumulation); buffers created as zeros
        when None."""

    def kth_magnitude(self, values: Tensor, k: int) -> Any:
        """The ``k``-th largest ``|values|`` as a threshold, rounded to float32 and at least
        :data:`~horovod_sparse.methods.micro.controllers.SMALLEST_THRESHOLD`
        (:func:`~horovod_sparse.methods.micro.controllers.as_float32`): a float, or on an accelerator a
        0-dim float32 tensor left there (what :meth:`pick` and :meth:`lowered_thresholds` take)."""

    def synchronize(self, like: Tensor) -> None:
        """Wait until the work queued on ``like``'s device is done (a timer's edge; nothing to
        wait for where operations run synchronously)."""

    # -- host collectives (blocking, eager; for measurements and rare metadata) ---------------
    def allgather_array(self, array: np.ndarray, process_set: Any, name: str) -> np.ndarray:
        """Every rank's NumPy ``array`` concatenated along the first axis, in rank order."""

    def allgather_payload(self, numel: int, like: Optional[Tensor], process_set: Any, name: str) -> None:
        """Allgather ``numel`` float32 zeros from every rank, on ``like``'s device (the host when
        None) through the collectives the exchange uses there, and wait until it is done: what the
        alpha-beta calibration times."""

    def allgather_bytes(self, payload: bytes, name: str, process_set: Any) -> Sequence[bytes]:
        """Every rank's ``payload``, in rank order."""
