"""Threshold controllers of the partitioned methods (MiCRO, ExDyna): each step's threshold.

Every rank selects ``|x| >= threshold`` over the partition it owns, so the global count (the
union, since partitions are exclusive) is whatever the threshold lets through. The threshold
must be the same on every rank, so a controller derives it only from numbers every rank holds
identically: the previous steps' global counts, and, for the default controller, a histogram
summed over ranks by one small allreduce.

Controllers (``controller=`` option):

``"histogram"`` (default)
    Follows the *current* step's gradient with one allreduce of about 1 KB.

    1. Each rank already has the largest ``|x|`` of every block of its partition (the
       selection scan, :func:`scan_block_size`). It re-reads its ``budget`` blocks with the
       largest maxima (:func:`candidate_budget`: 1.5 times what its partition selected at the
       last step, at least ``1.5 k / n``); they hold every coordinate at or above the
       ``budget``-th largest maximum, the rank's *bar* (:func:`candidate_bar`). These
       candidates are at least ``budget`` coordinates.
    2. It counts the candidates' magnitudes into a histogram (:class:`HistogramWindow`: bin
       edges 1/2048 octave apart next to the last threshold, where error feedback piles
       residuals up just below it, each next bin 1/16 wider, out to 4 octaves either side; at
       the first step, and after a step whose answer fell outside the window, 4 bins per
       octave over every positive float32) and marks which edge its bar lies under
       (:func:`local_histogram`).
    3. The allreduce sums these. Above every rank's bar the global tail counts are exact, and
       every rank reads the same threshold off them (:func:`threshold_from_histogram`: log-log
       interpolation inside a bin, never below the highest bar).
    4. Only if the counts stop short of ``k`` at a bar (a partition's count grew by more than
       half since the last step), every rank re-reads ``1.5 k`` blocks, which provably reaches
       below the answer, and a second allreduce settles the threshold (``wide=True`` of
       :func:`candidate_budget`). Lock-in takes one step, and a gradient whose scale jumps
       from step to step is followed at once.
    5. Only if the threshold was interpolated inside a bin holding more than 10% of ``k``
       (error feedback piles residuals up just below earlier thresholds, which may lie in the
       window's wider bins), the same candidates are counted once more in a fine window around
       it and another allreduce settles it (:func:`histogram_threshold` runs these rounds).
    6. Each rank keeps the candidates at or above the threshold: no further pass.

    On an accelerator the same threshold is reached without reading a histogram on the host:
    both rounds are always taken and the choice among their readings made on the device
    (:mod:`~horovod_sparse.methods.micro.device_rounds`).

``"paper"``
    The published rule of MiCRO/ExDyna, exactly as the authors' code runs it: the first
    threshold is ``1 / (2 sqrt(k))`` (data independent), then with ``ratio = k_prev / k``
    (``k_prev``: last step's global count) the threshold is multiplied by 1.005 if
    ``ratio > 1.1``, by 1.00125 if ``0.909 < ratio <= 1.1``, else by 0.995. It moves at most
    0.5% a step, so it needs hundreds of steps to reach the target and cannot follow a gradient
    whose scale changes faster than that.
``"paper_intent"``
    The same, with the presumed intent of the reference code's unreachable branch inside the
    band: ×1.00125 if ``ratio > 1`` else ×0.9987.

Selection thresholds are rounded to float32 (:func:`as_float32`) so that every framework and the
NumPy references compare against the same number; the paper rule compounds in double precision
as the reference code does. Histogram edges are float32 bit patterns built with integer
arithmetic, so every rank on every machine gets the same ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generator, List, NamedTuple, Optional, Protocol, Sequence, TypeVar

import numpy as np

from horovod_sparse.common.thresholds import SMALLEST_THRESHOLD, as_float32, float32_bits
from horovod_sparse.common.timing import PhaseTimer

#: Names accepted by the ``controller=`` option, default first.
CONTROLLERS = ("histogram", "paper", "paper_intent")

#: A rank re-reads this many times its partition's count at the last step, in blocks.
CANDIDATE_MARGIN = 1.5
#: A threshold interpolated inside a bin holding more than this fraction of ``k`` is read again
#: from a fine window around it (error feedback piles residuals up just below past thresholds,
#: where one coarse bin may hold most of the answer).
REFINE_FRACTION = 0.1
#: Float32 bit patterns hold 2**23 per octave; +inf is the first non-finite one.
_OCTAVE_BITS = 1 << 23
_INF_BITS = 0x7F800000


def _fine_offsets() -> np.ndarray:
    """Edge offsets (bit patterns) of the fine window on one side of its centre: 1/2048 octave
    apart next to it, each gap then 1/16 of the distance, out to 4 octaves (120 edges)."""
    offsets = [0]
    while offsets[-1] < 4 * _OCTAVE_BITS:
        offsets.append(offsets[-1] + max(_OCTAVE_BITS >> 11, offsets[-1] >> 4))
    return np.array(offsets, dtype=np.int64)


_FINE_OFFSETS = _fine_offsets()
#: A fine window's edges' offsets from its centre, in float32 bit patterns (increasing).
FINE_WINDOW_OFFSETS = np.concatenate([-_FINE_OFFSETS[:0:-1], _FINE_OFFSETS])
#: Edges of every fine window (:meth:`HistogramWindow.around`).
FINE_EDGES = FINE_WINDOW_OFFSETS.size
#: The lowest and highest centre of a fine window (bit patterns): its edges then stay within
#: the positive finite float32 values.
FINE_CENTRES = (1 + int(_FINE_OFFSETS[-1]), _INF_BITS - 1 - int(_FINE_OFFSETS[-1]))


def fine_centre_bits(bits: int) -> int:
    """The centre (bit pattern) of the fine window around the float32 of bit pattern ``bits``:
    ``bits`` itself, moved into :data:`FINE_CENTRES`."""
    return min(max(bits, FINE_CENTRES[0]), FINE_CENTRES[1])


def candidate_budget(k: int, parts: int, last_counts: Sequence[int], partition: int, wide: bool = False) -> int:
    """Blocks a rank re-reads to count its candidates exactly: ``CANDIDATE_MARGIN`` times what
    its ``partition`` selected at the last step (``last_counts``, per partition), at least
    ``k / parts`` (twice that before the first step). ``wide``: ``CANDIDATE_MARGIN * k``, more
    than any rank's share of the ``k``, so the rank's bar is below the answer."""
    if wide:
        share = float(k)
    else:
        share = max(k / parts, last_counts[partition]) if len(last_counts) else 2.0 * k / parts
    return max(1, math.ceil(CANDIDATE_MARGIN * share))


def candidate_bar(maxima: np.ndarray, budget: int) -> float:
    """The ``budget``-th largest of the block ``maxima`` (the smallest positive float32 when
    there are no more blocks than that, or when it is 0)."""
    if maxima.size <= budget:
        return SMALLEST_THRESHOLD
    cut = maxima.size - budget
    return max(float(np.partition(maxima, cut)[cut]), SMALLEST_THRESHOLD)


@dataclass
class ThresholdState:
    """What a threshold controller remembers between steps (plain numbers: saved and restored
    with the group's state).

    Attributes:
        threshold: the last threshold, in double precision (the paper rule compounds it).
        steps: sparse steps taken so far.
        last_union: coordinates selected over all ranks at the last step (``k_prev``).
        last_counts: coordinates selected in each partition at the last step.
        clamped: the last histogram threshold fell outside its window (so the next histogram
            covers the whole float range).
        short: the last histogram threshold stopped at a rank's bar, short of ``k`` (the
            candidates did not reach far enough; read wider and count again).
        coarse: the last histogram threshold was interpolated in a bin holding many coordinates
            (count again in a fine window around it).
    """

    threshold: float = 0.0
    steps: int = 0
    last_union: int = 0
    last_counts: List[int] = field(default_factory=list)
    clamped: bool = False
    short: bool = False
    coarse: bool = False

    def record(self, counts: Sequence[int]) -> None:
        """After a step in which ``counts[p]`` coordinates were selected in partition ``p``."""
        self.steps += 1
        self.last_counts = [int(c) for c in counts]
        self.last_union = sum(self.last_counts)


class HistogramWindow:
    """Histogram bins over non-negative float32 values, given by increasing positive finite edges.

    ``histogram`` arrays have ``len(edges) + 1`` counts: below the first edge, between
    consecutive edges, at or above the last edge.
    """

    def __init__(self, edge_bits: np.ndarray) -> None:
        self.edge_bits = np.asarray(edge_bits, dtype=np.int64)
        self._edges32 = self.edge_bits.astype(np.int32).view(np.float32)

    @classmethod
    def around(cls, threshold: float) -> "HistogramWindow":
        """The fine window centred on ``threshold`` (see the module docstring); near either end
        of the float32 range it is shifted to fit (its edges positive and finite), so every fine
        window has :data:`FINE_EDGES` edges (an accelerator builds it from a threshold left
        there, :func:`fine_centre_bits`)."""
        return cls(fine_centre_bits(float32_bits(threshold)) + FINE_WINDOW_OFFSETS)

    @classmethod
    def everything(cls) -> "HistogramWindow":
        """4 edges per octave over every positive finite float32 (the first step)."""
        return cls(np.arange(1, _INF_BITS >> 21, dtype=np.int64) << 21)

    def __len__(self) -> int:
        return self.edge_bits.size

    def edges(self) -> np.ndarray:
        """The edges as float64 (exact float32 values, increasing, > 0)."""
        return self._edges32.astype(np.float64)

    def edges32(self) -> np.ndarray:
        """The edges as float32 (what :meth:`histogram` compares with)."""
        return self._edges32

    def histogram(self, values: np.ndarray) -> np.ndarray:
        """Counts of non-negative ``values`` (``len(self) + 1`` int32, see the class docstring)."""
        slots = np.searchsorted(self._edges32, np.asarray(values, dtype=np.float32), side="right")
        return np.bincount(slots, minlength=len(self) + 1).astype(np.int32)

    def edge_at_or_above(self, value: float) -> int:
        """Index of the first edge ``>= value`` (``len(self)`` when there is none)."""
        return int(np.searchsorted(self._edges32, np.float32(value), side="left"))


def local_histogram(window: HistogramWindow, magnitudes: np.ndarray, bar: float, rank: int,
                    parts: int) -> np.ndarray:
    """Rank ``rank``'s share of the global histogram, ``len(window) + 1 + parts`` int32: the
    counts of its candidates' ``magnitudes`` (all its coordinates ``>= bar``), then, at
    position ``rank`` of the last ``parts`` entries, the first edge at or above its ``bar``."""
    marks = np.zeros(parts, dtype=np.int32)
    marks[rank] = window.edge_at_or_above(bar)
    return np.concatenate([window.histogram(magnitudes), marks])


class Reading(NamedTuple):
    """A threshold read off a summed histogram: whether the answer fell outside the window,
    stopped short of the target at the highest rank's bar, or was interpolated inside a bin
    holding more than :data:`REFINE_FRACTION` of the target (``coarse``)."""

    threshold: float
    outside: bool
    short: bool
    coarse: bool = False


def threshold_from_histogram(window: HistogramWindow, histogram: Sequence[int], target: float) -> Reading:
    """The float32 threshold that about ``target`` coordinates reach, read off a summed
    :func:`local_histogram`.

    With ``T(e)`` the number of coordinates ``>= e``, exact at every edge at or above all the
    ranks' bars, the result is the edge or the point inside the bin where ``T`` crosses
    ``target``, interpolated linearly in ``(log e, log T)`` (in ``log e`` alone when ``T`` is 0
    at the bin's top). It is the window's top edge when more than ``target`` lie above the
    window (outside), and the lowest exact edge when fewer than ``target`` reach it (outside
    when that is the window's first edge, else short). Non-increasing in ``target``; identical
    on every rank for the same histogram.
    """
    size = len(window)
    counts = np.asarray(histogram[:size + 1], dtype=np.int64)
    lowest = int(np.max(histogram[size + 1:]))
    tails = np.cumsum(counts[::-1])[::-1][1:]  # tails[j] = T(edge j), j = 0 .. size - 1
    edges = window.edges()
    if tails[-1] >= target or lowest >= size:
        return Reading(as_float32(edges[-1]), True, False)
    if tails[lowest] < target:
        return Reading(as_float32(edges[lowest]), lowest == 0, lowest > 0)
    j = int(np.count_nonzero(tails >= target)) - 1
    above, beyond = float(tails[j]), float(tails[j + 1])
    if beyond > 0:
        fraction = math.log(above / target) / math.log(above / beyond)
    else:
        fraction = (above - target) / above
    value = edges[j] * (edges[j + 1] / edges[j]) ** fraction
    return Reading(min(max(as_float32(value), float(edges[j])), float(edges[j + 1])), False, False,
                   above - beyond > REFINE_FRACTION * target)


def paper_factor(ratio: float, intended_band: bool = False) -> float:
    """The published multiplicative update for ``ratio = k_prev / k``.

    The reference code's band branch reads ``1.00125 if ratio > 0 else 0.9987``, so inside the
    band it always raises; ``intended_band`` uses ``ratio > 1`` instead (the presumed intent).
    """
    if ratio > 1.1:
        return 1.005
    if ratio > 0.909:
        return 1.00125 if ratio > (1.0 if intended_band else 0.0) else 0.9987
    return 0.995


class Controller(Protocol):
    """Chooses each step's threshold from globally known numbers."""

    def window(self, state: ThresholdState) -> Optional[HistogramWindow]:
        """The histogram to sum over ranks before choosing (see :func:`local_histogram`), or
        None when the controller needs none."""

    def next_threshold(self, state: ThresholdState, k: int, histogram: Optional[np.ndarray],
                       window: Optional[HistogramWindow] = None) -> float:
        """Update ``state`` for this step and return the float32 selection threshold.
        ``histogram`` is the global histogram of :meth:`window` (None when it returned None);
        pass that ``window`` when reading a second histogram in the same step."""


class PaperController:
    """The published rule (see the module docstring); ``intended_band`` selects ``paper_intent``."""

    def __init__(self, intended_band: bool = False) -> None:
        self.intended_band = intended_band

    def window(self, state: ThresholdState) -> Optional[HistogramWindow]:
        return None

    def next_threshold(self, state: ThresholdState, k: int, histogram: Optional[np.ndarray],
                       window: Optional[HistogramWindow] = None) -> float:
        if state.steps == 0:
            state.threshold = 1.0 / (2.0 * math.sqrt(k))
        else:
            state.threshold *= paper_factor(state.last_union / k, self.intended_band)
        return as_float32(state.threshold)


class HistogramController:
    """The default controller: the threshold read off this step's global histogram (see the
    module docstring)."""

    def window(self, state: ThresholdState) -> Optional[HistogramWindow]:
        if state.steps == 0 or state.clamped:
            return HistogramWindow.everything()
        return HistogramWindow.around(state.threshold)

    def next_threshold(self, state: ThresholdState, k: int, histogram: Optional[np.ndarray],
                       window: Optional[HistogramWindow] = None) -> float:
        if histogram is None:
            raise ValueError("the histogram controller needs the global histogram of its window")
        reading = threshold_from_histogram(window if window is not None else self.window(state), histogram, k)
        state.threshold, state.clamped, state.short, state.coarse = reading
        return state.threshold


C = TypeVar("C", bound="CandidateSet")


class HistogramRound(NamedTuple):
    """One allreduce (sum) the histogram controller asks for: this rank's :func:`local_histogram`
    (a NumPy array, or a framework's tensor, possibly on a device) and the suffix naming the
    collective (the same on every rank)."""

    local: Any
    tag: str


class CandidateSet(Protocol):
    """A rank's candidates (every coordinate of its partition at or above its bar)."""

    def local_histogram(self, window: HistogramWindow, rank: int, parts: int) -> Any:
        """:func:`local_histogram` of their magnitudes and bar."""


class HistogramResult(NamedTuple):
    """What :func:`histogram_threshold` settles: the threshold, the candidates it was read
    from, the rounds taken (by name) and whether the threshold is at or above this rank's bar
    (``filterable``: the candidates then hold every coordinate that reaches it). The last is
    read off the summed histogram's marks (:func:`reaches_bar`), not off the bar, which may
    still be on a device."""

    threshold: float
    candidates: Any
    tags: List[str]
    filterable: bool


def reaches_bar(window: HistogramWindow, histogram: np.ndarray, rank: int, threshold: float) -> bool:
    """Whether ``threshold`` is at or above rank ``rank``'s bar, known from a summed
    :func:`local_histogram`: the bar lies at or under the edge marked there (none when the mark
    is past the last edge)."""
    mark = int(histogram[len(window) + 1 + rank])
    return mark < len(window) and threshold >= float(window.edges32()[mark])


def histogram_threshold(controller: HistogramController, state: ThresholdState, k: int, parts: int,
                        partition: int, rank: int, collect: Callable[[int], C]
                        ) -> Generator[HistogramRound, np.ndarray, HistogramResult]:
    """This step's threshold from the histogram controller, as a conversation with the exchange:
    the generator yields each round's local histogram, is sent its sum over ranks (as NumPy),
    and returns a :class:`HistogramResult`. ``collect(budget)`` reads this rank's candidates
    from its ``budget`` blocks with the largest maxima (``partition``: the partition it owns).

    Rounds, decided from the summed histograms alone (so every rank takes the same ones):

    1. ``histogram``: candidates from :func:`candidate_budget`, counted in the controller's window;
    2. ``histogram.wide``: only when that stopped short of ``k``: candidates re-read from the wide
       budget (``1.5 k`` blocks) and counted again;
    3. ``histogram.fine``: only when the reading was interpolated inside a bin holding more than
       :data:`REFINE_FRACTION` of ``k``: the same candidates counted in a fine window around it.
    """
    window = controller.window(state)
    candidates = collect(candidate_budget(k, parts, state.last_counts, partition))
    tags = ["histogram"]
    while True:
        summed = yield HistogramRound(candidates.local_histogram(window, rank, parts), tags[-1])
        threshold = controller.next_threshold(state, k, summed, window)
        if state.short and "histogram.wide" not in tags:
            tags.append("histogram.wide")
            candidates = collect(candidate_budget(k, parts, state.last_counts, partition, wide=True))
        elif state.coarse and "histogram.fine" not in tags:
            tags.append("histogram.fine")
            window = HistogramWindow.around(threshold)
        else:
            return HistogramResult(threshold, candidates, tags, reaches_bar(window, summed, rank, threshold))


def histogram_exchange(plan: Generator[HistogramRound, np.ndarray, HistogramResult],
                       allreduce: Callable[[HistogramRound], Any], to_numpy: Callable[[Any], np.ndarray],
                       timer: PhaseTimer) -> Generator[List[Any], List[Any], HistogramResult]:
    """Run :func:`histogram_threshold`'s ``plan`` inside a sparsifier's exchange generator: each
    round is one pending collective, ``allreduce(round)`` (summing ``round.local`` under
    ``round.tag``), yielded to the exchange driver; ``to_numpy`` reads the summed result back.
    Time spent in the plan counts as the ``histogram`` phase of ``timer``. Returns the plan's
    :class:`HistogramResult`."""
    with timer("histogram"):
        round_ = next(plan)
    while True:
        (summed,) = yield [allreduce(round_)]
        try:
            with timer("histogram"):
                round_ = plan.send(to_numpy(summed))
        except StopIteration as finished:
            return finished.value


def make_controller(name: str) -> Controller:
    """The controller called ``name`` (one of :data:`CONTROLLERS`)."""
    factories: Dict[str, Controller] = {"histogram": HistogramController(), "paper": PaperController(),
                                        "paper_intent": PaperController(intended_band=True)}
    try:
        return factories[name]
    except KeyError:
        raise ValueError(f"controller must be one of {', '.join(map(repr, CONTROLLERS))}, got {name!r}") from None
