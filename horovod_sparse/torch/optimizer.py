"""``horovod_sparse.torch.DistributedOptimizer``: Horovod's optimizer wrapper, with sparse exchange.

The wrapper keeps ``hvd.DistributedOptimizer``'s signature and semantics (hooks launch
communication as gradients become ready, ``step()`` synchronizes, ``synchronize()`` /
``skip_synchronize()`` for gradient clipping, ``backward_passes_per_step`` for local
accumulation, ``groups=`` for grouping, process sets). What it adds: when ``compression`` is a
horovod_sparse sparsifier, each group of gradients is flattened into an error-feedback buffer and
handed to the sparsifier's exchange generator instead of a dense allreduce. With Horovod's own
``Compression.none`` / ``Compression.fp16`` every group takes the same dense allreduce as
Horovod's optimizer.
"""
from __future__ import annotations

import abc
import math
import os
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

import horovod.torch as hvd
import horovod.torch.optimizer as horovod_optimizer
import torch
from horovod.torch.compression import Compressor

from horovod_sparse.common.arguments import check_backward_passes, check_wrapper_arguments, merge_num_groups, op_name
from horovod_sparse.common.dense_choice import DenseSpec, chosen_dense
from horovod_sparse.common.grouping import ParamInfo, ReadyTimeline, form_groups
from horovod_sparse.common.mergecomp import MergeCompOptions
from horovod_sparse.common.mergecomp_scheduler import MergeCompScheduler
from horovod_sparse.common.nonfinite import apply_nonfinite_policy, resolve_nonfinite
from horovod_sparse.common.stats import GroupStats, StepStats
from horovod_sparse.common.tiers import Tiers, wants_hierarchical
from horovod_sparse.engine.horovod_tiers import horovod_tiers
from horovod_sparse.engine.model_state import ModelState
from horovod_sparse.engine.step import StepEngine
from horovod_sparse.methods.base import Sparsifier
from horovod_sparse.torch import backend
from horovod_sparse.torch.collectives import Communicator, gather_places
from horovod_sparse.torch.waiting import wait
from horovod_sparse.torch_core.buffers import FlatGroup, carry_residuals
from horovod_sparse.torch_core.device_timing import ready_timeline
from horovod_sparse.torch_core.finiteness import StepFiniteness, Usable
from horovod_sparse.torch_core.loss_scale import LossScale
from horovod_sparse.torch_core.tensor_backend import all_finite, read_scalars

NamedParameters = Iterable[Tuple[str, torch.Tensor]]


