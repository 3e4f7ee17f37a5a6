"""MergeComp (Wang, Wu, Ng 2021): choose how to merge gradients into groups from measured step
times only, with no knowledge of the model.

Gradients are ordered as they become ready during backward (recorded on a dense first step).
A grouping is a set of *split points* in that order: group ``i`` is the contiguous run from
split ``i - 1`` to split ``i``. Few groups mean few kernels and collectives but late launches
(less overlap with backward); many groups the reverse. :class:`SplitSearch` finds a good
compromise by timing candidates on the running job:

1. **Coarse scan.** Candidates come from one family that spans every number of groups: merge
   adjacent gradients until a group reaches a size threshold, for thresholds ``total``,
   ``total / ratio``, ``total / ratio**2``, ... down to one gradient per group. Per-tensor and
   whole-model are timed first, then the thresholds from few groups to many, stopping after
   ``patience`` candidates in a row that are not the fastest so far (the step time is roughly
   U-shaped in the number of groups).
2. **Refinement.** The reference searches one split point (two groups) by binary search; here
   each split point of the best grouping in turn gets that search: moves of half the distance
   to its neighbours, halving, kept when faster, within a budget of ``refine_budget``
   candidates.
3. **Confirmation.** The ``confirm`` fastest candidates are timed once more and the choice is
   the finalist with the lowest mean of its timings, so one lucky measurement on a noisy machine
   does not decide.

The search is pure: it proposes a candidate, is told the candidate's time per step, proposes
the next. Fed the same agreed timings on every rank, it makes the same choices on every rank.
Without confirmation it returns the candidate with the lowest time measured, so the choice is
never slower (as measured) than per-tensor, whole-model or any threshold it timed; with it, the
finalist with the lowest mean over two timings.

Unlike the reference, the search handles any number of groups, works with every sparsifier,
never replaces the user's optimizer, and leaves the residual alone unless ``residual_decay``
asks for the reference's decay.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple

from horovod_sparse.common.grouping import merge_by_size
from horovod_sparse.common.validation import check_fraction, check_int, check_positive_float

#: Positions in the ready order where a new group starts (strictly increasing, in 1..L-1).
Splits = Tuple[int, ...]


@dataclass(frozen=True)
class MergeCompOptions:
    """Options of the MergeComp scheduler (``groups="mergecomp"`` uses the defaults).

    Attributes:
        warmup_steps: steps run with a new candidate grouping before timing it (reference 5).
        timed_steps: steps timed per candidate; the median is the candidate's time (reference 20).
        ratio: factor between consecutive size thresholds of the coarse scan (> 1).
        patience: coarse candidates in a row that are not the fastest so far before the scan
            stops.
        refine_budget: candidates spent moving split points after the scan (0: no refinement).
        confirm: the fastest candidates timed a second time at the end (0 or 1: none).
        residual_decay: factor applied to every residual after each step. 1.0 (default) keeps
            error feedback exact; the reference decays by 0.9, which loses gradient mass.
        cache: optional JSON file: a search result saved there is reused when the parameters
            (names, sizes) match, and a new result is written there (by rank 0).
    """

    warmup_steps: int = 5
    timed_steps: int = 20
    ratio: float = 4.0
    patience: int = 2
    refine_budget: int = 6
    confirm: int = 3
    residual_decay: float = 1.0
    cache: Optional[str] = None

    def __post_init__(self) -> None:
        check_int("warmup_steps", self.warmup_steps)
        check_int("timed_steps", self.timed_steps, minimum=1)
        if check_positive_float("ratio", self.ratio) <= 1.0:
            raise ValueError(f"ratio must be > 1 (the factor between size thresholds), got {self.ratio}")
        check_int("patience", self.patience, minimum=1)
        check_int("refine_budget", self.refine_budget)
        check_int("confirm", self.confirm)
        check_fraction("residual_decay", self.residual_decay)
        if self.cache is not None and not isinstance(self.cache, str):
            raise TypeError(f"cache must be a file path (str) or None, got {type(self.cache).__name__}")

    @property
    def steps_per_candidate(self) -> int:
        """Training steps one candidate costs (warm-up plus timed)."""
        return self.warmup_steps + self.timed_steps

    @classmethod
    def from_spec(cls, spec: Any) -> Optional["MergeCompOptions"]:
        """The options a ``groups=`` value asks for: ``"mergecomp"`` -> defaults, an instance ->
        itself, anything else -> None (not MergeComp)."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, str) and spec == "mergecomp":
            return cls()
        return None


