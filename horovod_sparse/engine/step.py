"""One step of a model's groups, run the same way under every front end.

A front end knows where gradients come from and where updates go; the :class:`StepEngine` runs
the rest of a step, in this order, whatever the front end, in two calls:

1. :meth:`StepEngine.start`, as each group becomes ready: **plan** it (:meth:`StepEngine.plan`:
   sparse, or dense for the step: warm-up, the front end's own reason such as MergeComp's
   recording, below ``min_numel``, kept dense, or in two tiers too small to give every rank of a
   node a slice) and **start** it: a sparse group's communicators over the front end's
   :class:`~horovod_sparse.engine.topology.Transport` (flat or two tiers), its method state, its
   ``x = g + e`` loaded by the front end, the zeroed update buffer and the exchange's first
   collectives; a dense one through the front end's own dense exchange;
2. the front end **finishes** the groups in an order every rank shares (:meth:`StepEngine.finish`,
   or one by one with :meth:`StepEngine.finish_one`): sparse results into their groups' buffers,
   scaled back by the loss scale;
3. :meth:`StepEngine.end`: **read** the step's figures and finiteness flags at once, **agree** on
   non-finite gradients over the job, **abandon** the step everywhere if a rank saw one (every
   residual gets back what the step delivered), let the front end **deliver** (or replace) the
   results, **close** the step (the method's and MergeComp's end of step, the statistics, the
   step counter), and return the :class:`StepOutcome` the front end reports its own way.

TensorFlow, whose step may be traced, numbers its steps itself (:meth:`StepEngine.begin`), decides
a traced step's warm-up inside the graph (``dense_step=``), reduces the groups planned dense in one
Horovod call and settles its steps in the graph.

Nothing here reads a value on the host that the step keeps on a device (the finiteness flags,
device timings and deferred figures are read once, when the step closes, by the front end's
``read_scalars``), and nothing imports a framework: groups, communicators and tensors are the
front end's (:mod:`horovod_sparse.torch_core`, :mod:`horovod_sparse.tensorflow`).
"""
from __future__ import annotations

from typing import IO, Any, Callable, List, NamedTuple, Optional, Protocol, Tuple

from horovod_sparse.common.grouping import ReadyTimeline
from horovod_sparse.common.nonfinite import apply_nonfinite_policy
from horovod_sparse.common.stats import (GroupStats, StatsLog, StepStats, finish_step, read_deferred, read_each,
                                         read_figures, work_out_deferred)
from horovod_sparse.common.tiers import Tiers, exchanged_numel
from horovod_sparse.engine.flight import ExchangeFlight, ExchangeGroup, Flight
from horovod_sparse.engine.model_state import ModelState
from horovod_sparse.engine.topology import Transport, start_exchange
from horovod_sparse.methods.base import Exchange, Step
from horovod_sparse.methods.comm import Comm


class EngineSteps:
    """What a front end built on a :class:`StepEngine` (its ``_engine``) says of its steps."""

    _engine: StepEngine

    @property
    def steps(self) -> int:
        """The steps closed so far."""
        return self._engine.steps

    @property
    def last_stats(self) -> Optional[StepStats]:
        """The last closed step's statistics (``abandoned`` after a non-finite gradient; its
        deferred counts worked out when first read, :attr:`StepEngine.last_stats`)."""
        return self._engine.last_stats


class GroupPlan(NamedTuple):
    """How one group is exchanged this step: ``sparse`` or not, over ``tiers`` (None: flat), the
    ``numel`` elements this rank's method exchanges (its slice in two tiers) and the ``target``."""

    sparse: bool
    tiers: Optional[Tiers]
    numel: int
    target: int


class Finiteness(Protocol):
    """A step's record of its non-finite groups (``torch_core.finiteness.StepFiniteness``)."""

    def nonfinite(self, read: Callable[[List[Any]], List[Any]]) -> List[str]:
        """This rank's groups with a non-finite gradient this step (device flags read with ``read``)."""


class StepOutcome(NamedTuple):
    """How a step ended (:meth:`StepEngine.end`): the ``bad_ranks`` that saw a non-finite
    gradient (the step was abandoned on every rank when there are any), this rank's
    ``nonfinite_groups`` and the step's ``stats``."""

    bad_ranks: List[int]
    nonfinite_groups: List[str]
    stats: StepStats

    def apply_policy(self, policy: Optional[str]) -> None:
        """Report an abandoned step under the ``nonfinite`` policy: ``"raise"`` raises
        ``FloatingPointError``, ``"skip"`` warns (:func:`~horovod_sparse.common.nonfinite.apply_nonfinite_policy`);
        nothing when the step was delivered."""
        if self.bad_ranks:
            assert policy is not None, "a step is abandoned only under a nonfinite policy"
            apply_nonfinite_policy(policy, self.bad_ranks, self.stats.step, self.nonfinite_groups)


