"""The MergeComp scheduler (``groups="mergecomp"``), written once for every front end.

:class:`MergeCompScheduler` runs inside a front end (PyTorch's ``DistributedOptimizer``,
TensorFlow's tape and Keras optimizer): the front end exchanges its first step dense while it
records the order gradients become ready, then hands the scheduler every finished step; the
scheduler times candidate groupings proposed by
:class:`~horovod_sparse.common.mergecomp.SplitSearch`, with step times agreed across ranks, and
tells the front end which grouping to use next. The user's optimizer applies every step; the
front end carries the residuals over exactly from one grouping to the next and applies
``residual_decay``.
"""
from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from horovod_sparse.common.consensus import state_of_rank
from horovod_sparse.common.grouping import StepTimeline
from horovod_sparse.common.measurements import agree_order, agree_seconds
from horovod_sparse.common.mergecomp import MergeCompOptions, MergeCompResult, SplitSearch, runs_of


class MergeCompScheduler:
    """Chooses the optimizer's grouping during training (one instance per optimizer).

    Life cycle, driven by :meth:`after_step` once per finished step on every rank:

    1. *recording* (the first step): the optimizer exchanges every gradient dense; the order they
       became ready is agreed across ranks (the first rank's). A cached result matching the
       parameters is taken now, skipping the search.
    2. *searching*: each candidate grouping runs ``warmup_steps + timed_steps`` steps; the median
       of the timed step times, averaged over ranks, is its time.
    3. *done*: the grouping the search chose stays; :attr:`result` holds it, every candidate's
       times and the search cost (also when it was restored from a checkpoint, :meth:`restore`).

    Args:
        options: the scheduler's options.
        names: parameter names, in the optimizer's parameter order.
        sizes: their element counts.
        process_set: the optimizer's process set (timings are agreed over it).
        backend: the framework's backend module (its collectives agree the measurements).
    """

    def __init__(self, options: MergeCompOptions, names: Sequence[str], sizes: Sequence[int],
                 process_set: Any, backend: Any) -> None:
        self.options = options
        self.B = backend
        self.names = list(names)
        self.sizes = list(sizes)
        self.process_set = process_set
        self.result: Optional[MergeCompResult] = None
        self._order: List[int] = []
        self._search: Optional[SplitSearch] = None
        self._steps = 0
        self._seconds = 0.0
        self._window: List[float] = []
        #: The splits of the grouping the front end uses (None: its per-tensor recording groups).
        self._splits: Optional[Tuple[int, ...]] = None

    @property
    def recording(self) -> bool:
        """True until the ready order is known: the optimizer exchanges this step dense."""
        return self._steps == 0

    def after_step(self, record: StepTimeline) -> Optional[List[List[int]]]:
        """Account for a finished step (call on every rank, outside the backward hooks).

        Returns:
            The grouping to use from the next step on, as lists of parameter indices (in ready
            order), or None to keep the current one (also when the search settles on the grouping
            it timed last: the sparsifier's state then carries on).
        """
        if self.result is not None:
            return None
        self._steps += 1
        self._seconds += record.step_seconds or 0.0
        if self._search is None:
            return self._start(record)
        window = self._steps - 2 - len(self._search.trials) * self.options.steps_per_candidate
        if window >= self.options.warmup_steps and record.step_seconds is not None:
            self._window.append(record.step_seconds)
        if window + 1 < self.options.steps_per_candidate:
            return None
        (seconds,) = agree_seconds(self.B, [statistics.median(self._window)], self.process_set,
                                   "hs.mergecomp.time")
        self._window = []
        self._search.record(seconds)
        if self._search.candidate is not None:
            return self._switch(self._search.candidate)
        best = self._search.best
        self._finish(best.splits, best.seconds, self._search.trials, from_cache=False)
        return self._switch(best.splits)

    def restore(self, record: Dict[str, Any]) -> List[List[int]]:
        """Take a finished search's result (:meth:`MergeCompResult.as_dict`, e.g. from a
        checkpoint) instead of searching; returns the grouping to use."""
        result = MergeCompResult.from_dict(record)
        self._order = [self.names.index(name) for name in result.order]
        self._steps = result.search_steps
        self.result = result
        self._splits = result.splits
        return self._groups(result.splits)

    def _start(self, record: StepTimeline) -> Optional[List[List[int]]]:
        """End of the recording step: agree the order, take the cache or start the search."""
        seen = set(record.param_order)
        local = list(record.param_order) + [i for i in range(len(self.names)) if i not in seen]
        self._order = agree_order(self.B, local, self.process_set, "hs.mergecomp.order")
        cached = self._load_cache()
        if cached is not None:
            self._order = [self.names.index(name) for name in cached.order]
            self._finish(cached.splits, cached.seconds, cached.trials, from_cache=True)
            return self._switch(cached.splits)
        self._search = SplitSearch([self.sizes[i] for i in self._order], self.options)
        if self._search.candidate is None:
            self._finish((), float("nan"), [], from_cache=False)
            return self._switch(())
        return self._switch(self._search.candidate)

    def _switch(self, splits: Tuple[int, ...]) -> Optional[List[List[int]]]:
        """The grouping of ``splits`` to switch to, or None when it is the one in use."""
        if splits == self._splits:
            return None
        self._splits = splits
        return self._groups(splits)

    def _groups(self, splits: Tuple[int, ...]) -> List[List[int]]:
        return runs_of(self._order, splits)

    def _finish(self, splits: Tuple[int, ...], seconds: float, trials: List[Any], from_cache: bool) -> None:
        self.result = MergeCompResult(order=[self.names[i] for i in self._order],
                                      sizes=[self.sizes[i] for i in self._order], splits=tuple(splits),
                                      seconds=seconds, trials=list(trials), search_steps=self._steps,
                                      search_seconds=self._seconds, from_cache=from_cache)
        if not from_cache and self.options.cache is not None and self.process_set.rank() == 0:
            Path(self.options.cache).write_text(json.dumps(self.result.as_dict(), indent=1))

    def _load_cache(self) -> Optional[MergeCompResult]:
        """The cached result if the first rank finds one for these parameters (agreed: every rank
        takes the first rank's answer)."""
        if self.options.cache is None:
            return None
        record = None
        path = Path(self.options.cache)
        if self.process_set.rank() == 0 and path.exists():
            record = json.loads(path.read_text())
            known = dict(zip(self.names, self.sizes))
            if sorted(record.get("order", [])) != sorted(self.names) or \
                    any(known[n] != s for n, s in zip(record["order"], record["sizes"])):
                record = None
        record = state_of_rank(0, record, functools.partial(self.B.allgather_bytes, process_set=self.process_set))
        return None if record is None else MergeCompResult.from_dict(record)
