"""How parameters are grouped into flat buffers: flat buckets bounded in bytes, per tensor, whole
model, N groups, fixed-size merging, explicit lists; and when each group becomes ready during the
backward pass.

Grouping is an axis of its own, independent of what is selected: every sparsifier works on
whatever groups this module forms. Groups are contiguous runs of an order that is the same on
every rank (the parameter order unless told otherwise), and never mix dtypes or devices (a flat
buffer has one of each). The MergeComp scheduler (:mod:`horovod_sparse.common.mergecomp`) chooses
its groups as explicit lists, in the order gradients became ready.

:class:`ReadyTimeline` records when gradients and groups become ready during backward; LAGS
reads from it how much backward computation is left to hide each group's communication, and
MergeComp the order gradients become ready and the step times.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Union

from horovod_sparse.common.validation import check_int

#: Named strategies accepted by ``groups=`` besides an int, ``"size:N"``, ``"buckets:M"`` or
#: explicit lists.
STRATEGIES = ("buckets", "tensor", "model")
#: Prefix of the fixed-size merging strategy: ``"size:8192"``.
SIZE_PREFIX = "size:"
#: Prefix of the bucket strategy with its cap in MiB: ``"buckets:25"``.
BUCKETS_PREFIX = "buckets:"
#: The buckets' default cap in bytes: DDP's ``bucket_cap_mb=25``.
BUCKET_CAP_BYTES = 25 * 2 ** 20


@dataclass(frozen=True)
class ParamInfo:
    """What grouping needs to know of a parameter: its name, size, buffer kind (dtype and device,
    as a string; parameters of different kinds never share a group) and bytes per element."""

    name: str
    numel: int
    kind: str
    itemsize: int = 4


@dataclass(frozen=True)
class Buckets:
    """Flat buckets bounded in bytes, as DDP's buckets and Horovod's fusion buffer: parameters
    taken in reverse order (the order backward produces their gradients, roughly, so the first
    bucket is complete, and leaves, while backward still runs: DDP's order before it has seen a
    step), a bucket closed before a parameter that would take it over ``cap_bytes`` (a parameter
    larger than the cap is a bucket of its own). Each bucket lists its parameters in parameter
    order. Written ``"buckets"`` (25 MiB, DDP's default) or ``"buckets:M"`` (M MiB) where a string
    is expected (M may have a fraction)."""

    cap_bytes: int = BUCKET_CAP_BYTES

    def __post_init__(self) -> None:
        check_int("bucket cap in bytes", self.cap_bytes, minimum=1)

    def __str__(self) -> str:
        mib, rest = divmod(self.cap_bytes, 2 ** 20)
        return f"{BUCKETS_PREFIX}{mib}" if not rest else f"Buckets(cap_bytes={self.cap_bytes})"

    @classmethod
    def parse(cls, text: str) -> "Buckets":
        """``"buckets"`` -> ``Buckets()``, ``"buckets:4"`` -> 4 MiB buckets (``M`` may have a
        fraction, as DDP's ``bucket_cap_mb``; the cap is ``int(M * 2**20)`` bytes), with an error
        naming the expected form."""
        if text == "buckets":
            return cls()
        try:
            mib = float(text[len(BUCKETS_PREFIX):]) if text.startswith(BUCKETS_PREFIX) else math.nan
        except ValueError:
            mib = math.nan
        if not (math.isfinite(mib) and mib * 2 ** 20 >= 1):
            raise ValueError(f"groups={text!r}: the bucket strategy is written 'buckets' (25 MiB, as DDP) or "
                             f"'buckets:M' with M the cap of a bucket in MiB (a number, at least one byte), "
                             f"e.g. 'buckets:25'")
        return cls(int(mib * 2 ** 20))

    def runs(self, sizes: Sequence[int]) -> List[List[int]]:
        """Positions ``0..len(sizes)-1`` (``sizes`` in bytes) cut into buckets, last position first."""
        runs: List[List[int]] = []
        total = 0
        for position in reversed(range(len(sizes))):
            if runs and total + sizes[position] <= self.cap_bytes:
                runs[-1].append(position)
                total += sizes[position]
            else:
                runs.append([position])
                total = sizes[position]
        return [run[::-1] for run in runs]


@dataclass(frozen=True)
class MergeBySize:
    """Fixed-size merging: adjacent parameters are merged until a group holds at least
    ``threshold`` elements (a parameter at least that large is a group of its own; a trailing
    run below the threshold stays a group). LAGS-SGD's grouping, reference threshold 8192.
    Written ``"size:8192"`` where a string is expected."""

    threshold: int

    def __post_init__(self) -> None:
        check_int("size threshold", self.threshold, minimum=1)

    def __str__(self) -> str:
        return f"{SIZE_PREFIX}{self.threshold}"

    @classmethod
    def parse(cls, text: str) -> "MergeBySize":
        """``"size:8192"`` -> ``MergeBySize(8192)``, with an error naming the expected form."""
        number = text[len(SIZE_PREFIX):]
        if not number.isdigit():
            raise ValueError(f"groups={text!r}: the size strategy is written 'size:N' with N the "
                             f"minimum number of elements per group, e.g. 'size:8192'")
        return cls(int(number))


GroupSpec = Union[None, int, str, MergeBySize, Buckets, Sequence[Sequence[int]]]


def split_evenly(items: Sequence[int], parts: int) -> List[List[int]]:
    """Split ``items`` into ``parts`` contiguous runs whose lengths differ by at most one, the
    longer first (Horovod's ``split_list`` semantics); empty runs are dropped."""
    size, extra = divmod(len(items), parts)
    runs = [list(items[i * size + min(i, extra):(i + 1) * size + min(i + 1, extra)]) for i in range(parts)]
    return [r for r in runs if r]


def merge_by_size(sizes: Sequence[int], threshold: int) -> List[List[int]]:
    """Positions ``0..len(sizes)-1`` cut into contiguous runs, each closed as soon as its total
    size reaches ``threshold`` (the last run may stay below it)."""
    runs: List[List[int]] = []
    current: List[int] = []
    total = 0
    for position, size in enumerate(sizes):
        current.append(position)
        total += size
        if total >= threshold:
            runs.append(current)
            current, total = [], 0
    if current:
        runs.append(current)
    return runs


def split_by_kind(indices: Sequence[int], params: Sequence[ParamInfo]) -> List[List[int]]:
    """Split a run of parameter indices wherever the buffer kind changes."""
    runs: List[List[int]] = []
    for i in indices:
        if runs and params[runs[-1][-1]].kind == params[i].kind:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def form_groups(params: Sequence[ParamInfo], spec: GroupSpec, default: GroupSpec = "tensor",
                order: Optional[Sequence[int]] = None, kept: Collection[int] = ()) -> List[List[int]]:
    """Partition parameter indices ``0..len(params)-1`` into groups.

    Args:
        params: parameters in the order gradients are flattened (identical on every rank).
        spec: ``None`` (use ``default``), ``"buckets"`` / ``"buckets:M"`` / :class:`Buckets`
            (flat buckets of at most 25 / M MiB, last parameters first), ``"tensor"`` (one group
            per parameter), ``"model"``
            (one group per buffer kind), an int ``N > 0`` (Horovod's ``groups=N``: N contiguous
            groups of nearly equal parameter count), ``"size:T"`` or :class:`MergeBySize`
            (adjacent parameters merged until a group has ``T`` elements), or explicit lists of
            indices (parameters in no list form a group each, as in Horovod; lists keep their
            order, members are sorted).
        default: the strategy used for ``None``; each method names its natural one.
        order: the order the strategies cut into contiguous runs (e.g. the order gradients
            become ready); the parameter order when None. Explicit lists ignore it.
        kept: indices of the parameters a front end keeps dense (``dense=``): left out of the
            strategy (and of explicit lists), they form one group per buffer kind of their own,
            after the others.

    Returns:
        Groups as lists of indices, in ``order``; each group has one buffer kind.
    """
    order = list(range(len(params))) if order is None else list(order)
    if sorted(order) != list(range(len(params))):
        raise ValueError("order must list every parameter index exactly once")
    kept = set(kept)
    runs = _strategy_runs(params, spec, default, [i for i in order if i not in kept], kept)
    return [g for run in runs if run for g in split_by_kind(run, params)] + _by_kind(
        [i for i in order if i in kept], params)


def _strategy_runs(params: Sequence[ParamInfo], spec: GroupSpec, default: GroupSpec, order: List[int],
                   kept: Collection[int]) -> List[List[int]]:
    """The runs ``spec`` cuts ``order`` into (before the split by buffer kind), leaving out
    ``kept``."""
    if spec is None:
        spec = default
    if isinstance(spec, str) and spec.startswith(SIZE_PREFIX):
        spec = MergeBySize.parse(spec)
    if isinstance(spec, str) and spec.startswith("buckets"):
        spec = Buckets.parse(spec)
    if isinstance(spec, Buckets):
        runs = [[order[i] for i in run] for run in spec.runs([params[i].numel * params[i].itemsize for i in order])]
    elif isinstance(spec, MergeBySize):
        runs = [[order[i] for i in run] for run in merge_by_size([params[i].numel for i in order], spec.threshold)]
    elif isinstance(spec, str):
        if spec not in STRATEGIES:
            raise ValueError(f"groups must be an int > 0, lists of parameters, 'size:N', 'buckets:M', or one of "
                             f"{', '.join(map(repr, STRATEGIES))}; got {spec!r}")
        runs = [[i] for i in order] if spec == "tensor" else [order]
    elif isinstance(spec, int) and not isinstance(spec, bool):
        runs = split_evenly(order, check_int("groups", spec, minimum=1))
    elif isinstance(spec, (list, tuple)):
        runs = [[i for i in g if i not in kept] for g in _explicit_groups(spec, len(params))]
    else:
        raise TypeError(f"groups must be None, an int, a strategy name or lists of parameters, "
                        f"got {type(spec).__name__}")
    return runs


def _by_kind(indices: Sequence[int], params: Sequence[ParamInfo]) -> List[List[int]]:
    """``indices`` as one group per buffer kind, in order of first appearance."""
    groups: Dict[str, List[int]] = {}
    for i in indices:
        groups.setdefault(params[i].kind, []).append(i)
    return list(groups.values())


def _explicit_groups(lists: Sequence[Sequence[int]], count: int) -> List[List[int]]:
    seen: set = set()
    groups: List[List[int]] = []
    for members in lists:
        group = []
        for i in members:
            if i in seen:
                raise ValueError("a parameter can only appear once in groups")
            seen.add(i)
            group.append(i)
        if group:
            groups.append(sorted(group))
    groups.extend([i] for i in range(count) if i not in seen)
    return groups


@dataclass
class StepTimeline:
    """When gradients and groups became ready in one step (seconds on this rank's clock).

    Attributes:
        param_order: parameter indices in the order their gradients became ready (the last
            backward pass of the step, with ``backward_passes_per_step > 1``).
        group_ready: group name -> when the group was complete and its exchange launched.
        launch_order: group names in the order their exchanges were launched.
        backward_end: when the last gradient of the step became ready (None if none did).
        step_end: when the step's exchanges had all finished.
        step_seconds: wall time since the previous step ended (None for the first step).
    """

    param_order: List[int] = field(default_factory=list)
    group_ready: Dict[str, float] = field(default_factory=dict)
    launch_order: List[str] = field(default_factory=list)
    backward_end: Optional[float] = None
    step_end: float = 0.0
    step_seconds: Optional[float] = None

    def backward_left(self) -> Dict[str, float]:
        """Group name -> backward computation still running after the group became ready
        (``backward_end - ready``, at least 0): the time available to hide its communication.
        Groups launched after backward (from ``synchronize()``) have 0."""
        end = self.backward_end
        return {name: 0.0 if end is None else max(0.0, end - ready) for name, ready in self.group_ready.items()}


class ReadyTimeline:
    """Records, step after step, when gradients and groups become ready during backward.

    The optimizer calls :meth:`param_ready` from its gradient hooks, :meth:`group_ready` when it
    launches a group's exchange, and :meth:`end_step` once every exchange of the step finished.
    Consumers read :attr:`last`, the record of the latest finished step.

    Args:
        clock: monotonic seconds; injectable so tests can drive time. A device clock returns
            stamps of its own (CUDA events: when the device got there, not when the host
            launched the work) and gives ``seconds`` to read them.
        seconds: a stamp of ``clock`` in seconds, called when the step ends (None: the stamps
            are seconds).
    """

    def __init__(self, clock: Callable[[], Any] = time.perf_counter,
                 seconds: Optional[Callable[[Any], float]] = None) -> None:
        self._clock = clock
        self._seconds = seconds
        self._current = StepTimeline()
        self._previous_end: Optional[float] = None
        self.last: Optional[StepTimeline] = None
        #: Steps recorded so far.
        self.steps = 0

    def param_ready(self, index: int) -> None:
        """Parameter ``index``'s gradient is final for this step."""
        now = self._clock()
        self._current.param_order.append(index)
        self._current.backward_end = now

    def group_ready(self, name: str) -> None:
        """Group ``name`` is complete and its exchange is being launched."""
        self._current.group_ready[name] = self._clock()
        self._current.launch_order.append(name)

    def backward_ended(self) -> None:
        """Every gradient of the step is final: for a front end that sees groups, not parameters
        (DDP's buckets), in place of :meth:`param_ready`."""
        self._current.backward_end = self._clock()

    def end_step(self) -> StepTimeline:
        """Close the step: its record becomes :attr:`last` and a new one starts."""
        record, self._current = self._current, StepTimeline()
        record.step_end = self._clock()
        if self._seconds is not None:
            record.group_ready = {name: self._seconds(stamp) for name, stamp in record.group_ready.items()}
            record.backward_end = None if record.backward_end is None else self._seconds(record.backward_end)
            record.step_end = self._seconds(record.step_end)
        if self._previous_end is not None:
            record.step_seconds = record.step_end - self._previous_end
        self._previous_end = record.step_end
        self.last = record
        self.steps += 1
        return record
