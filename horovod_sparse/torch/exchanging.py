"""The gradient exchange of ``horovod_sparse.torch.DistributedOptimizer``: gradient hooks,
``backward_passes_per_step``, groups, and the step run by the step engine
(:mod:`horovod_sparse.engine.step`) over Horovod's collectives.

Hooks launch a group's exchange as its gradients become ready; ``synchronize()`` finishes every
group in group order, agrees on non-finite gradients over the process set, abandons the step
everywhere if a rank saw one and closes it; ``step()`` applies the aggregate with the wrapped
optimizer. Dense groups take Horovod's own allreduce (:mod:`horovod_sparse.torch.dense`),
``torch.sparse`` gradients Horovod's aggregation of rows (:mod:`horovod_sparse.torch.sparse_rows`).
"""
from __future__ import annotations

import functools
from typing import IO, Any, Dict, List, Optional, Sequence

import horovod.torch as hvd
import torch

from horovod_sparse.common.dense_choice import DenseSpec, chosen_dense
from horovod_sparse.common.grouping import ReadyTimeline
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.common.mergecomp import MergeCompOptions
from horovod_sparse.common.mergecomp_scheduler import MergeCompScheduler
from horovod_sparse.common.tiers import Tiers, wants_hierarchical
from horovod_sparse.common.horovod_job import in_elastic_job
from horovod_sparse.common.horovod_tiers import horovod_tiers
from horovod_sparse.engine.model_state import ModelState
from horovod_sparse.engine.step import EngineSteps, StepEngine
from horovod_sparse.engine.topology import Transport
from horovod_sparse.methods.base import Sparsifier
from horovod_sparse.torch import backend
from horovod_sparse.torch.abandoned import AbandonedStep, nan_aggregates
from horovod_sparse.torch.collectives import Communicator, agree_at_step_end, gather_places, launch_report
from horovod_sparse.torch.dense import DenseFlight, HorovodDense
from horovod_sparse.torch.parameters import (NamedParameters, Ordered, exchanged_parameters, flat_groups,
                                             hook_gradients, parameter_names)
from horovod_sparse.torch.readiness import Readiness
from horovod_sparse.torch.shared_state import SharedState
from horovod_sparse.torch.loop_calls import LoopCalls
from horovod_sparse.torch.sparse_rows import SparseRows
from horovod_sparse.torch_core.buffers import FlatGroup, carry_residuals
from horovod_sparse.torch_core.device_timing import ready_timeline
from horovod_sparse.torch_core.finiteness import StepFiniteness, Finite
from horovod_sparse.torch_core.loss_scale import LossScale, StepScale, step_scale
from horovod_sparse.torch_core.device_figures import read_scalars


