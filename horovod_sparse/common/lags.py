"""LAGS-SGD (Shi et al., ECAI 2020): options, the per-group density rule, and the measurement of
the backward computation each group's communication can hide under.

Layer groups are exchanged from the backward hooks as soon as they are complete, so the
communication of group ``l`` overlaps the backward pass of the layers still to run. LAGS gives
each group the density whose allgather just fits under that remaining computation ``t_comp``:

    rho_l = (t_comp - alpha * log2 n) / (2 (n - 1) * beta' * m)

for a group of ``m`` elements, with the alpha-beta model of
:mod:`horovod_sparse.common.cost_model` measured on the running cluster (``beta'`` per 4-byte
element; :func:`lags_density` writes it per byte with the pair size explicit) and ``rho_l``
floored at the global density and capped. The published code ships this rule switched off; here
it is on by default (``adaptive=False`` gives the reference's uniform density).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from horovod_sparse.common.cost_model import INDEX_BYTES, VALUE_BYTES, AlphaBeta
from horovod_sparse.common.grouping import StepTimeline
from horovod_sparse.common.options import SparsifierOptions
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
    max_density: float = 0.1
    measure_steps: int = 3

    def _validate(self) -> None:
        object.__setattr__(self, "group_size", check_int("group_size", self.group_size, minimum=1))
        check_bool("adaptive", self.adaptive)
        object.__setattr__(self, "max_density", check_fraction("max_density", self.max_density))
        object.__setattr__(self, "measure_steps", check_int("measure_steps", self.measure_steps, minimum=1))


def lags_density(t_comp: float, model: AlphaBeta, numel: int, floor: float, cap: float,
                 pair_bytes: int = VALUE_BYTES + INDEX_BYTES) -> float:
    """The LAGS density of a group of ``numel`` elements whose communication may take ``t_comp``
    seconds: ``(t_comp - alpha log2 n) / ((n - 1) beta pair_bytes numel)``, clipped to
    ``[floor, max(floor, cap)]``.

    With ``pair_bytes = 8`` (float32 value + int32 index) and ``beta`` per byte this is the
    paper's ``(t_comp - alpha log2 n) / (2 (n - 1) beta' m)`` with ``beta' = 4 beta`` per element.
    No time left after the latency gives the floor; a free network (``beta = 0``) or a single
    worker gives the cap.
    """
    cap = max(floor, cap)
    budget = t_comp - model.alpha * model.log2n
    if model.workers == 1 or (budget > 0 and model.beta == 0.0):
        return cap
    if budget <= 0:
        return floor
    rho = budget / ((model.workers - 1) * model.beta * pair_bytes * numel)
    return min(cap, max(floor, rho))


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
