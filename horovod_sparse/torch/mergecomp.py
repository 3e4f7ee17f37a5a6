"""The PyTorch side of MergeComp (``groups="mergecomp"``), and the timing helpers shared by the
schedulers: agreeing measurements across ranks and measuring the alpha-beta cost model.

:class:`MergeCompScheduler` runs inside :class:`horovod_sparse.torch.DistributedOptimizer`:
the optimizer exchanges step 0 dense while it records the order gradients become ready, then
hands the scheduler every finished step; the scheduler times candidate groupings proposed by
:class:`~horovod_sparse.common.mergecomp.SplitSearch`, with step times agreed across ranks, and
tells the optimizer which grouping to use next. The user's optimizer applies every step, and
residuals carry over exactly from one grouping to the next.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch

from horovod_sparse.common.cost_model import AlphaBeta, calibrate
from horovod_sparse.common.grouping import StepTimeline
from horovod_sparse.common.mergecomp import MergeCompOptions, MergeCompResult, SplitSearch, runs_of
from horovod_sparse.torch.buffers import FlatGroup
from horovod_sparse.torch.collectives import allgather_json


# -- agreeing measurements across ranks ---------------------------------------------------------
def agree_seconds(values: Sequence[float], process_set: hvd.ProcessSet, name: str) -> List[float]:
    """The mean over the ranks of ``process_set`` of each of ``values``.

    Every rank allgathers its values and averages the same gathered bytes in the same order, so
    the result is bitwise identical on every rank (decisions taken from it agree).
    ``name`` names the collective and must be the same on every rank.
    """
    local = torch.tensor([list(values)], dtype=torch.float64)
    gathered = hvd.allgather(local, name=name, process_set=process_set)
    return gathered.mean(dim=0).tolist()


def agree_order(order: Sequence[int], process_set: hvd.ProcessSet, name: str) -> List[int]:
    """The first rank's ``order`` (a permutation of the same length on every rank), on every rank."""
    local = torch.tensor([list(order)], dtype=torch.int64)
    return hvd.allgather(local, name=name, process_set=process_set)[0].tolist()


def measure_cost_model(process_set: hvd.ProcessSet, sizes: Optional[Sequence[int]] = None,
                       repeats: int = 5) -> Tuple[AlphaBeta, List[Tuple[int, float]]]:
    """Fit the alpha-beta model to allgathers timed now on ``process_set`` (a collective call:
    every rank of the set must make it at the same point). See
    :func:`horovod_sparse.common.cost_model.calibrate` for ``sizes`` and ``repeats``.

    Returns:
        The model, identical on every rank, and the agreed ``(bytes_per_rank, seconds)`` samples.
    """

    def time_allgather(nbytes: int) -> float:
        payload = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        start = time.perf_counter()
        hvd.allgather(payload, name="hs.calibrate.allgather", process_set=process_set)
        return time.perf_counter() - start

    def agree(values: List[float]) -> List[float]:
        return agree_seconds(values, process_set, "hs.calibrate.agree")

    return calibrate(time_allgather, agree, process_set.size(), sizes, repeats)


# -- regrouping ----------------------------------------------------------------------------------
def carry_residuals(old: Sequence[FlatGroup], new: Sequence[FlatGroup]) -> None:
    """Give ``new`` groups the residuals ``old`` groups hold for the same parameters, so
    regrouping loses nothing. Groups whose parameters have no residual yet stay unallocated."""
    pieces: Dict[int, torch.Tensor] = {}
    for group in old:
        if group.residual is not None:
            for p, chunk in zip(group.params, group.residual.split(group.numels)):
                pieces[id(p)] = chunk
    for group in new:
        if any(id(p) in pieces for p in group.params):
            group.load_residual(torch.cat([pieces[id(p)] if id(p) in pieces else p.new_zeros(p.numel())
                                           for p in group.params]))


# -- the scheduler ------------------------------------------------------------------------------
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
    """

    def __init__(self, options: MergeCompOptions, names: Sequence[str], sizes: Sequence[int],
                 process_set: hvd.ProcessSet) -> None:
        self.options = options
        self.names = list(names)
        self.sizes = list(sizes)
        self.process_set = process_set
        self.result: Optional[MergeCompResult] = None
        self._order: List[int] = []
        self._search: Optional[SplitSearch] = None
        self._steps = 0
        self._seconds = 0.0
        self._window: List[float] = []

    @property
    def recording(self) -> bool:
        """True until the ready order is known: the optimizer exchanges this step dense."""
        return self._steps == 0

    def after_step(self, record: StepTimeline, groups: Sequence[FlatGroup]) -> Optional[List[List[int]]]:
        """Account for a finished step (call on every rank, outside the backward hooks).

        Args:
            record: the step's timeline.
            groups: the optimizer's current groups (for ``residual_decay``).

        Returns:
            The grouping to use from the next step on, as lists of parameter indices (in ready
            order), or None to keep the current one.
        """
        if self.options.residual_decay != 1.0:
            for group in groups:
                if group.residual is not None:
                    group.residual.mul_(self.options.residual_decay)
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
        (seconds,) = agree_seconds([statistics.median(self._window)], self.process_set, "hs.mergecomp.time")
        self._window = []
        self._search.record(seconds)
        if self._search.candidate is not None:
            return self._groups(self._search.candidate)
        best = self._search.best
        self._finish(best.splits, best.seconds, self._search.trials, from_cache=False)
        return self._groups(best.splits)

    def restore(self, record: Dict[str, Any]) -> List[List[int]]:
        """Take a finished search's result (:meth:`MergeCompResult.as_dict`, e.g. from a
        checkpoint) instead of searching; returns the grouping to use."""
        result = MergeCompResult.from_dict(record)
        self._order = [self.names.index(name) for name in result.order]
        self._steps = result.search_steps
        self.result = result
        return self._groups(result.splits)

    def _start(self, record: StepTimeline) -> Optional[List[List[int]]]:
        """End of the recording step: agree the order, take the cache or start the search."""
        seen = set(record.param_order)
        local = list(record.param_order) + [i for i in range(len(self.names)) if i not in seen]
        self._order = agree_order(local, self.process_set, "hs.mergecomp.order")
        cached = self._load_cache()
        if cached is not None:
            self._order = [self.names.index(name) for name in cached.order]
            self._finish(cached.splits, cached.seconds, cached.trials, from_cache=True)
            return self._groups(cached.splits)
        self._search = SplitSearch([self.sizes[i] for i in self._order], self.options)
        if self._search.candidate is None:
            self._finish((), float("nan"), [], from_cache=False)
            return self._groups(())
        return self._groups(self._search.candidate)

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
        record = allgather_json(record, "hs.mergecomp.cache", self.process_set)[0]
        return None if record is None else MergeCompResult.from_dict(record)
