"""LAGS-SGD (Shi et al., ECAI 2020): options, the per-group density rule, and the measurement of
the backward computation each group's communication can hide under.

Layer groups are exchanged from the backward hooks as soon as they are complete, so the
communication of group ``l`` overlaps the backward pass of the layers still to run. The paper
gives each group the density whose allgather just fits under that remaining computation
``t_comp``, ``rho_l = (t_comp - alpha log2 n) / (2 (n - 1) beta' m)``, each group on its own.
That over-admits on a real machine: the groups queue on one link (a group's budget is taken by
the groups before it), and the local work grows with the density (the selection runs on the
training thread and delays every later layer; the scatter-add of the ``n k`` received pairs runs
after backward). :func:`lags_counts` prices all of it: it predicts the step
(:func:`predicted_step`) from ``t_comp``, the alpha-beta model of
:mod:`horovod_sparse.common.cost_model` and the local costs measured on the running job
(:class:`LocalCost`), walks the groups in launch order with a link clock, and gives each the
largest count that keeps the predicted time from the first group's launch to the end of the step
within ``1 + slack`` times its value at the global density. With no local cost and
``slack = 0`` a lone group gets exactly the paper's density. The published code ships the rule
switched off; here it is on by default (``adaptive=False`` gives the reference's uniform density).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from horovod_sparse.common.cost_model import AlphaBeta, LocalCost, exposed_time
from horovod_sparse.common.grouping import StepTimeline
from horovod_sparse.common.options import SparsifierOptions, target_count
from horovod_sparse.common.validation import check_bool, check_fraction, check_int

#: The reference's group size threshold: adjacent layers merge until a group has 8192 elements.
REFERENCE_GROUP_SIZE = 8192


@dataclass(frozen=True)
class LagsOptions(SparsifierOptions):
    """Options of ``Compression.lags``.

    Attributes:
        density: the global density: every group's density when the rule is off or not yet
            measured, and the floor of the adaptive densities (reference floor 0.001).
        group_size: with ``groups=None`` adjacent parameters are merged until a group has this
            many elements (reference 8192); any other ``groups=`` overrides it.
        adaptive: choose each group's density with the LAGS rule (default True; the reference
            code ships with it off).
        slack: how much longer than at the global density the rule lets the predicted time
            from the first group's launch to the end of the step become in exchange for denser
            groups (default 0.02: 2%). Extra density always costs local work, so with 0 the rule
            keeps every group at the global density unless that work is free.
        max_density: cap of the adaptive densities (the cap is ``max(density, max_density)``):
            beyond about ``1/n`` an allgather of (value, index) pairs moves more than a dense
            allreduce would, whatever the overlap.
        measure_steps: steps over which each group's remaining backward time is averaged
            (after the first step, which pays one-off costs) before the rule applies; the
            measurement restarts when the grouping changes.
    """

    density: float = 0.001
    group_size: int = REFERENCE_GROUP_SIZE
    adaptive: bool = True
    slack: float = 0.02
    max_density: float = 0.1
    measure_steps: int = 3

    def _validate(self) -> None:
        object.__setattr__(self, "group_size", check_int("group_size", self.group_size, minimum=1))
        check_bool("adaptive", self.adaptive)
        object.__setattr__(self, "slack", check_fraction("slack", self.slack, allow_zero=True))
        object.__setattr__(self, "max_density", check_fraction("max_density", self.max_density))
        object.__setattr__(self, "measure_steps", check_int("measure_steps", self.measure_steps, minimum=1))


@dataclass(frozen=True)
class LagsGroup:
    """One group as the rule sees it: its ``name``, ``numel`` elements and the backward time
    ``t_comp`` left after it was launched (measured at the global density)."""

    name: str
    numel: int
    t_comp: float


def predicted_step(groups: Sequence[LagsGroup], counts: Sequence[int], floor: Sequence[int],
                   model: AlphaBeta, local: LocalCost) -> float:
    """The step's end, in seconds after the measured end of backward, when the groups (in launch
    order) send ``counts`` instead of the ``floor`` counts they were measured at.

    Group ``l`` is launched ``t_comp_l`` before the measured end of backward, later by the extra
    selection time of the groups launched before it; its allgather of ``counts[l]`` pairs starts
    once its own selection is done and the link is free, in launch order (:func:`exposed_time`
    without fusion, so that the prediction never decreases as a count grows). Backward ends
    later by every group's extra selection time; the step ends when both backward and the link
    are done, plus the scatter-add of the ``n * counts`` received pairs.
    """
    shift, jobs = 0.0, []
    latency = model.allgather(0)
    for group, count, measured in zip(groups, counts, floor):
        launch = shift - group.t_comp
        jobs.append((launch + local.select(group.numel, count), latency, model.sparse_allgather(count) - latency))
        shift += local.select_pair * (count - measured)
    applied = local.apply_pair * model.workers * sum(counts)
    return shift + exposed_time(jobs, shift, fuse=False) + applied


def lags_counts(groups: Sequence[LagsGroup], model: AlphaBeta, local: LocalCost, floor: float, cap: float,
                slack: float) -> List[int]:
    """The count each group (in launch order) sends: at least ``target_count(floor, m)``, at most
    ``target_count(max(floor, cap), m)``. The groups are walked in launch order, each given the
    largest count for which :func:`predicted_step` (later groups still at the floor) exceeds the
    prediction ``P`` at the floor counts by at most ``slack * (max t_comp + P)``, a fraction of
    the time from the first group's launch to the end of the step at the floor (the prediction
    grows with every count, so a binary search finds it).
    Costs ``O(L^2 log m)`` for ``L`` groups; the result is a function of
    its arguments, so ranks that agree on them agree on it.
    """
    lowest = [target_count(floor, g.numel) for g in groups]
    highest = [target_count(max(floor, cap), g.numel) for g in groups]
    base = predicted_step(groups, lowest, lowest, model, local)
    budget = base + slack * (max((g.t_comp for g in groups), default=0.0) + base)
    counts = list(lowest)
    for i in range(len(groups)):
        low, high = lowest[i], highest[i]
        while low < high:
            mid = (low + high + 1) // 2
            counts[i] = mid
            if predicted_step(groups, counts, lowest, model, local) <= budget:
                low = mid
            else:
                high = mid - 1
        counts[i] = low
    return counts


class BackwardTimeMeter:
    """Averages each group's remaining backward time (``t_comp``) over the first steps.

    Feed it every finished step's :class:`~horovod_sparse.common.grouping.StepTimeline`; the
    first ``skip`` steps after a (re)start are ignored (allocator warm-up, calibration), the
    next ``steps`` are averaged. A step whose set of groups differs from the one being measured
    (the grouping changed) restarts the measurement.

    Args:
        steps: steps averaged.
        skip: steps ignored first.
    """

    def __init__(self, steps: int, skip: int = 1) -> None:
        self.steps = check_int("steps", steps, minimum=1)
        self.skip = check_int("skip", skip)
        self._groups: Optional[frozenset] = None
        self._seen = 0
        self._sums: Dict[str, float] = {}

    @property
    def complete(self) -> bool:
        """True once ``steps`` steps of the current grouping have been averaged."""
        return self._seen >= self.skip + self.steps

    def add(self, record: StepTimeline) -> bool:
        """Account for one finished step; True when this step completed the measurement."""
        left = record.backward_left()
        groups = frozenset(left)
        if groups != self._groups:
            self._groups, self._seen, self._sums = groups, 0, dict.fromkeys(left, 0.0)
        if self.complete:
            return False
        self._seen += 1
        if self._seen > self.skip:
            for name, seconds in left.items():
                self._sums[name] += seconds
        return self.complete

    def state(self, per_rank: bool) -> Dict[str, Any]:
        """The measurement's progress as plain containers (for a checkpoint): the groups being
        measured and the steps seen, the same on every rank; with ``per_rank`` also this rank's
        sums of backward time, which differ between ranks until the means are agreed."""
        state: Dict[str, Any] = {"groups": None if self._groups is None else sorted(self._groups),
                                 "seen": self._seen}
        if per_rank:
            state["sums"] = dict(self._sums)

        return state

    def load_state(self, state: Dict[str, Any]) -> None:
        """Take a :meth:`state` saved here or on another rank. The progress is replaced; the sums
        too when ``state`` has them, else this rank keeps its own sums for the groups it
        measures and starts the others at zero (a rank-0 checkpoint holds no other rank's)."""
        self._groups = None if state["groups"] is None else frozenset(state["groups"])
        self._seen = state["seen"]
        sums = state.get("sums", self._sums)
        self._sums = {name: sums.get(name, 0.0) for name in sorted(self._groups or ())}


    def means(self) -> Dict[str, float]:
        """Group name -> mean remaining backward time in seconds (complete measurements only)."""
        if not self.complete:
            raise RuntimeError("the backward time measurement is not complete yet")
        return {name: total / self.steps for name, total in self._sums.items()}