class ExchangingOptimizer(SharedState, LoopCalls, EngineSteps, torch.optim.Optimizer):
    """The gradient exchange mixed into the user's optimizer class by
    :func:`horovod_sparse.torch.optimizer.DistributedOptimizer` (as Horovod does), with the
    state every rank shares (:class:`~horovod_sparse.torch.shared_state.SharedState`), the calls
    of the training loop (:class:`~horovod_sparse.torch.loop_calls.LoopCalls`: ``step()``,
    ``zero_grad()``, ...) and its ``steps`` and ``last_stats``
    (:class:`~horovod_sparse.engine.step.EngineSteps`)."""

    def __init__(self, params: Any, named_parameters: Optional[NamedParameters], compression: Any,
                 backward_passes_per_step: int, op: Any, gradient_predivide_factor: float,
                 groups: Any, sparse_as_dense: bool, process_set: hvd.ProcessSet,
                 stats_log: Optional[IO[str]], nonfinite: Optional[str], loss_scale: Optional[LossScale],
                 hierarchical: Optional[bool], dense: DenseSpec) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[misc]
        self._compression = compression
        self._sparse = isinstance(compression, Sparsifier)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self._dense = HorovodDense(compression, process_set, op, gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        self.nonfinite = nonfinite
        self._loss_scale = loss_scale
        #: This step's loss scale, read at its first sparse group (None: not yet).
        self._scale: Optional[StepScale] = None
        #: A step abandoned by synchronize() that step() has not met yet.
        self._abandoned = AbandonedStep(nonfinite, scaled=loss_scale is not None)
        names = parameter_names(self.param_groups, named_parameters)
        #: Parameter -> name, as Horovod's optimizer has it (its tests and some user code read it).
        self._parameter_names = names
        self._ordered = ordered = exchanged_parameters(self.param_groups, names)
        #: The names of the parameters kept dense (``dense=``): groups of their own, always dense.
        self._kept_dense = chosen_dense(dense, [name for name, _ in ordered])
        self._position = {p: i for i, (_, p) in enumerate(ordered)}
        mergecomp = MergeCompOptions.from_spec(groups)
        #: Method state per group, the MergeComp scheduler, checkpoints and agreement.
        self._model = ModelState(compression, backend, process_set, None if mergecomp is None else MergeCompScheduler(
            mergecomp, [name for name, _ in ordered], [p.numel() for _, p in ordered], process_set, backend))
        #: The step: plan, start, finish, abandon, close (:mod:`horovod_sparse.engine.step`).
        self._engine = StepEngine(compression, self._model, Transport(Communicator, process_set, op == hvd.Average,
                                                                      read_scalars), stats_log)
        self._engine.place_timeline(lambda: ready_timeline(ordered[0][1].device if ordered else torch.device("cpu")))
        self._groups = self._form_groups(ordered, "tensor" if mergecomp is not None else groups)
        #: This step's finiteness decisions (groups and sparse-gradient parameters).
        self._finiteness = StepFiniteness(nonfinite is not None)
        #: The agreement's allgather launched this step before the exchange finished (:meth:`_early_report`).
        self._report: Any = None
        self._readiness = Readiness([p for _, p in ordered], self._groups, backward_passes_per_step)
        self._synchronized = False
        self._should_synchronize = True
        #: The rank whose shared state every rank adopts before its next exchange (None: agreed).
        self._agree_with: Optional[int] = 0
        #: The world size and this rank at the last agreement (:meth:`_take_place`).
        self._world_size, self._rank = 0, -1
        if process_set.included():
            self._take_place()
        #: Whether this step already compared the world size with the agreed one.
        self._size_checked = False
        #: The ``torch.sparse`` gradients of the step.
        self._sparse_rows = SparseRows(names, sparse_as_dense, op, process_set,
                                       self._finiteness)
        #: In a Horovod elastic job a worker that joins builds its optimizer while the others sync
        #: their state, so the configuration check waits for the agreement, which all ranks reach
        #: together (:meth:`agree_shared_state`); elsewhere it runs here, at construction.
        self._elastic = in_elastic_job()
        #: Whether sparse groups take the two-tier exchange (horovod_sparse.common.tiers) ...
        self._hierarchical = self._sparse and wants_hierarchical(hierarchical)
        if self._hierarchical and self._elastic:
            raise ValueError("hierarchical=True does not follow elastic changes of the node set yet; "
                             "use hierarchical=False in a Horovod elastic job")
        if self.process_set.included():
            if not self._elastic:
                self._require_same_configuration()
            if self._hierarchical:  # after the check: every rank asks for it, or none does
                self._engine.tiers = horovod_tiers(hierarchical, hvd, process_set, gather_places)
            if self.tiers is not None:
                self._model.use_tiers(self.tiers)
            hook_gradients(ordered, self._hook)

    @property
    def mergecomp(self) -> Optional[MergeCompScheduler]:
        """The MergeComp scheduler choosing the grouping (``groups="mergecomp"``: its ``result``
        holds the choice once the search decided), else None."""
        return self._model.mergecomp

    # -- grouping ---------------------------------------------------------------------------------
    def _form_groups(self, ordered: Ordered, spec: Any) -> List[FlatGroup]:
        """The groups ``spec`` (``groups=``) asks for, the method's default grouping for None."""
        default = self._compression.default_grouping if self._sparse else "tensor"
        return flat_groups(ordered, spec, default, self._kept_dense)

    def _use_groups(self, members: List[List[int]]) -> List[FlatGroup]:
        """Switch to new groups (lists of positions in the parameter order) between steps:
        residuals carry over exactly, sparsifier states restart. Returns the new groups."""
        groups = self._form_groups(self._ordered, [[self._ordered[j][1] for j in m] for m in members])
        carry_residuals(self._groups, groups)
        self._groups = groups
        self._readiness.use_groups(groups)
        self._model.states.clear()
        return groups

    @property
    def tiers(self) -> Optional[Tiers]:
        """The two-tier exchange's process sets and this rank's slice (``hierarchical``), None
        when the exchange is flat (asked for or not: the layout may be flat)."""
        return self._engine.tiers

    @property
    def timeline(self) -> ReadyTimeline:
        """When gradients and groups became ready, step after step (read by LAGS and MergeComp)."""
        return self._engine.timeline

    @timeline.setter
    def timeline(self, timeline: ReadyTimeline) -> None:
        self._engine.timeline = timeline

    @property
    def groups(self) -> List[List[str]]:
        """Parameter names of every group, in group order."""
        return [list(g.names) for g in self._groups]

    def residuals(self) -> Dict[str, torch.Tensor]:
        """Each group's error-feedback residual between steps, flat, keyed by group name
        (zeros for groups that have not had a sparse step)."""
        return {g.name: g.residual if g.residual is not None
                else torch.zeros(g.numel, dtype=g.dtype, device=g.params[0].device)
                for g in self._groups}

    # -- launching --------------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        """``p``'s gradient was accumulated: launch its group once the group is ready."""
        if not self._readiness.final(p):
            return
        self._agree_if_due()
        self.timeline.param_ready(self._position[p])
        group = self._readiness.group_ready(p)
        if group is not None:
            self._launch(group)

    def _launch(self, group: FlatGroup) -> None:
        """Start ``group``'s exchange (dense while MergeComp records the gradients' order)."""
        self.timeline.group_ready(group.name)
        self._sparse_rows.prepare(group)
        self._engine.start(group, lambda: group.load_gradients(lambda tensors: self._finite(group, tensors),
                                                               self._step_scale().inverse),
                           functools.partial(self._dense_flight, group),
                           dense_step=self.mergecomp is not None and self.mergecomp.recording)

    def _dense_flight(self, group: FlatGroup, stats: GroupStats) -> DenseFlight:
        """Horovod's own allreduce of each of ``group``'s gradients (a dense compression's
        group, a group kept dense, a sparse method's dense step)."""
        self._finite(group)
        return self._dense.start(group, stats)

    def _step_scale(self) -> StepScale:
        """This step's loss scale, read at its first sparse group."""
        if self._scale is None:
            self._scale = step_scale(self._loss_scale)
        return self._scale

    # -- synchronizing ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every group's exchange and write the aggregated gradients into ``.grad``.

        Groups whose gradients were not all produced on this rank are launched now with zeros
        for the missing ones, so every rank issues the same collectives. Groups are finished in
        group order on every rank (a multi-round exchange waits on collectives that the other
        ranks only launch when they reach the same group).
        """
        if not self.process_set.included():
            self._synchronized = True
            return
        self._abandoned.warn_if_skipped()
        self._agree_if_due()
        launched = {flight.group.index for flight in self._engine.flights}
        for group in self._groups:
            if group.index not in launched and not self._readiness.ready(group):
                self._launch(group)
        self._report = self._early_report()
        finished = self._engine.finish(order=lambda flight: flight.group.index)
        self._sparse_rows.wait()
        self._readiness.next_step(self.backward_passes_per_step)
        self._size_checked = False
        outcome = self._engine.end(self._finiteness, self._agree, functools.partial(self._deliver, finished),
                                   self._end_step)
        if outcome.bad_ranks:
            self._abandoned.note(outcome.bad_ranks, outcome.stats.step, outcome.nonfinite_groups)
        self._synchronized = True

    def _early_report(self) -> Any:
        """The agreement's allgather of this rank's count of non-finite groups, launched as soon
        as every group of the step is (:func:`~horovod_sparse.torch.collectives.launch_report`),
        so that Horovod negotiates it with the step's exchange instead of in a cycle of its own
        after it (on 2 CPU workers Top-k's step of the digits MLP took 5.8 ms with the agreement
        launched after the exchange, 4.3 without a policy, 4.2 with it launched here:
        ``python -m benchmarks.costs.step_end``, docs/benchmarks.md); None where
        it waits for the step's end: without a ``nonfinite`` policy, in two tiers (whose
        agreement also levels the collectives the step launched) and while a decision is still
        on a device (read once, with the step's figures)."""
        if self.nonfinite is None or self._engine.tiers is not None:
            return None
        count = self._finiteness.count_on_host()
        return None if count is None else launch_report(count, self.process_set)

    def _agree(self, nonfinite_groups: List[str]) -> List[int]:
        """The ranks that saw a non-finite gradient this step, from the early report where there is
        one (in two tiers also leveling the ranks' collectives:
        :func:`~horovod_sparse.torch.collectives.agree_at_step_end`)."""
        report, self._report = self._report, None
        return agree_at_step_end(self.nonfinite, nonfinite_groups, self.process_set, self._rank,
                                 self._engine.tiers, self._engine.stats, report)

    def _deliver(self, finished: List[Any], abandoned: bool) -> None:
        """Write the step's sparse aggregates into ``.grad`` (the dense ones are there), hand
        the ``torch.sparse`` gradients back. An abandoned step's residuals got back what they
        delivered (they hold ``e + g``: this step's finite gradient is kept); its aggregates
        are NaN, as after Horovod's allreduce of an overflow."""
        if abandoned:
            nan_aggregates(finished)
        scale = None if self._scale is None else self._scale.scale
        for flight in finished:
            if flight.sparse:
                flight.group.publish(scale)
        self._scale = None
        self._sparse_rows.hand_back(abandoned=abandoned)

    def _finite(self, group: FlatGroup, tensors: Optional[Sequence[torch.Tensor]] = None) -> Finite:
        """Whether ``group``'s gradients on this rank are all finite (True without a
        ``nonfinite`` policy), read from ``tensors`` (what holds them: the group's flat staging
        buffer, one check and not one per parameter, or on the host the gradients themselves)
        or else from the ``.grad`` tensors, noted for :meth:`synchronize`: a host bool, or on an
        accelerator a 0-dim bool tensor that nothing reads until the step ends. A non-finite
        gradient contributes nothing this step and never reaches the residual (it stays in
        ``.grad`` until :meth:`synchronize`, which tells every rank and applies the policy)."""
        if tensors is None:
            tensors = [p.grad for p in group.params if p.grad is not None]
        return self._finiteness.check([group.name], *tensors)

    def _end_step(self, timeline: Any) -> None:
        """Hand the finished step's ``timeline`` to the sparsifier and to the MergeComp scheduler
        (on every rank, outside the hooks) and switch groups when the scheduler says so."""
        self._model.end_step(timeline, self._groups, self._use_groups)