class StepEngine:
    """One model's exchange, step after step (the module docstring).

    Args:
        compression: a horovod_sparse sparsifier, or the front end's dense compression.
        model: the model's :class:`ModelState` (method state per group, checkpoints, agreement).
        transport: the front end's collectives (:class:`~horovod_sparse.engine.topology.Transport`).
        stats_log: a text stream receiving one JSON line of statistics per step, or None.
        first_dense_steps: steps exchanged dense from the first whatever the method's
            ``warmup_steps`` (DDP's first step: its buckets are final after it).

    A front end that counts and settles its steps itself (TensorFlow: its step number is a
    variable, a tensor inside a traced step, and a traced step publishes its statistics when it
    runs) starts each step with :meth:`begin` and never calls :meth:`close`.

    Attributes:
        steps: the steps closed so far (the ``step`` the methods see).
        tiers: the two-tier exchange's sets (None: flat; set by the front end).
        timeline: when the groups became ready, step after step (LAGS and MergeComp read it).
        dense_steps: the steps exchanged dense from the first (:attr:`warming_up`).
        flights: the groups started this step, in start order.
    """

    def __init__(self, compression: Any, model: ModelState, transport: Transport,
                 stats_log: Optional[IO[str]] = None, first_dense_steps: int = 0) -> None:
        self.compression = compression
        self.sparse = model.sparse
        self.model = model
        self.transport = transport
        self.read_scalars = transport.read_scalars
        #: Steps exchanged dense from the first: the method's warm-up, and at least ``first_dense_steps``.
        self.dense_steps = max(first_dense_steps, compression.options.warmup_steps) if self.sparse else 0
        self._stats_log = StatsLog(stats_log) if stats_log is not None else None
        self.tiers: Optional[Tiers] = None
        self.timeline = ReadyTimeline()
        self._timeline_placed = False
        self.steps = 0
        self._closed: Optional[StepStats] = None
        self.stats = StepStats(step=0)
        self.flights: List[Flight] = []

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
        holding parameters ``dense=`` keeps dense (``kept_dense``), not below ``min_numel``, not
        empty (an FSDP2 shard of a parameter with fewer rows than ranks sharding it: nothing to
        select), and in two tiers large enough to give every rank of a node a slice."""
        return (self.sparse and not dense_step and not kept_dense and numel >= self.compression.options.min_numel
                and numel > 0 and (self.tiers is None or self.tiers.splits(numel)))

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

    @property
    def warming_up(self) -> bool:
        """Whether this step is one of the first :attr:`dense_steps`, exchanged dense (a traced
        step, whose number is a tensor, never is: its front end decides inside the graph)."""
        return isinstance(self.step, int) and self.step < self.dense_steps

    def start(self, group: ExchangeGroup, load: Callable[[], Any], dense: Callable[[GroupStats], Flight],
              dense_step: bool = False) -> Flight:
        """Plan ``group`` (:meth:`plan`: dense while :attr:`warming_up`, for ``dense_step``, the
        front end's own reason such as MergeComp's recording, and where :meth:`takes_sparse`
        says) and start its exchange: sparsely with ``x = load()`` (:meth:`start_sparse`), else
        the front end's dense flight ``dense(stats)`` (:meth:`dense_flight`, or one of its own
        with ``finish()``, ``group`` and ``sparse = False``). Returns the flight, kept for
        :meth:`finish`."""
        plan, stats = self.plan(group.name, group.numel, dense_step or self.warming_up, group.kept_dense)
        if plan.sparse:
            return self.start_sparse(group, plan, stats, load)
        flight = dense(stats)
        self.flights.append(flight)
        return flight

    def start_sparse(self, group: ExchangeGroup, plan: GroupPlan, stats: GroupStats,
                     load: Callable[[], Any]) -> ExchangeFlight:
        """Start ``group``'s sparse exchange as ``plan`` says: the communicators, the method
        state, ``x = load()`` (the front end adds the gradient into the group's residual), the
        zeroed update buffer, the first collectives. The flight is kept for :meth:`finish`."""
        comm, node = self.transport.communicators(group, stats, plan.tiers, self.step)
        comm.shapes = group.shapes if plan.tiers is None else None
        state = self.model.states.for_group(group, comm.size, plan.numel)
        with comm.timer("flatten"):
            x = load()
            comm.output_buffer = group.zeroed_output()
        for each in (comm, node):
            if each is not None:
                each.order_after(x)
        exchange = start_exchange(self.compression, x, comm, node, plan.tiers, state, self.step)
        flight = ExchangeFlight(exchange, comm, group)
        flight.advance()
        self.flights.append(flight)
        return flight

    def dense_flight(self, group: ExchangeGroup, stats: GroupStats,
                     exchange: Callable[[Comm], Exchange]) -> ExchangeFlight:
        """``group``'s dense exchange started over the whole process set: ``exchange(comm)``, the
        front end's dense exchange generator (it returns the update), for :meth:`start`."""
        comm = self.transport.communicator_of(group, stats, self.step)
        flight = ExchangeFlight(exchange(comm), comm, group, sparse=False)
        flight.advance()
        return flight

    def finish_one(self, flight: Flight, scale: Optional[Any] = None) -> Any:
        """Finish ``flight``: a sparse group's ``(update, residual)`` kept as its output and residual,
        the output multiplied by ``scale`` (a loss scale the gradients were divided by) and
        returned; a dense one's result as its exchange returns it."""
        result = flight.finish()
        if not flight.sparse:
            return result
        flight.group.take_result(*result)
        if scale is not None:
            flight.group.scale_output(scale)
        return flight.group.output

    def finish(self, order: Optional[Callable[[Flight], Any]] = None) -> List[Flight]:
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
        (:func:`~horovod_sparse.common.stats.read_figures`); with a statistics log, which writes
        every figure, the deferred counts are worked out first and read with them."""
        if self._stats_log is not None:
            work_out_deferred(self.stats)
        return read_figures(self.stats, self.read_scalars or read_each, scalars)

    def end(self, finiteness: Finiteness, agree: Callable[[List[str]], List[int]],
            deliver: Callable[[bool], None], end_step: Callable[[Any], None]) -> StepOutcome:
        """End the step, its groups finished, in this order on every rank: this rank's non-finite
        groups read (``finiteness``, with the statistics' figures: :meth:`read_with_figures`),
        the ranks that saw one agreed (``agree(groups)``, the transport's collective; none under
        no ``nonfinite`` policy), the step abandoned everywhere if any did (:meth:`abandon`),
        else the residuals decayed (:meth:`decay_residuals`), ``deliver(abandoned)`` (the front
        end puts the results where they go, or replaces them), then closed (:meth:`close` with
        ``end_step``). The front end reports the outcome its own way
        (:meth:`StepOutcome.apply_policy`)."""
        nonfinite_groups = finiteness.nonfinite(self.read_with_figures)
        bad_ranks = agree(nonfinite_groups)
        if bad_ranks:
            self.abandon()
        else:
            self.decay_residuals()
        deliver(bool(bad_ranks))
        return StepOutcome(bad_ranks, nonfinite_groups, self.close(end_step))

    def decay_residuals(self) -> None:
        """Multiply the residual of every group exchanged sparsely this step by the method's
        ``residual_decay`` (error feedback with decay; nothing when it is 1). Not after an
        abandoned step: its residuals hold ``x = g + beta * e``, what the next step adds to."""
        decay = self.compression.residual_decay if self.sparse else 1.0
        for flight in self.flights if decay != 1.0 else []:
            if flight.sparse:
                flight.group.decay_residual(decay)

    def abandon(self) -> None:
        """Abandon the step: every sparse group's residual gets back what the step delivered (each
        rank's finite gradient stays in it); the step is marked abandoned (the front end then
        replaces the results: NaN for a loss scaler, zero or NaN else)."""
        for flight in self.flights:
            if flight.sparse:
                flight.comm.undo_deliveries()
        self.stats.abandoned = True

    def close(self, end_step: Callable[[Any], None]) -> StepStats:
        """Close the step on every rank, outside the backward hooks: ``end_step(timeline)`` (the
        model's end of step: the method's measurements, MergeComp), the statistics settled and
        logged, the counter advanced. Returns the step's statistics, their
        :class:`~horovod_sparse.common.stats.Deferred` counts not worked out yet
        (:attr:`last_stats` does that)."""
        end_step(self.timeline.end_step())
        self._closed = finish_step(self.stats, self._stats_log, self.read_scalars)
        self.steps += 1
        self.stats = StepStats(step=self.steps)
        self.flights = []
        return self._closed

    @property
    def last_stats(self) -> Optional[StepStats]:
        """The statistics of the last closed step, every count a Python int: the
        :class:`~horovod_sparse.common.stats.Deferred` ones (the union of gathered indices) are
        worked out and read, in one go, when this is first read after the step, so that a loop
        that never reads them never pays for them."""
        return None if self._closed is None else read_deferred(self._closed, self.read_scalars or read_each)

    def restart_at(self, steps: int) -> None:
        """Continue counting from ``steps`` (a loaded checkpoint's)."""
        self.steps = steps
        self.stats = StepStats(step=steps)