def runs_of(order: Sequence[int], splits: Splits) -> List[List[int]]:
    """The groups ``splits`` cut ``order`` into, in order."""
    bounds = [0, *splits, len(order)]
    return [list(order[a:b]) for a, b in zip(bounds, bounds[1:])]


def threshold_splits(sizes: Sequence[int], threshold: int) -> Splits:
    """Split points of fixed-size merging: adjacent gradients merged until ``threshold`` elements."""
    runs = merge_by_size(sizes, threshold)
    return tuple(run[0] for run in runs[1:])


def coarse_candidates(sizes: Sequence[int], ratio: float) -> List[Splits]:
    """The coarse family, from one group (threshold ``sum(sizes)``) to one gradient per group,
    thresholds shrinking by ``ratio``; duplicates removed."""
    candidates: List[Splits] = []
    threshold = float(sum(sizes))
    per_tensor = tuple(range(1, len(sizes)))
    while True:
        splits = threshold_splits(sizes, max(1, math.ceil(threshold)))
        if not candidates or splits != candidates[-1]:
            candidates.append(splits)
        if splits == per_tensor:
            return candidates
        threshold /= ratio


@dataclass(frozen=True)
class Trial:
    """A candidate grouping and its agreed time per step (one measurement, or a mean)."""

    splits: Splits
    seconds: float


class SplitSearch:
    """Searches the split points of the ready order from measured step times.

    Drive it the same way on every rank, with timings agreed across ranks::

        search = SplitSearch(sizes, options)
        while search.candidate is not None:
            seconds = time_steps_with(search.candidate)   # agreed across ranks
            search.record(seconds)
        chosen = search.best.splits

    Args:
        sizes: element counts of the gradients, in the order they become ready.
        options: the scheduler's options (``ratio``, ``patience``, ``refine_budget`` are used).
    """

    def __init__(self, sizes: Sequence[int], options: MergeCompOptions) -> None:
        if not sizes:
            raise ValueError("SplitSearch needs at least one gradient")
        self.sizes = [check_int("size", s, minimum=1) for s in sizes]
        self.options = options
        #: Every measurement, in order (a candidate appears again when it is confirmed).
        self.trials: List[Trial] = []
        self._times: Dict[Splits, List[float]] = {}
        self._finalists: List[Splits] = []
        self._plan = self._search()
        self.candidate: Optional[Splits] = next(self._plan, None)

    @property
    def finished(self) -> bool:
        return self.candidate is None

    @property
    def best(self) -> Trial:
        """The candidate with the lowest mean time so far (among the finalists once they are
        confirmed), with that mean; the whole model when nothing needed measuring. Ties go to
        the candidate measured first."""
        if not self._times:
            return Trial((), math.nan)
        splits = min(self._finalists or self._times, key=self._mean)
        return Trial(splits, self._mean(splits))

    def _mean(self, splits: Splits) -> float:
        times = self._times[splits]
        return sum(times) / len(times)

    def record(self, seconds: float) -> None:
        """Report the agreed time per step of :attr:`candidate` and move to the next one."""
        if self.candidate is None:
            raise RuntimeError("the search is finished; there is no candidate to record")
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds):
            raise ValueError(f"a candidate's time must be a finite number of seconds, got {seconds!r}")
        trial = Trial(self.candidate, float(seconds))
        self.trials.append(trial)
        self._times.setdefault(trial.splits, []).append(trial.seconds)
        try:
            self.candidate = self._plan.send(trial.seconds)
        except StopIteration:
            self.candidate = None

    # -- the plan ---------------------------------------------------------------------------------
    def _measure(self, splits: Splits) -> Generator[Splits, float, float]:
        """Time ``splits`` (once: repeated candidates reuse their first time)."""
        if splits not in self._times:
            yield splits
        return self._mean(splits)

    def _search(self) -> Generator[Splits, float, None]:
        if len(self.sizes) == 1:
            return
        coarse = coarse_candidates(self.sizes, self.options.ratio)
        for endpoint in (coarse[-1], coarse[0]):  # per tensor, whole model
            yield from self._measure(endpoint)
        misses = 0
        for splits in coarse[1:-1]:
            best = self.best.seconds
            misses = 0 if (yield from self._measure(splits)) < best else misses + 1
            if misses >= self.options.patience:
                break
        yield from self._refine()
        if self.options.confirm > 1:
            finalists = sorted(self._times, key=self._mean)[:self.options.confirm]
            for splits in finalists:
                yield splits
            self._finalists = finalists

    def _refine(self) -> Generator[Splits, float, None]:
        """Binary search of each split point of the best grouping in turn, within the budget.

        While split ``b`` moves, the others stay, so the best grouping is always the starting
        one or one that differs from it only at ``b``."""
        budget = self.options.refine_budget
        for boundary in range(len(self.best.splits)):
            splits = self.best.splits
            low = splits[boundary - 1] if boundary > 0 else 0
            high = splits[boundary + 1] if boundary + 1 < len(splits) else len(self.sizes)
            step = max(splits[boundary] - low, high - splits[boundary]) // 2
            while step > 0 and budget > 0:
                here = self.best.splits[boundary]
                for moved in (here - step, here + step):
                    candidate = splits[:boundary] + (moved,) + splits[boundary + 1:]
                    if low < moved < high and budget > 0:
                        budget -= candidate not in self._times
                        yield from self._measure(candidate)
                step //= 2