class _DenseFlight:
    """One group's dense allreduces in flight: Horovod's own path (one in-place allreduce per
    gradient, through ``compression``), with nothing per gradient but what Horovod's optimizer
    does, so that the wrapper costs what Horovod costs when nothing is sparsified. (A step with
    a non-finite gradient on some rank is abandoned after the exchange: every rank fills the
    aggregates with NaN then, whatever they hold.)
    """

    sparse = False

    def __init__(self, group: FlatGroup, stats: GroupStats, compression: Any, process_set: hvd.ProcessSet,
                 op: Any, prescale: float, postscale: float) -> None:
        self.group = group
        self.stats = stats
        self._compression = compression
        self._launched: List[Tuple[torch.Tensor, Any, Any]] = []
        wire = 0
        for name, p in zip(group.names, group.params):
            if p.grad is None:
                continue  # a sparse gradient, aggregated on its own (see _launch_sparse_rows)
            # Horovod's torch collectives do not take bfloat16: such gradients travel as float32.
            grad = p.grad.float() if p.grad.dtype == torch.bfloat16 else p.grad
            compressed, ctx = compression.compress(grad)
            handle = hvd.allreduce_async_(compressed, name=f"hs.{group.name}.{name}", op=op, prescale_factor=prescale,
                                          postscale_factor=postscale, process_set=process_set)
            self._launched.append((p, handle, ctx))
            wire += compressed.numel() * compressed.element_size()
        stats.selected = stats.union = group.numel
        stats.collectives = len(self._launched)
        stats.sent["values"] = stats.received["values"] = wire

    def finish(self) -> None:
        """Wait for the allreduces and write the aggregated gradients into ``.grad``."""
        start = time.perf_counter()
        for p, handle, ctx in self._launched:
            result = self._compression.decompress(wait(handle), ctx)
            if result.dtype == p.grad.dtype:
                p.grad.set_(result)
            else:
                p.grad.copy_(result)
        self.stats.add_time("communicate", time.perf_counter() - start)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer` (as Horovod does)."""

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
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        self.nonfinite = nonfinite
        self._loss_scale = loss_scale
        #: This step's ``(scale, 1 / scale)`` of the loss scaler, read at its first sparse group.
        self._scale_factors: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        #: ``(bad ranks, step, groups)`` of a step abandoned by synchronize() that step() has not
        #: met yet: it applies the policy then, unless a loss scaler skipped the step.
        self._abandoned: Optional[Tuple[List[int], int, List[str]]] = None
        #: Whether the warning that a loss scaler skips abandoned steps was given.
        self._warned_scaler = False
        names = _parameter_names(self.param_groups, named_parameters)
        #: Parameter -> name, as Horovod's optimizer has it (its tests and some user code read it).
        self._parameter_names = names
        # Integer/bool parameters, frozen ones and zero-size ones carry no gradient to exchange.
        ordered = [(names[p], p) for group in self.param_groups for p in group["params"]
                   if p.requires_grad and p.is_floating_point() and p.numel() > 0]
        self._ordered = ordered
        #: The names of the parameters kept dense (``dense=``): groups of their own, always dense.
        self._kept_dense = chosen_dense(dense, [name for name, _ in ordered])
        self._position = {p: i for i, (_, p) in enumerate(ordered)}
        mergecomp = MergeCompOptions.from_spec(groups)
        #: Method state per group, the MergeComp scheduler, checkpoints and agreement.
        self._model = ModelState(compression, backend, process_set, None if mergecomp is None else MergeCompScheduler(
            mergecomp, [name for name, _ in ordered], [p.numel() for _, p in ordered], process_set, backend))
        #: The step: plan, start, finish, abandon, close (:mod:`horovod_sparse.engine.step`).
        self._engine = StepEngine(compression, self._model, Communicator, process_set, stats_log, read_scalars)
        self._engine.place_timeline(lambda: ready_timeline(ordered[0][1].device if ordered else torch.device("cpu")))
        self._groups = self._form_groups(ordered, "tensor" if mergecomp is not None else groups)
        self._group_of = {p: g for g in self._groups for p in g.params}
        #: This step's finiteness decisions (groups and sparse-gradient parameters).
        self._finiteness = StepFiniteness()
        self._delay = {p: backward_passes_per_step for _, p in ordered}
        self._ready_count = {g.index: 0 for g in self._groups}
        #: The groups launched this step and not yet finished (their flights are the engine's).
        self._inflight: Set[int] = set()
        self._synchronized = False
        self._should_synchronize = True
        #: The rank whose shared state every rank adopts before its next exchange (None: agreed).
        self._agree_with: Optional[int] = 0
        #: The world size and this rank at the last agreement.
        self._world_size = process_set.size() if process_set.included() else 0
        self._rank = process_set.rank() if process_set.included() else -1
        #: Whether this step already compared the world size with the agreed one.
        self._size_checked = False
        #: Aggregation of sparse (``torch.sparse``) gradients in flight, by parameter.
        self._sparse_rows: Dict[torch.Tensor, Callable[[], torch.Tensor]] = {}
        #: Parameters whose sparse gradient travels dense this step (``sparse_as_dense``).
        self._densified: Set[torch.Tensor] = set()
        #: In a Horovod elastic job a worker that joins builds its optimizer while the others sync
        #: their state, so the configuration check waits for the agreement, which all ranks reach
        #: together (:meth:`agree_shared_state`); elsewhere it runs here, at construction.
        self._elastic = bool(int(os.environ.get("HOROVOD_ELASTIC", "0")))
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
            # Through a weak reference: a tensor's hooks are invisible to the garbage collector, so
            # a bound method there would keep the optimizer and its flat buffers alive for good.
            hook = _weak_hook(self._hook)
            for _, p in ordered:
                p.register_post_accumulate_grad_hook(hook)

    def _require_same_configuration(self) -> None:
        """Every rank of the process set raises the same ``ValueError`` unless they all have the
        same configuration (:meth:`ModelState.require_same_configuration`). Collective."""
        self._model.require_same_configuration(
            {"op": op_name(self.op, hvd), "gradient_predivide_factor": self.gradient_predivide_factor,
             "backward_passes_per_step": self.backward_passes_per_step, "nonfinite": self.nonfinite,
             "sparse_as_dense": self.sparse_as_dense, "hierarchical": self._hierarchical,
             "dense": sorted(self._kept_dense)},
            [(g.name, g.numel, str(g.dtype), [list(p.shape) for p in g.params]) for g in self._groups])

    @property
    def mergecomp(self) -> Optional[MergeCompScheduler]:
        """The MergeComp scheduler choosing the grouping (``groups="mergecomp"``: its ``result``
        holds the choice once the search decided), else None."""
        return self._model.mergecomp

    # -- grouping ---------------------------------------------------------------------------------
    def _form_groups(self, ordered: List[Tuple[str, torch.Tensor]], spec: Any) -> List[FlatGroup]:
        infos = [ParamInfo(name, p.numel(), f"{p.dtype}/{p.device}") for name, p in ordered]
        kept = [i for i, (name, _) in enumerate(ordered) if name in self._kept_dense]
        if isinstance(spec, (list, tuple)):
            position = {id(p): i for i, (_, p) in enumerate(ordered)}
            for members in spec:
                for p in members:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
            spec = [[position[id(p)] for p in members if id(p) in position] for members in spec]
        default = self._compression.default_grouping if self._sparse else "tensor"
        return [FlatGroup(i, [ordered[j][0] for j in members], [ordered[j][1] for j in members],
                          kept_dense=ordered[members[0]][0] in self._kept_dense)
                for i, members in enumerate(form_groups(infos, spec, default, kept=kept))]

    def _use_groups(self, members: List[List[int]]) -> List[FlatGroup]:
        """Switch to new groups (lists of positions in the parameter order) between steps:
        residuals carry over exactly, sparsifier states restart. Returns the new groups."""
        groups = self._form_groups(self._ordered, [[self._ordered[j][1] for j in m] for m in members])
        carry_residuals(self._groups, groups)
        self._groups = groups
        self._group_of = {p: g for g in groups for p in g.params}
        self._ready_count = {g.index: 0 for g in groups}
        self._model.states.clear()
        return groups

    @property
    def tiers(self) -> Optional[Tiers]:
        """The two-tier exchange's process sets and this rank's slice (``hierarchical``), None
        when the exchange is flat (asked for or not: the layout may be flat)."""
        return self._engine.tiers

    @property
    def steps(self) -> int:
        """Synchronised steps so far."""
        return self._engine.steps

    @property
    def last_stats(self) -> Optional[StepStats]:
        """The last step's statistics (``abandoned`` after a non-finite gradient)."""
        return self._engine.last_stats

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
        if self._delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                 "before call to step(). Increase backward_passes_per_step to "
                                 "accumulate gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] > 0:
            return
        self._agree_if_due()
        self.timeline.param_ready(self._position[p])
        group = self._group_of[p]
        self._ready_count[group.index] += 1
        if self._ready_count[group.index] == len(group.params):
            self._launch(group)

    def _launch(self, group: FlatGroup) -> None:
        self.timeline.group_ready(group.name)
        for p in group.params:
            if p.grad is not None and p.grad.is_sparse:
                if self.sparse_as_dense:
                    p.grad = p.grad.to_dense()
                    self._densified.add(p)
                else:
                    self._launch_sparse_rows(p)
            elif p.grad is None and p not in self._sparse_rows:
                # Not computed on this rank this step (dynamic graph); another rank may have it.
                p.grad = torch.zeros_like(p)
        usable = self._finite(group)
        dense_step = self._sparse and (self.steps < self._compression.options.warmup_steps
                                       or (self.mergecomp is not None and self.mergecomp.recording))
        plan, stats = self._engine.plan(group.name, group.numel, dense_step, group.kept_dense)
        size = self._world_size
        if self.op == hvd.Average:
            prescale, postscale = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
            scale = 1.0 / size
        else:
            prescale = postscale = scale = 1.0
        self._inflight.add(group.index)
        if not plan.sparse:
            compression = hvd.Compression.none if self._sparse else self._compression
            self._engine.keep(_DenseFlight(group, stats, compression, self.process_set, self.op, prescale, postscale))
            return
        if self._scale_factors is None and self._loss_scale is not None:
            self._scale_factors = self._loss_scale.factors()
        inverse = None if self._scale_factors is None else self._scale_factors[1]
        self._engine.start_sparse(group, plan, stats, size, self._rank, scale, group.params[0].device,
                                  lambda: group.load_gradients(usable, inverse))

    def _launch_sparse_rows(self, p: torch.Tensor) -> None:
        """Aggregate ``p``'s ``torch.sparse`` gradient as Horovod does (an allgather of its rows,
        averaged for ``op=Average``), whatever the compression: the rows present are already a
        sparse payload, sent exactly, with no residual. ``p.grad`` stays None until
        :meth:`synchronize` puts the aggregate there, so ``p`` contributes zeros to its group."""
        # Sent as it is, duplicate rows and all (as Horovod sends it): coalescing first would sum
        # each rank's duplicates before the ranks' rows, another order, other float rounding.
        grad = p.grad
        p.grad = None
        if self.nonfinite is not None and not all_finite(grad._values()):
            self._finiteness.note([self._parameter_names[p]], False)
            grad = torch.sparse_coo_tensor(grad._indices()[:, :0], grad._values()[:0], grad.shape)
        self._sparse_rows[p] = hvd.sparse_allreduce_async(grad, name=f"hs.rows.{self._parameter_names[p]}",
                                                          op=self.op, process_set=self.process_set)

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
        self._warn_if_skipped_by_scaler()
        self._agree_if_due()
        for group in self._groups:
            if group.index not in self._inflight and self._ready_count[group.index] < len(group.params):
                self._launch(group)
        finished = self._engine.finish(order=lambda flight: flight.group.index)
        self._inflight.clear()
        rows = {p: handle() for p, handle in self._sparse_rows.items()}
        self._sparse_rows.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        for index in self._ready_count:
            self._ready_count[index] = 0
        self._size_checked = False
        nonfinite_groups = self._finiteness.nonfinite()
        bad_ranks = [] if self.nonfinite is None else self._engine.ranks_with_nonfinite(
            nonfinite_groups, self._ranks_reporting)
        if bad_ranks:
            self._abandon_step()
        for flight in finished:
            if flight.sparse:
                flight.group.publish(self._loss_scale_of_step())
        self._scale_factors = None
        for p, aggregate in rows.items():
            p.grad = aggregate
            if bad_ranks:
                aggregate._values().fill_(math.nan)
        for p in self._densified:
            p.grad = p.grad.to_sparse()  # back to the layout the optimizer expects, as Horovod does
        self._densified.clear()
        if bad_ranks:
            self._abandoned = (bad_ranks, self.steps, nonfinite_groups)
        self._engine.close(self._end_step)
        self._synchronized = True

    def _loss_scale_of_step(self) -> Optional[torch.Tensor]:
        """The loss scale this step's gradients were unscaled by (None without a scaler)."""
        return None if self._scale_factors is None else self._scale_factors[0]

    def _warn_if_skipped_by_scaler(self) -> None:
        """An abandoned step that ``step()`` never met was skipped by a loss scaler (one that
        found the NaN aggregate, as ``GradScaler.step`` does): without ``loss_scaler=`` the
        residuals then hold gradients in the units of whatever scale each step had, so say once
        how to keep them in the loss's own units."""
        if self._abandoned is not None and self._loss_scale is None and not self._warned_scaler:
            self._warned_scaler = True
            warnings.warn("a step abandoned for a non-finite gradient was never applied: if a loss scaler "
                          "(torch.amp.GradScaler) skipped it, pass loss_scaler=scaler to DistributedOptimizer, "
                          "so that error feedback keeps its residuals in unscaled units when the scale changes",
                          RuntimeWarning, stacklevel=3)
        self._abandoned = None

    def _finite(self, group: FlatGroup) -> Usable:
        """Whether ``group``'s gradients on this rank are all finite (True without a
        ``nonfinite`` policy), noted for :meth:`synchronize`: a host bool, or on an accelerator a
        0-dim bool tensor that nothing reads until the step ends. A non-finite gradient
        contributes nothing this step and never reaches the residual (it stays in ``.grad``
        until :meth:`synchronize`, which tells every rank and applies the policy)."""
        if self.nonfinite is None:
            return True
        return self._finiteness.check([group.name], *[p.grad for p in group.params if p.grad is not None])

    def _ranks_reporting(self, nonfinite_here: int) -> List[int]:
        """Every rank learns which ranks saw a non-finite gradient this step (one tiny allgather
        of each rank's count ``nonfinite_here``)."""
        local = torch.tensor([nonfinite_here], dtype=torch.int32)
        counts = wait(hvd.allgather_async(local, name="hs.nonfinite", process_set=self.process_set))
        return [rank for rank, count in enumerate(counts.tolist()) if count]

    def _abandon_step(self) -> None:
        """Undo this step everywhere: residuals get back what they delivered (so they hold
        ``e + g``: this step's finite gradient is kept), and every aggregated gradient is NaN,
        so that whatever reads it before ``step()`` (a loss scaler's ``unscale_``, a gradient
        clipper) sees a non-finite step, as after Horovod's allreduce of an overflow."""
        for flight in self._engine.abandon():
            if flight.sparse:
                flight.group.zeroed_output().fill_(math.nan)
            else:
                for p in flight.group.params:
                    p.grad.fill_(math.nan)

    def _end_step(self, timeline: Any) -> None:
        """Hand the finished step's ``timeline`` to the sparsifier and to the MergeComp scheduler
        (on every rank, outside the hooks) and switch groups when the scheduler says so."""
        self._model.end_step(timeline, self._groups, lambda group, factor: group.residual.mul_(factor),
                             self._use_groups)

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context ``step()`` does not synchronize (call ``synchronize()`` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(). This can cause training slowdown.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        abandoned, self._abandoned = self._abandoned, None
        # A GradScaler stepping a fused optimizer calls step() on an overflow too, with its
        # found_inf attribute set: the optimizer's kernel skips the update itself.
        if abandoned is not None and getattr(self, "found_inf", None) is None:
            assert self.nonfinite is not None
            apply_nonfinite_policy(self.nonfinite, *abandoned)  # raises, or warns and skips
            return None
        return self._base_step(closure)  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._inflight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as "
                                 "it can cause a race condition.")
        super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes = check_backward_passes(passes)
        for p in self._delay:
            self._delay[p] = passes

    # -- checkpoints and the state every rank shares ------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state plus, under ``"horovod_sparse"``, this rank's
        sparsification state: step counter, MergeComp's grouping, and per group its residual
        and method state (thresholds, partition tables, schedules, DGC's velocity), as tensors
        and plain containers (``torch.load`` reads it with ``weights_only=True``). Residuals
        are per rank: save every rank's state dict to resume exactly."""
        state = super(self.__class__, self).state_dict()  # type: ignore[misc]
        state["horovod_sparse"] = self._model.record(self._groups, self.steps, per_rank=True)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        The groups must match the checkpoint's by name and size, else ``ValueError`` naming
        both (build the optimizer with the model and ``groups=`` it was saved with; a MergeComp
        grouping is restored when the checkpoint was taken after the search decided). Any
        worker count may load it: each rank keeps the residual it loads, and state built for
        another world size is rebuilt at the next exchange, as after an elastic change (only
        the same worker count resumes exactly)."""
        state_dict = dict(state_dict)
        ours = state_dict.pop("horovod_sparse", None)
        self._inflight.clear()
        self._engine.flights.clear()
        self._synchronized = False
        self._should_synchronize = True
        self._abandoned = None
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        if ours is not None:
            self._engine.restart_at(self._model.restore(ours, self._groups, self._use_groups))
        super(self.__class__, self).load_state_dict(state_dict)  # type: ignore[misc]

    def _agree_if_due(self) -> None:
        """Before this optimizer's first exchange, and again after the world changed size
        (elastic: a worker removed, after which Horovod syncs nothing), every rank adopts the
        shared state of the agreed rank (see :meth:`agree_shared_state`). A membership change
        that adds a worker, the size changed or not (a worker replaced), is agreed on earlier,
        in ``hvd.elastic.TorchState``'s sync (:mod:`horovod_sparse.torch.elastic`), which every
        rank, the new one included, runs after the change. The size is read once a step (Horovod
        changes it only between steps)."""
        if self._agree_with is None and not self._size_checked and self._world_size != self.process_set.size():
            self._agree_with = 0
        self._size_checked = True
        if self._agree_with is not None:
            self.agree_shared_state(self._agree_with)

    def agree_shared_state(self, root_rank: int = 0) -> None:
        """Every rank of the process set takes ``root_rank``'s step counter, MergeComp grouping
        and method state shared by all ranks (thresholds, partition tables, schedules);
        residuals and per-rank method state (DGC's velocity) stay each rank's own. Collective.

        It runs by itself before the first exchange of a new optimizer with ``root_rank=0``, so
        Horovod's checkpoint idiom (rank 0 alone loads a checkpoint, then broadcasts) resumes in
        step on every rank: rank 0 with its saved residual, the others with empty residuals (a
        rank-0 checkpoint holds no other rank's residual). :func:`broadcast_optimizer_state`
        calls it with its root. In a Horovod elastic job it first compares the configuration
        across ranks, a joining worker's included (``ValueError`` on every rank if it differs).
        """
        self._agree_with = None
        if not self.process_set.included():
            return
        self._world_size, self._rank = self.process_set.size(), self.process_set.rank()
        if self._elastic:
            self._require_same_configuration()
        if not self._groups:
            return  # nothing is exchanged, so there is nothing to agree on
        steps = self._model.agree(root_rank, self._groups, self.steps, self._use_groups)
        if self.process_set.rank() != root_rank:
            self._engine.restart_at(steps)


class SparseDistributedOptimizer(abc.ABC):  # noqa: B024 (a marker: classes register, nothing is abstract)
    """Every optimizer :func:`DistributedOptimizer` returns is an instance of this class (a
    virtual subclass: its class derives from the wrapped optimizer's, as in Horovod), so that
    ``isinstance`` recognises them (``hvd.elastic.TorchState`` does, to sync them)."""


def _initialising_step(base: type) -> Callable[..., Any]:
    """``base.step``, with every parameter put back as it was: how ``hvd.broadcast_optimizer_state``
    (through ``super(type(opt), opt).step()``) creates the state of an optimizer that has none,
    on zero gradients, without an exchange and without a parameter update."""

    def step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        saved = [p.detach().clone() for p in params]
        result = base.step(self, closure)
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
        return result

    return step


def _weak_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``method`` called through a weak reference to its object: a no-op once it is gone."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return hook


def _parameter_names(param_groups: List[Dict[str, Any]],
                     named_parameters: Optional[NamedParameters]) -> Dict[torch.Tensor, str]:
    """Map every parameter to a name, with Horovod's checks (tuples, unique, complete)."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(sorted(dups))}")
    names = {p: name for name, p in named}
    unnamed = [p for group in param_groups for p in group["params"] if p not in names]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         f"not named ({len(unnamed)} of them).")
    return names


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[NamedParameters] = None,
                         compression: Union[Compressor, type] = hvd.Compression.none,
                         backward_passes_per_step: int = 1,
                         op: Any = hvd.Average,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: hvd.ProcessSet = hvd.global_process_set,
                         stats_log: Optional[IO[str]] = None,
                         nonfinite: Optional[str] = "default",
                         loss_scaler: Optional[torch.amp.GradScaler] = None,
                         hierarchical: Optional[bool] = None,
                         dense: DenseSpec = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so gradients are exchanged, sparsely when ``compression`` sparsifies.

    Takes every argument of ``horovod.torch.DistributedOptimizer`` with the same meaning:

    Args:
        optimizer: the optimizer that applies the aggregated gradients (momentum and weight
            decay act after aggregation, as in every reference implementation).
        named_parameters: ``model.named_parameters()``; names key the collectives and the
            residuals and must be the same on every rank.
        compression: a horovod_sparse sparsifier (``horovod_sparse.torch.Compression.topk(...)``
            and friends) or Horovod's ``Compression.none`` / ``Compression.fp16``.
        backward_passes_per_step: backward passes accumulated locally before an exchange.
        op: ``hvd.Average`` or ``hvd.Sum`` with a sparsifier (it sums the selected values; other
            ops raise ``ValueError``); any Horovod op with a dense compression, ``hvd.Adasum``
            being delegated to Horovod's own Adasum optimizer.
        gradient_predivide_factor: splits the averaging before and after the sum (dense path).
        num_groups: deprecated alias of ``groups`` (as in Horovod).
        groups: an int or lists of parameters (Horovod's meaning); ``"tensor"`` (one group per
            parameter), ``"model"`` (one group), ``"size:N"`` (adjacent parameters merged up to
            N elements); or ``"mergecomp"`` / a ``MergeCompOptions`` (the MergeComp scheduler
            chooses from measured step times: see ``optimizer.mergecomp.result``). ``None`` uses
            the sparsifier's natural grouping (per tensor for Top-k, ``"size:8192"`` for LAGS).
        sparse_as_dense: exchange ``torch.sparse`` gradients with the dense ones (sparsified
            too, with a sparsifier) and hand them back sparse, as Horovod does; otherwise their
            rows are aggregated exactly by an allgather, as Horovod does, whatever the compression.
        process_set: the Horovod process set to reduce over.
        stats_log: optional text stream; one JSON line of statistics is written per step.
        nonfinite: what a NaN/Inf gradient on any rank does. Whatever the policy, the step is
            abandoned everywhere in ``synchronize()``: what the sparse exchange took out of the
            residuals is put back, so each healthy rank keeps this step's gradient in its
            residual (delivered later: nothing lost), the non-finite gradient never reaches a
            residual, and every aggregated gradient, on every rank, is NaN, so that a loss
            scaler's ``unscale_`` sees the overflow (``GradScaler.step`` then skips the step and
            ``update`` backs the scale off, as with Horovod's own optimizer). A ``step()`` that
            meets such a step applies no update on any rank (replicas stay identical) and then
            ``"raise"`` (default with a sparsifier) raises ``FloatingPointError`` on every rank;
            ``"skip"`` warns. ``None`` (default with a dense compression): no check, Horovod's
            own behaviour.
        loss_scaler: the ``torch.amp.GradScaler`` whose ``scale(loss)`` the gradients come from
            (mixed precision). Each gradient is divided by the scale as it enters the
            residual and the aggregate multiplied by it again, so the method selects, and error
            feedback keeps, values in the loss's own units: a scale change loses nothing. Without
            it, AMP still trains (see ``nonfinite``), but the residuals carry each step's scale.
        hierarchical: the two-tier sparse exchange (:mod:`horovod_sparse.common.tiers`): each
            node sums its gradients densely (reduce-scatter), each slice of the node sum is
            exchanged by the method across nodes among the ranks owning it, and the node gathers
            the slices' updates. ``None`` follows Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``
            (``horovodrun --hierarchical-allreduce``). It needs the global process set, as many
            workers on every node and Horovod's process sets for the nodes and slices: started
            with ``hvd.init(process_sets="dynamic")`` they are added here (collectively), else
            they must have been registered at ``hvd.init``. A job of one node, or of one worker
            per node, runs flat. Each rank's residual then holds its slice's error feedback only.
        dense: parameters exchanged dense at every step whatever ``compression`` is (embeddings,
            normalisation layers, biases): names from ``named_parameters``, ``fnmatch`` patterns
            (``"*.bias"``), a list of them, or a predicate on the name
            (:mod:`horovod_sparse.common.dense_choice`). They form groups of their own, marked
            ``kept_dense`` in the statistics. A name or pattern that matches nothing raises
            ``ValueError`` naming the closest names; every rank must choose the same parameters.

    Returns:
        An optimizer of the same class as ``optimizer`` (dynamically subclassed, as Horovod
        does), with ``synchronize()``, ``skip_synchronize()``, ``last_stats`` and ``groups``.
    """
    groups = merge_num_groups(num_groups, groups)
    backward_passes_per_step = check_backward_passes(backward_passes_per_step)
    sparse = isinstance(compression, Sparsifier)
    # The same checks and messages as the TensorFlow front end: a sparsifier sums, so it takes
    # Average or Sum only (Min, Max or Product would silently become a sum).
    check_wrapper_arguments(compression, sparse, Sparsifier, op_name(op, hvd), gradient_predivide_factor, "torch")
    if op == hvd.Adasum:
        return hvd.DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step,
                                        op, gradient_predivide_factor, 0, groups, sparse_as_dense, process_set)
    nonfinite = resolve_nonfinite(nonfinite, sparse, scaled=loss_scaler is not None)
    loss_scale = LossScale(loss_scaler) if loss_scaler is not None else None
    base = optimizer.__class__
    # hvd.broadcast_optimizer_state initialises a stateless optimizer by calling, on the ranks
    # without state, super(type(opt), opt).step() when it recognises its own optimizer by its
    # module, else opt.step(). Ours would start an exchange that the ranks holding state never
    # join (a hang), so the class carries Horovod's module name, and the class just below it
    # runs that zero-gradient step without moving the parameters (weight decay would, after
    # hvd.broadcast_parameters: replicas would differ).
    initialising = type(base.__name__, (base,), {"step": _initialising_step(base), "__module__": base.__module__})
    # Horovod's own module, not hvd.DistributedOptimizer's: a codebase that swapped in this
    # function (hvd.DistributedOptimizer = hs.DistributedOptimizer) changed the latter.
    attributes = dict(_DistributedOptimizer.__dict__, __module__=horovod_optimizer.__name__, _base_step=base.step)
    cls = type(base.__name__, (initialising,), attributes)
    SparseDistributedOptimizer.register(cls)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, stats_log, nonfinite, loss_scale,
               hierarchical, dense)


__all__ = ["DistributedOptimizer", "SparseDistributedOptimizer"]
