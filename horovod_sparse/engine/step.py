"""One step of a model's groups, run the same way under every front end.

A front end knows where gradients come from and where updates go; the :class:`StepEngine` runs
the rest of a step, in this order, whatever the front end:

1. **plan** each group as it becomes ready (:meth:`StepEngine.plan`): sparse, or dense for the
   step (the front end's reason: warm-up, MergeComp's recording, DDP's first step), below
   ``min_numel``, or in two tiers too small to give every rank of a node a slice; the elements
   this rank's method exchanges (its slice in two tiers) and the target; the group's statistics;
2. **start** a sparse group (:meth:`StepEngine.start_sparse`): its communicators (flat or two
   tiers, :mod:`horovod_sparse.engine.topology`), its method state, its ``x = g + e`` loaded by
   the front end, the zeroed update buffer and the exchange's first collectives; a dense one
   (:meth:`StepEngine.start_dense`) through the front end's own dense exchange;
3. **finish** the groups in an order every rank shares (:meth:`StepEngine.finish`, or one by
   one with :meth:`StepEngine.finish_one`), sparse results into their groups' buffers, scaled
   back by the loss scale;
4. **agree** on non-finite gradients over the job (:meth:`StepEngine.ranks_with_nonfinite`) and
   **abandon** the step everywhere if a rank saw one (:meth:`StepEngine.abandon`: every residual
   gets back what the step delivered);
5. **close** the step (:meth:`StepEngine.close`): the method's and MergeComp's end of step, the
   statistics, the step counter.

Nothing here reads a value on the host that the step keeps on a device (the finiteness flags,
device timings and deferred figures are read once, when the step closes, by the front end's
``read_scalars``), and nothing imports a framework: groups, communicators and tensors are the
front end's (:mod:`horovod_sparse.torch_core`, :mod:`horovod_sparse.tensorflow`).
"""
from __future__ import annotations

from typing import IO, Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

from horovod_sparse.common.grouping import ReadyTimeline
from horovod_sparse.common.stats import (GroupStats, ReadScalars, StatsLog, StepStats, finish_step, read_each,
                                         read_figures)
from horovod_sparse.common.tiers import Tiers, exchanged_numel
from horovod_sparse.engine.inflight import Inflight
from horovod_sparse.engine.model_state import ModelState
from horovod_sparse.engine.topology import group_communicators, start_exchange
from horovod_sparse.methods.base import Exchange, Step


class EngineSteps:
    """What a front end built on a :class:`StepEngine` (its ``_engine``) says of its steps."""

    _engine: StepEngine

    @property
    def steps(self) -> int:
        """The steps closed so far."""
        return self._engine.steps

    @property
    def last_stats(self) -> Optional[StepStats]:
        """The last closed step's statistics (``abandoned`` after a non-finite gradient)."""
        return self._engine.last_stats


class GroupPlan(NamedTuple):
    """How one group is exchanged this step: ``sparse`` or not, over ``tiers`` (None: flat), the
    ``numel`` elements this rank's method exchanges (its slice in two tiers) and the ``target``."""

    sparse: bool
    tiers: Optional[Tiers]
    numel: int
    target: int