@dataclass
class MergeCompResult:
    """What the scheduler chose and what choosing cost.

    Attributes:
        order: parameter names in the order their gradients became ready (agreed across ranks).
        sizes: their element counts.
        splits: the chosen split points of ``order``.
        seconds: the chosen grouping's agreed time per step (mean of its measurements).
        trials: every measurement, ``(splits, seconds)``, in order.
        search_steps: training steps spent searching (the dense recording step included).
        search_seconds: wall time of those steps on this rank.
        from_cache: True when the grouping was read from the cache file, not searched.
    """

    order: List[str]
    sizes: List[int]
    splits: Splits
    seconds: float
    trials: List[Trial]
    search_steps: int
    search_seconds: float
    from_cache: bool = False

    @property
    def groups(self) -> List[List[str]]:
        """The chosen groups, as parameter names."""
        return runs_of(self.order, self.splits)

    @property
    def search_overhead_seconds(self) -> float:
        """Time the search cost beyond running the chosen grouping for as many steps."""
        return self.search_seconds - self.search_steps * self.seconds

    def as_dict(self) -> Dict[str, Any]:
        """JSON-serialisable record (also the cache file's content)."""
        record = asdict(self)
        record["splits"] = list(self.splits)
        record["trials"] = [{"splits": list(t.splits), "seconds": t.seconds} for t in self.trials]
        record["groups"] = self.groups
        record["search_overhead_seconds"] = self.search_overhead_seconds
        return record

    @classmethod
    def from_dict(cls, record: Dict[str, Any]) -> "MergeCompResult":
        """Inverse of :meth:`as_dict` (extra keys ignored)."""
        return cls(order=list(record["order"]), sizes=[int(s) for s in record["sizes"]],
                   splits=tuple(int(s) for s in record["splits"]), seconds=float(record["seconds"]),
                   trials=[Trial(tuple(t["splits"]), float(t["seconds"])) for t in record["trials"]],
                   search_steps=int(record["search_steps"]), search_seconds=float(record["search_seconds"]),
                   from_cache=bool(record.get("from_cache", False)))
