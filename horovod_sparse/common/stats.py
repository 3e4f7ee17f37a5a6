"""Per-step sparsification statistics: what was selected, what reached the model, what moved.

Byte counts are *payload* bytes per rank: ``*_sent`` is what this rank contributed to the
collectives, ``*_received`` what it got from the other ranks. They do not include the
transport's own overhead (a ring allgather forwards other ranks' chunks too); the cost model in
the benchmarks turns payloads into wire time.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

#: What a byte count is: the method's values, indices and metadata (across nodes in a two-tier
#: exchange, across all ranks in a flat one) and ``node``, the dense collectives inside a node
#: of a two-tier exchange (:mod:`horovod_sparse.common.tiers`).
BYTE_KINDS = ("values", "indices", "meta", "node")


@dataclass
class GroupStats:
    """Statistics of one group (flat buffer) in one step.

    Attributes:
        name: group name (the first parameter's name, or ``model`` for the whole model).
        numel: elements in the group.
        target: target count ``k`` (equal to ``numel`` for dense groups).
        selected: coordinates this rank selected and sent (beyond a capacity: ``extra["overflow"]``).
        union: distinct coordinates that reached the model (the aggregated update's support).
            Both may be 0-dim tensors left on a device until the step's figures are read
            (:func:`read_figures`); ``union`` may also be :class:`Deferred`, worked out only
            when the step's statistics are read (:func:`read_deferred`).
        dense: True when the group went through a dense allreduce (warm-up, small group,
            dense compressor, kept dense).
        kept_dense: True when the group holds parameters the front end's ``dense=`` keeps
            dense (:mod:`horovod_sparse.common.dense_choice`): dense at every step.
        sent / received: payload bytes per kind (:data:`BYTE_KINDS`: ``values``, ``indices``, ``meta``,
            ``node``).
        seconds: wall time per phase (``select``, ``communicate``, ``apply``, ...).
        collectives: number of collective operations issued.
        extra: method-specific figures (threshold, load_inc, padding, rounds, ...).
    """

    name: str
    numel: int
    target: int
    selected: int = 0
    union: int = 0
    dense: bool = False
    kept_dense: bool = False
    sent: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(BYTE_KINDS, 0))
    received: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(BYTE_KINDS, 0))
    seconds: Dict[str, float] = field(default_factory=dict)
    collectives: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        #: Phases timed on a device whose time is known only once its work is done.
        self._pending: List[Tuple[str, Callable[[], float]]] = []
        #: ``extra`` figures still on a device (0-dim or 1-D tensors), read when the step finishes.
        self.unread: Dict[str, Any] = {}
        #: What runs once those figures are read (:meth:`when_read`).
        self._when_read: List[Callable[["GroupStats"], None]] = []

    def note(self, name: str, value: Any) -> None:
        """Set the figure ``extra[name]``: a Python number, or a 0-dim tensor (a 1-D one: a list)
        left on a device, read with the step's other figures (:func:`finish_step`) rather than at
        once."""
        if isinstance(value, (int, float)):
            self.extra[name] = value
        else:
            self.unread[name] = value

    def add_time(self, phase: str, seconds: float) -> None:
        """Accumulate ``seconds`` under ``phase``."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def add_pending_time(self, phase: str, seconds: Callable[[], float]) -> None:
        """Accumulate ``seconds()`` under ``phase`` when the step is finished (:meth:`settle`):
        a device phase, whose end is known only once the device got there."""
        self._pending.append((phase, seconds))

    def when_read(self, callback: Callable[["GroupStats"], None]) -> None:
        """Call ``callback(self)`` when the step is finished (:meth:`settle`), its figures read
        into :attr:`extra`: a method's state decided from figures left on a device (MiCRO's
        counts and threshold) is updated then, before the next step, without a read of its own."""
        self._when_read.append(callback)

    def settle(self) -> None:
        """Add the pending device phases' times (waiting for the device where they are not done),
        then run the :meth:`when_read` callbacks, in order."""
        for phase, seconds in self._pending:
            self.add_time(phase, seconds())
        self._pending.clear()
        callbacks, self._when_read = self._when_read, []
        for callback in callbacks:
            callback(self)


@dataclass
class StepStats:
    """All groups of one optimizer step, with the model-level figures derived from them."""

    step: int
    groups: List[GroupStats] = field(default_factory=list)
    #: True when the step was abandoned on every rank (a non-finite gradient somewhere).
    abandoned: bool = False

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def target_density(self) -> float:
        """Sum of target counts over all elements (dense groups count fully)."""
        return sum(g.target for g in self.groups) / max(1, self.numel)

    @property
    def local_density(self) -> float:
        """Coordinates this rank sent over all elements."""
        return sum(g.selected for g in self.groups) / max(1, self.numel)

    @property
    def union_density(self) -> float:
        """Coordinates that reached the model over all elements."""
        return sum(g.union for g in self.groups) / max(1, self.numel)

    @property
    def density_ratio(self) -> float:
        """``union / target`` over the sparse groups: 1 is on target; for allgather methods it
        is the build-up factor (up to n when no two ranks pick the same coordinate)."""
        sparse = [g for g in self.groups if not g.dense]
        return sum(g.union for g in sparse) / max(1, sum(g.target for g in sparse))

    def bytes_sent(self, kind: Optional[str] = None) -> int:
        """Payload bytes this rank sent, of one kind or all."""
        kinds = BYTE_KINDS if kind is None else (kind,)
        return sum(g.sent[k] for g in self.groups for k in kinds)

    def bytes_received(self, kind: Optional[str] = None) -> int:
        """Payload bytes this rank received, of one kind or all."""
        kinds = BYTE_KINDS if kind is None else (kind,)
        return sum(g.received[k] for g in self.groups for k in kinds)

    def seconds(self, phase: str) -> float:
        """Total wall time of ``phase`` over all groups."""
        return sum(g.seconds.get(phase, 0.0) for g in self.groups)

    def summary(self) -> Dict[str, Any]:
        """Model-level figures, JSON-serialisable."""
        phases = sorted({p for g in self.groups for p in g.seconds})
        return {
            "step": self.step,
            "abandoned": self.abandoned,
            "numel": self.numel,
            "target_density": self.target_density,
            "local_density": self.local_density,
            "union_density": self.union_density,
            "density_ratio": self.density_ratio,
            "bytes_sent": {k: self.bytes_sent(k) for k in BYTE_KINDS},
            "bytes_received": {k: self.bytes_received(k) for k in BYTE_KINDS},
            "seconds": {p: self.seconds(p) for p in phases},
            "collectives": sum(g.collectives for g in self.groups),
        }

    def as_dict(self) -> Dict[str, Any]:
        """Summary plus every group's record."""
        return {**self.summary(), "groups": [asdict(g) for g in self.groups]}


class StatsLog:
    """Writes one JSON object per step to a file (JSON lines). ``per_group`` adds group records."""

    def __init__(self, stream: IO[str], per_group: bool = False) -> None:
        self._stream = stream
        self._per_group = per_group

    def write(self, stats: StepStats) -> None:
        record = stats.as_dict() if self._per_group else stats.summary()
        self._stream.write(json.dumps(record) + "\n")
        self._stream.flush()


#: Reads figures that are not Python numbers yet (0-dim tensors left on a device, NumPy
#: scalars): their values, in order (ints for counts, floats for thresholds).
ReadScalars = Callable[[List[Any]], List[Any]]


def read_each(scalars: List[Any]) -> List[Any]:
    """:data:`ReadScalars` one at a time."""
    return [np.asarray(scalar).tolist() for scalar in scalars]


#: The counts of a :class:`GroupStats` that may be left on a device (0-dim tensors) until read.
COUNTS = ("selected", "union")


class Deferred(NamedTuple):
    """A count worked out only when the step's statistics are read (:func:`read_deferred`):
    ``compute()`` gives a Python int or a 0-dim tensor. The union of the gathered indices is one:
    marking and counting them costs operations over the whole buffer (three dispatched a group
    on an accelerator, a sort of the indices on a CPU) that a step whose statistics nobody reads
    need not pay. ``compute`` must only read tensors nothing changes afterwards (a collective's
    fresh output)."""

    compute: Callable[[], Any]


def work_out_deferred(stats: StepStats) -> bool:
    """Replace every :class:`Deferred` count of ``stats`` by what it computes (a Python int, or a
    0-dim tensor that :func:`read_figures` reads); whether there was one."""
    deferred = [(g, name) for g in stats.groups for name in COUNTS if isinstance(getattr(g, name), Deferred)]
    for group, name in deferred:
        setattr(group, name, getattr(group, name).compute())
    return bool(deferred)


def read_deferred(stats: StepStats, read_scalars: ReadScalars = read_each) -> StepStats:
    """Work out every :class:`Deferred` count of ``stats`` and read, in one call of
    ``read_scalars``, those left on a device; returns ``stats``, whose counts are then all Python
    ints. Nothing is computed or read when no count is deferred (a second call is free)."""
    if work_out_deferred(stats):
        read_figures(stats, read_scalars)
    return stats


def read_figures(stats: StepStats, read_scalars: ReadScalars, scalars: Sequence[Any] = ()) -> List[Any]:
    """Read ``scalars`` (what the front end must learn now: its finiteness flags) and every
    figure of ``stats`` not read yet (unions and ``extra`` figures left on a device) in one call
    of ``read_scalars``, so that a step reads its device once however many groups and figures it
    has; the figures go into their groups, ``scalars``' values are returned, in order. Figures a
    group notes later are read by a later call (:func:`finish_step`)."""
    unread = [(g, field) for g in stats.groups for field in COUNTS
              if not isinstance(getattr(g, field), (int, Deferred))]
    unread += [(g, name) for g in stats.groups for name in g.unread]
    if not unread and not scalars:
        return []
    values = read_scalars([*scalars, *(getattr(g, name) if name in COUNTS else g.unread[name] for g, name in unread)])
    for (group, name), value in zip(unread, values[len(scalars):]):
        if name in COUNTS:
            setattr(group, name, int(value))
        else:
            group.extra[name] = value
    for group in stats.groups:
        group.unread.clear()
    return values[:len(scalars)]


def finish_step(stats: StepStats, log: Optional[StatsLog], read_scalars: ReadScalars = read_each) -> StepStats:
    """A finished step's statistics as a front end publishes them (its ``last_stats``): every
    group's ``union`` and ``extra`` figures Python numbers (those that are not yet are read by
    ``read_scalars``, :func:`read_figures`: a front end whose figures stay on an accelerator
    passes one that reads them all in one go, not one host read per group) but the
    :class:`Deferred` counts, groups settled (:meth:`GroupStats.settle`), sorted by name, and
    written to ``log`` when there is one (the deferred counts worked out first,
    :func:`read_deferred`)."""
    read_figures(stats, read_scalars)
    for group in stats.groups:
        group.settle()
    stats.groups.sort(key=lambda g: g.name)
    if log is not None:
        log.write(read_deferred(stats, read_scalars))
    return stats