class StepEngine:
    """One model's exchange, step after step (the module docstring).

    Args:
        compression: a horovod_sparse sparsifier, or the front end's dense compression.
        model: the model's :class:`ModelState` (method state per group, checkpoints, agreement).
        communicator: the transport's communicator class (``TorchCommunicator``'s constructor).
        process_set: the front end's process set (a Horovod process set, a ``ProcessGroup``).
        stats_log: a text stream receiving one JSON line of statistics per step, or None.
        read_scalars: reads the figures a step left on a device, all at once (None: on the host).

    A front end that counts and settles its steps itself (TensorFlow: its step number is a
    variable, a tensor inside a traced step, and a traced step publishes its statistics when it
    runs) starts each step with :meth:`begin` and never calls :meth:`close`.

    Attributes:
        steps: the steps closed so far (the ``step`` the methods see).
        last_stats: the statistics of the last closed step.
        tiers: the two-tier exchange's sets (None: flat; set by the front end).
        timeline: when the groups became ready, step after step (LAGS and MergeComp read it).
        flights: the groups started this step, in start order.
    """

    def __init__(self, compression: Any, model: ModelState, communicator: Callable[..., Any], process_set: Any,
                 stats_log: Optional[IO[str]] = None, read_scalars: Optional[ReadScalars] = None) -> None:
        self.compression = compression
        self.sparse = model.sparse
        self.model = model
        self.communicator = communicator
        self.process_set = process_set
        self.read_scalars = read_scalars
        self._stats_log = StatsLog(stats_log) if stats_log is not None else None
        self.tiers: Optional[Tiers] = None
        self.timeline = ReadyTimeline()
        self._timeline_placed = False
        self.steps = 0
        self.last_stats: Optional[StepStats] = None
        self.stats = StepStats(step=0)
        self.flights: List[Any] = []

    def place_timeline(self, make: Callable[[], ReadyTimeline]) -> None:
        """Time the groups' readiness with ``make()`` from now on (the front end's device clock,
        known from its first gradient: CUDA events on a GPU); once."""
        if not self._timeline_placed:
            self._timeline_placed = True
            self.timeline = make()

    @property
    def step(self) -> Step:
        """The number of the step being run, as the methods see it: :attr:`steps`, or what
        :meth:`begin` was given."""
        return self.stats.step

    def begin(self, step: Step) -> None:
        """Run step ``step`` next (an int, or a scalar tensor where the step is traced), with
        fresh statistics and no flights: for a front end that counts its steps itself."""
        self.stats = StepStats(step=step)
        self.flights = []

    # -- one group ----------------------------------------------------------------------------------
    def takes_sparse(self, numel: int, dense_step: bool, kept_dense: bool) -> bool:
        """Whether a group of ``numel`` elements is exchanged sparsely: not in a step the front
        end takes dense (``dense_step``: warm-up, MergeComp's recording, DDP's first step), not
        holding parameters ``dense=`` keeps dense (``kept_dense``), not below ``min_numel``, and
        in two tiers large enough to give every rank of a node a slice."""
        return (self.sparse and not dense_step and not kept_dense and numel >= self.compression.options.min_numel
                and (self.tiers is None or self.tiers.splits(numel)))

    def plan(self, name: str, numel: int, dense_step: bool, kept_dense: bool = False) -> Tuple[GroupPlan, GroupStats]:
        """How group ``name`` of ``numel`` elements is exchanged this step (:meth:`takes_sparse`)
        and its statistics, noted in the step's."""
        sparse = self.takes_sparse(numel, dense_step, kept_dense)
        tiers = self.tiers if sparse else None
        exchanged = exchanged_numel(tiers, numel)
        target = self.compression.count(exchanged, self.step) if sparse else exchanged
        stats = GroupStats(name, exchanged, target, dense=not sparse, kept_dense=kept_dense)
        self.stats.groups.append(stats)
        return GroupPlan(sparse, tiers, exchanged, target), stats

    def start_sparse(self, group: Any, plan: GroupPlan, stats: GroupStats, size: int, rank: int, scale: float,
                     device: Any, load: Callable[[], Any]) -> Inflight:
        """Start ``group``'s sparse exchange over ``size`` ranks (this one ``rank``), its update
        scaled by ``scale``: the communicators, the method state, ``x = load()`` (the front end
        adds the gradient into the group's residual), the zeroed update buffer, the first
        collectives. The flight is kept for :meth:`finish`."""
        comm, node = group_communicators(self.communicator, self.process_set, size, rank, plan.tiers,
                                         group.collective_name, stats, scale, device, self.step)
        state = self.model.method_state(group, comm.size, plan.numel)
        with comm.timer("flatten"):
            x = load()
            comm.output_buffer = group.zeroed_output()
        for each in (comm, node):
            if each is not None:
                each.follow(x)
        return self._launch(Inflight(start_exchange(self.compression, x, comm, node, plan.tiers, state, self.step),
                                     comm, group))

    def start_dense(self, group: Any, stats: GroupStats, size: int, rank: int, scale: float, device: Any,
                    exchange: Callable[[Any], Exchange]) -> Inflight:
        """Start ``group``'s dense exchange over the front end's process set (``size`` ranks, this
        one ``rank``): ``exchange(comm)``, the front end's dense exchange generator over a
        communicator scaling by ``scale`` (it returns the update, or ``(update, None)``)."""
        comm = self.communicator(self.process_set, group.collective_name, stats, scale, size, rank, device, self.step)
        return self._launch(Inflight(exchange(comm), comm, group, sparse=False))

    def keep(self, flight: Any) -> None:
        """Keep a dense flight the front end launched itself (its ``finish()`` writes the result;
        ``sparse`` False), to finish with the others."""
        self.flights.append(flight)

    def _launch(self, flight: Inflight) -> Inflight:
        flight.advance()
        self.flights.append(flight)
        return flight

    def finish_one(self, flight: Any, scale: Optional[Any] = None) -> Any:
        """Finish ``flight``: a sparse group's ``(update, residual)`` kept as its output and residual,
        the output multiplied by ``scale`` (a loss scale the gradients were divided by) and
        returned; a dense one's result as its exchange returns it."""
        result = flight.finish()
        if not flight.sparse:
            return result[0] if isinstance(result, tuple) else result
        flight.group.take_result(*result)
        if scale is not None:
            flight.group.scale_output(scale)
        return flight.group.output

    def finish(self, order: Optional[Callable[[Any], Any]] = None) -> List[Any]:
        """:meth:`finish_one` every flight of the step, sorted by ``order`` (a key of a flight;
        default: start order), and return them in that order. The order must be the same on
        every rank: a multi-round exchange waits for collectives the other ranks launch only
        when they reach the same group."""
        flights = self.flights if order is None else sorted(self.flights, key=order)
        for flight in flights:
            self.finish_one(flight)
        return flights

    # -- the end of a step ----------------------------------------------------------------------------
    def read_with_figures(self, scalars: List[Any]) -> List[Any]:
        """The values of ``scalars`` (the front end's finiteness flags left on a device), read
        in one go with the step's statistics figures still on a device (the groups finished by
        now), so that the end of a step reads a device once
        (:func:`~horovod_sparse.common.stats.read_figures`)."""
        return read_figures(self.stats, self.read_scalars or read_each, scalars)

    def ranks_with_nonfinite(self, policy: Optional[str], nonfinite_here: Sequence[str],
                             reporting: Callable[[int], List[int]]) -> List[int]:
        """The ranks that saw a non-finite gradient this step, from ``reporting(count)`` (the
        transport's collective of every rank's count; this rank's: ``len(nonfinite_here)``).
        Under no ``nonfinite`` policy (``policy`` None, the same on every rank: nothing was
        checked) there is nothing to agree on: no ranks, and ``reporting`` is not called."""
        if policy is None:
            return []
        return reporting(len(nonfinite_here))

    def abandon(self) -> List[Any]:
        """Abandon the step: every sparse group's residual gets back what the step delivered (each
        rank's finite gradient stays in it); the step is marked abandoned. Returns the step's
        flights, whose results the front end replaces (NaN for a loss scaler, zero or NaN else)."""
        for flight in self.flights:
            if flight.sparse:
                flight.comm.undo_deliveries()
        self.stats.abandoned = True
        return self.flights

    def close(self, end_step: Callable[[Any], None]) -> StepStats:
        """Close the step on every rank, outside the backward hooks: ``end_step(timeline)`` (the
        model's end of step: the method's measurements, MergeComp), the statistics settled and
        logged, the counter advanced. Returns the step's statistics (``last_stats``)."""
        end_step(self.timeline.end_step())
        self.last_stats = finish_step(self.stats, self._stats_log, self.read_scalars)
        self.steps += 1
        self.stats = StepStats(step=self.steps)
        self.flights = []
        return self.last_stats

    def restart_at(self, steps: int) -> None:
        """Continue counting from ``steps`` (a loaded checkpoint's)."""
        self.steps = steps
        self.stats = StepStats(step=steps)
