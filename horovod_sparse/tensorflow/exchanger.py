"""The gradient-exchange driver behind ``DistributedGradientTape`` and the Keras optimizer.

The counterpart of the driving half of :mod:`horovod_sparse.torch.exchanging`. A
:class:`GradientExchanger` takes the list of gradients of one step and returns the aggregated
ones, in the same order:

* with Horovod's own ``Compression.none`` / ``Compression.fp16`` it is exactly Horovod's
  gradient-allreduce function (``horovod.tensorflow._make_allreduce_grads_fn``: same ops, same
  names, same grouping), so the tape behaves like ``hvd.DistributedGradientTape``;
* with a sparsifier, gradients are grouped into flat buffers (the shared
  :func:`~horovod_sparse.common.grouping.form_groups`), each group's ``g + e`` is handed to the
  sparsifier's exchange generator, all groups are started in group order and then finished in
  group order (as the PyTorch optimizer does), the residuals are written back, and groups
  below ``min_numel`` or within ``warmup_steps`` take Horovod's dense allreduce.

Works in eager mode and inside ``tf.function`` (Keras ``model.fit`` without ``run_eagerly``), for
every method and grouping. Top-k, gTop-k, uniform LAGS and the hard threshold are traced into the
graph; what decides in Python from the values or times of the step (MiCRO, ExDyna, DGC,
Gaussian-k, gTop-k with ``recall_every``, LAGS's adaptive rule: ``Sparsifier.host_exchange``; and
the MergeComp scheduler, ``groups="mergecomp"``) runs the step's sparse exchange on the host, in
one ``tf.py_function`` that executes the eager code, collectives included, each time the traced
step runs (so their results are eager mode's, and the step is traced once). After such a host
step (and after every eager one) the step's timeline goes to the sparsifier (LAGS) and to the
MergeComp scheduler, which may regroup for the next step: residuals carry over exactly. The
tape returns every gradient at once, so the order MergeComp records is the variable order and
LAGS sees no backward time left to overlap (its rule then only spends the slack). Traced with
``warmup_steps``, the dense and the sparse step are both traced and a ``tf.cond`` on the step
counter picks one, the same on every rank. Residuals, per-group state
and the step counter are keyed by the list of variables (their order fixes the groups), so they
are found again at every step, in eager mode and across traces.

Reliability, as on the PyTorch side:

* **Same configuration everywhere**: the first exchange of each variable list compares a
  fingerprint of the configuration (compression and options, op, ``nonfinite``, the groups
  with their sizes and dtypes) across ranks (:mod:`horovod_sparse.common.consensus`, run
  eagerly even while a ``tf.function`` is traced) and raises the same ``ValueError`` on every
  rank, naming the ranks and settings that differ, before any exchange can hang.
* **Non-finite gradients** (``nonfinite="raise"|"skip"``, sparse exchanges): each rank checks
  its gradients, and one allgather of one int32 per rank tells every rank whether any saw a
  NaN/Inf, *before* anything is exchanged. If one did, the step is abandoned: nothing is
  exchanged, every returned gradient is NaN on every rank (as Horovod's allreduce of an
  overflow: a LossScaleOptimizer sees it, skips the step and backs its scale off), each sparse
  group whose gradient is finite on this rank keeps it in its residual (delivered later: nothing
  lost), a non-finite one never reaches the residual, and dense groups (warm-up, ``min_numel``)
  are dropped; ``last_stats.abandoned`` is True. The policy (``"raise"``: ``FloatingPointError``
  on every rank; ``"skip"``: a warning) then acts where the step would be applied, as
  ``step()`` does on the PyTorch side: the tape's ``gradient()`` (skip ``apply_gradients`` when
  ``tape.last_stats.abandoned``), unless a dynamic LossScaleOptimizer was given to it
  (``loss_scaler=``), which skips such steps itself; the Keras wrapper's ``apply_gradients``,
  which then applies no update (eager and traced), and which a LossScaleOptimizer around it does
  not call for such a step. Traced, the check is a ``tf.cond`` and the policy runs in a
  ``tf.py_function``: ``"raise"`` surfaces as the ``tf.errors`` error wrapping the
  ``FloatingPointError`` message.
* **Loss scaling**: given the loss scale (:mod:`horovod_sparse.tensorflow.loss_scale`), each
  sparse group's gradient is divided by it as it enters the residual and the aggregate
  multiplied by it again, so methods and residuals work in the loss's own units.
* **Exact resume**: :meth:`GradientExchanger.state_dict` / :meth:`~GradientExchanger.load_state_dict`
  carry residuals, step counters, MergeComp's grouping and per-group sparsifier state as
  NumPy/Python objects; loaded
  by another number of workers the method state is rebuilt for it and the residuals kept, and a
  checkpoint of other groups raises ``ValueError`` on every rank.
* **No hang on one inter-op thread**: a host step (above) runs in a ``tf.py_function``, which
  holds one of TensorFlow's inter-op threads while its collectives run, and TensorFlow needs
  another to finish them (a traced MiCRO with ``warmup_steps`` hung so). Tracing one where the
  pool has fewer than 2 threads (:func:`inter_op_threads`) raises ``RuntimeError`` on every
  rank, naming the fix, before it runs; the methods traced into the graph run there.
* **Dtypes and odd variables**: groups are formed per dtype; float16, float32 and float64
  values travel in their own dtype, bfloat16 ones as float32 (Horovod 0.28.1's TensorFlow
  collectives do not take bfloat16; residuals and results stay bfloat16); variables of other dtypes (integer, bool) and
  zero-size ones are passed through untouched, and a floating variable without a gradient on
  this rank is exchanged as zeros, so every rank issues the same collectives (it then gets the
  other ranks' aggregate, zeros when none has a gradient, as on the PyTorch side).
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_sparse.common.arguments import check_wrapper_arguments, op_name
from horovod_sparse.common.dense_choice import DenseSpec, chosen_dense
from horovod_sparse.common.grouping import ParamInfo, ReadyTimeline, form_groups
from horovod_sparse.common.mergecomp import MergeCompOptions
from horovod_sparse.common.mergecomp_scheduler import MergeCompScheduler
from horovod_sparse.engine.model_state import ModelState, Record
from horovod_sparse.common.nonfinite import apply_nonfinite_policy, resolve_nonfinite
from horovod_sparse.engine.horovod_tiers import horovod_tiers
from horovod_sparse.common.stats import GroupStats, StatsLog, StepStats, finish_step
from horovod_sparse.common.tiers import Tiers, wants_hierarchical
from horovod_sparse.engine.step import StepEngine
from horovod_sparse.tensorflow import backend, recording
from horovod_sparse.tensorflow.buffers import FlatGroup
from horovod_sparse.tensorflow.collectives import Communicator, allgather_bytes, gather_places, nbytes
from horovod_sparse.tensorflow.elastic import refuse_elastic
from horovod_sparse.tensorflow.loss_scale import ScaleReader, scale_of
from horovod_sparse.methods.base import Sparsifier, Step



@dataclass
class Layout:
    """One list of variables (one model): what grouping knows of each (``infos``, ``shapes``,
    ``dtypes``, in list order), its groups, its :class:`ModelState` (method state per group,
    MergeComp, checkpoints), and the number of exchanges this list has gone through (the
    ``step`` the sparsifiers see)."""

    infos: List[ParamInfo]
    shapes: List[tf.TensorShape]
    dtypes: List[tf.DType]
    #: Runs the list's steps (its ``timeline``: when gradients and groups became ready, read by
    #: LAGS and MergeComp).
    engine: StepEngine
    groups: List[FlatGroup] = field(default_factory=list)
    step: Optional[tf.Variable] = None
    #: The names of the variables kept dense (``dense=``).
    kept_dense: FrozenSet[str] = frozenset()
    #: Whether every step runs eagerly on the host, also inside a ``tf.function`` (a method that
    #: decides from the step's values, or groups that change between steps).
    host: bool = False

    @property
    def model(self) -> ModelState:
        """The list's method state per group, MergeComp, checkpoints (the engine's)."""
        return self.engine.model

    @property
    def mergecomp(self) -> Optional[MergeCompScheduler]:
        """The MergeComp scheduler choosing the groups (``groups="mergecomp"``), else None."""
        return self.model.mergecomp

    def step_counter(self) -> tf.Variable:
        """The step counter, created on first use outside any ``tf.function``."""
        if self.step is None:
            with tf.init_scope():
                self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="hs_step")
        return self.step

    def steps(self) -> int:
        """The step counter's value (0 before the first exchange), eagerly."""
        return 0 if self.step is None else int(self.step.numpy())


def _horovod_groups(groups: Any) -> Any:
    """``groups=`` for Horovod's own dense reduction: its int and lists of variables as they are,
    ``"tensor"`` as no grouping and ``"model"`` as one group; other strategies only shape the
    flat buffers of a sparsifier."""
    mergecomp = MergeCompOptions.from_spec(groups) is not None
    if isinstance(groups, str) and groups in ("tensor", "model"):
        return None if groups == "tensor" else 1
    if not isinstance(groups, str) and not mergecomp:
        return groups
    named = "groups='mergecomp' (MergeComp)" if mergecomp else f"groups={groups!r}"
    raise ValueError(f"{named} sets the flat buffers of a sparsifier; with Horovod's dense compressors "
                     "pass an int, lists of variables, 'tensor' or 'model'")


def _unique_names(names: List[str]) -> List[str]:
    """Names that identify each source (groups and collectives are named after them): a name
    TensorFlow gave to several variables gets the source's position appended, ``name@3``."""
    repeated = {name for name in names if names.count(name) > 1}
    return [f"{name}@{i}" if name in repeated else name for i, name in enumerate(names)]


def _exchangeable(source: Any) -> bool:
    """Whether a sparsifier exchanges ``source``'s gradient: floating dtype, at least one element."""
    return tf.as_dtype(source.dtype).is_floating and tf.TensorShape(source.shape).num_elements() != 0


def _all_finite(tensor: tf.Tensor) -> tf.Tensor:
    """Whether every element of ``tensor`` is finite (a boolean scalar), as the PyTorch side
    decides it: a NaN or Inf anywhere makes the sum non-finite, so one summing pass settles the
    usual case; only a non-finite sum (finite values near the dtype's maximum can also overflow
    it) takes the exact elementwise check, which writes a full-size boolean tensor."""
    accumulate = tf.float64 if tensor.dtype == tf.float64 else tf.float32
    return tf.cond(tf.math.is_finite(tf.reduce_sum(tf.cast(tensor, accumulate))), lambda: tf.constant(True),
                   lambda: tf.reduce_all(tf.math.is_finite(tensor)))


def inter_op_threads() -> int:
    """The threads of TensorFlow's inter-op pool: as configured
    (``tf.config.threading.set_inter_op_parallelism_threads``), else (0, the default) TensorFlow's
    choice, one per CPU this process may run on."""
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    if configured:
        return configured
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _eager_capable() -> bool:
    """Whether collectives can run eagerly here: in eager mode, or inside a ``tf.function``
    (lifted out by ``tf.init_scope``), but not in a TF1-style graph (``tf.compat.v1`` sessions)."""
    with tf.init_scope():
        return tf.executing_eagerly()


def _source_name(source: Any, position: int) -> str:
    try:
        return str(source.name)
    except (AttributeError, ValueError):  # eager tensors have no name
        return f"source{position}"


class GradientExchanger:
    """Exchanges one step's gradients over Horovod: sparsely through a sparsifier, or densely
    through Horovod's own allreduce function.

    Args:
        name: prefix of Horovod's op names on the dense path (as Horovod's wrappers use).
        compression: a horovod_sparse sparsifier or Horovod's ``Compression.none`` / ``.fp16``.
        sparse_as_dense: exchange ``tf.IndexedSlices`` gradients as dense tensors (sparsified
            too, with a sparsifier); otherwise their rows are aggregated exactly, as Horovod does.
        op: ``hvd.Average`` or ``hvd.Sum`` with a sparsifier; any Horovod op densely.
        gradient_predivide_factor: dense path only (a sparsifier refuses anything but 1.0).
        groups: with a sparsifier: an int, ``"tensor"``, ``"model"``, ``"size:N"`` or lists of
            variables (``None``: the method's natural grouping); densely: Horovod's meaning.
        process_set: the Horovod process set to reduce over.
        device_dense: device of the dense collectives.
        device_sparse: device of the IndexedSlices collectives.
        stats_log: optional text stream; one JSON line of statistics per exchange.
        nonfinite: what a NaN/Inf gradient on any rank does to a sparse exchange: ``"raise"``
            (``"default"`` with a sparsifier) or ``"skip"`` (see the module docstring); None
            checks nothing (the only choice, and the default, with Horovod's dense compressors,
            whose behaviour is Horovod's).
        backward_passes_per_step: the Keras wrapper's local aggregation; it only enters the
            configuration every rank must agree on.
        loss_scaler: the ``tf.keras.mixed_precision.LossScaleOptimizer`` whose scaled loss the
            gradients come from (the tape's argument), or None: its scale is divided out of
            the residuals (:mod:`horovod_sparse.tensorflow.loss_scale`), and a dynamic one takes
            the ``nonfinite`` policy's place (it skips an abandoned step and backs off). With a
            sparsifier and a loss scaler (also one found around the Keras wrapper, at its first
            exchange) ``nonfinite=None`` raises ``ValueError``: overflows would put Inf into the
            residuals for good.
        hierarchical: the two-tier exchange of sparse groups (see the tape's argument); the
            process sets are found or added at the first exchange, after the configuration check.
        dense: the variables kept dense (see the tape's argument), resolved against each
            variable list's names at its first exchange.

    Attributes:
        loss_scale: reads the loss scale of the gradients exchanged (None: not scaled); the
            Keras wrapper makes it read the scale of a LossScaleOptimizer wrapping it.
        reports_in: where the ``nonfinite`` policy acts on an abandoned step: ``"exchange"``
            (as the exchange returns, the tape's ``gradient()``), ``"apply"`` (the Keras
            wrapper's ``apply_gradients``, through :meth:`take_abandoned` and
            :meth:`report_abandoned`) or None (a dynamic ``loss_scaler`` skips such steps).
    """

    def __init__(self, name: str, compression: Any, sparse_as_dense: bool = False, op: Any = hvd.Average,
                 gradient_predivide_factor: float = 1.0, groups: Any = None,
                 process_set: hvd.ProcessSet = hvd.global_process_set, device_dense: str = "",
                 device_sparse: str = "", stats_log: Optional[IO[str]] = None,
                 nonfinite: Optional[str] = "default", backward_passes_per_step: int = 1,
                 loss_scaler: Any = None, hierarchical: Optional[bool] = None, dense: DenseSpec = None) -> None:
        refuse_elastic(name)
        self.sparse = isinstance(compression, Sparsifier)
        check_wrapper_arguments(compression, self.sparse, Sparsifier, op_name(op, hvd),
                                gradient_predivide_factor, "tensorflow")
        self.nonfinite = resolve_nonfinite(nonfinite, self.sparse, scaled=loss_scaler is not None)
        if self.nonfinite is not None and not self.sparse:
            raise ValueError(f"nonfinite={self.nonfinite!r} needs a horovod_sparse sparsifier as compression; "
                             "Horovod's dense compressors keep Horovod's own behaviour (nonfinite=None)")
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        #: Local aggregation before each exchange (the Keras wrapper's; in the fingerprint only).
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.groups_spec = groups
        self.dense_spec = dense
        self.process_set = process_set
        self._hierarchical_arg = hierarchical
        self._hierarchical = self.sparse and wants_hierarchical(hierarchical)
        #: The two-tier exchange's process sets (None: flat), found at the first exchange.
        self.tiers: Optional[Tiers] = None
        self.device_dense = device_dense
        self._stats_log = StatsLog(stats_log) if stats_log is not None else None
        horovod_groups = None if self.sparse else _horovod_groups(groups)
        self._horovod_reduce = hvd._make_allreduce_grads_fn(
            name, device_dense, device_sparse, hvd.Compression.none if self.sparse else compression,
            sparse_as_dense, op, gradient_predivide_factor, horovod_groups, process_set)
        self._layouts: Dict[Tuple[Any, ...], Layout] = {}
        self._last_layout: Optional[Layout] = None
        #: Checkpointed layouts not yet matched by a variable list (see :meth:`load_state_dict`).
        self._pending_layouts: List[Dict[str, Any]] = []
        self.loss_scale: ScaleReader = scale_of(loss_scaler) if loss_scaler is not None else lambda: None
        self.reports_in: Optional[str] = None if loss_scaler is not None and loss_scaler.dynamic else "exchange"
        #: ``(bad ranks, step, this rank's affected groups)`` of the last abandoned exchange, for
        #: :meth:`report_abandoned`; and whether the gradients of the last exchange were abandoned
        #: (a variable, so that a traced ``apply_gradients`` can read it: :meth:`take_abandoned`).
        self._abandoned_report: Optional[Tuple[List[int], int, List[str]]] = None
        self._abandoned: Optional[tf.Variable] = None
        self.last_stats: Optional[StepStats] = None
        #: The clock of the timelines of variable lists exchanged from now on (monotonic seconds;
        #: tests give a virtual one, as PyTorch's ``opt.timeline = ReadyTimeline(clock)``).
        self.clock: Callable[[], float] = time.perf_counter

    # -- bookkeeping ------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Exchanges run so far by the variable list exchanged last (on this rank)."""
        return 0 if self._last_layout is None else self._last_layout.steps()

    def _record(self, stats: StepStats) -> None:
        self.last_stats = finish_step(stats, self._stats_log)

    def groups(self) -> List[List[str]]:
        """Variable names of every group of the variable list exchanged last, in group order."""
        layout = self._last_layout
        return [] if layout is None else [list(g.names) for g in layout.groups]

    @property
    def mergecomp(self) -> Optional[MergeCompScheduler]:
        """The MergeComp scheduler of the variable list exchanged last (``groups="mergecomp"``:
        its ``result`` holds the choice once the search decided), else None."""
        return None if self._last_layout is None else self._last_layout.mergecomp

    def residuals(self) -> Dict[str, tf.Tensor]:
        """Each group's residual between steps, flat, keyed by group name (variable list
        exchanged last)."""
        layout = self._last_layout
        return {} if layout is None else {g.name: g.residual_value() for g in layout.groups}

    def _abandoned_flag(self) -> tf.Variable:
        """Whether the last exchange was abandoned, created on first use outside any ``tf.function``."""
        if self._abandoned is None:
            with tf.init_scope():
                self._abandoned = tf.Variable(False, trainable=False, name="hs_abandoned")
        return self._abandoned

    def take_abandoned(self) -> Any:
        """Whether the gradients of the last exchange were abandoned (a bool; a boolean tensor
        inside a ``tf.function``), then forgets it: the Keras wrapper asks once per update, and
        then applies no update and calls :meth:`report_abandoned`."""
        flag = self._abandoned_flag()
        abandoned = flag.read_value()
        if tf.executing_eagerly():
            abandoned = bool(abandoned)
        flag.assign(False)
        return abandoned

    def report_abandoned(self) -> None:
        """Apply the ``nonfinite`` policy to the last abandoned exchange (``reports_in="apply"``):
        raise ``FloatingPointError`` (``"raise"``) or warn (``"skip"``)."""
        assert self.nonfinite is not None and self._abandoned_report is not None
        apply_nonfinite_policy(self.nonfinite, *self._abandoned_report)

    def update_unless_abandoned(self, abandoned: Any, update: Callable[[], Any]) -> None:
        """Run ``update`` (the optimizer's update with the exchanged gradients) unless
        ``abandoned`` (what :meth:`take_abandoned` returned; False where the policy is off): then
        no update, and :meth:`report_abandoned` instead. A boolean tensor (traced) decides in a
        ``tf.cond``, the report running in a ``tf.py_function``; ``update``'s result is dropped."""
        if not tf.is_tensor(abandoned):
            if abandoned:
                self.report_abandoned()
            else:
                update()
            return

        def report() -> None:
            tf.py_function(self.report_abandoned, inp=[], Tout=[], name="horovod_sparse_abandoned")

        def apply() -> None:
            update()

        tf.cond(abandoned, report, apply)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's sparsification state, as NumPy arrays and plain Python objects (picklable,
        unaffected by later steps): under ``"layouts"``, per variable list exchanged so far, its
        :meth:`ModelState.record` (step counter, MergeComp's grouping, the method's own state
        such as LAGS's measurements, and per group the residual and the method state with the
        number of workers it was built for). Residuals are per rank: save every rank's state to
        resume exactly. The wrapped optimizer's own state is saved the usual TensorFlow way."""
        return {"layouts": [layout.model.record(layout.groups, layout.steps(), per_rank=True)
                            for layout in self._layouts.values()]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. Each saved variable list is restored into the variable
        list exchanged now, or at its first exchange, whose groups have the same names and sizes
        (so load it in a fresh process before the first step, or after). Saved by a different
        number of workers, the residuals and the step counter are restored and the method state
        built for that number is rebuilt for this one at the next exchange, as on the PyTorch
        side (partition tables, thresholds, gTop-k's schedule; DGC keeps its velocity). A
        variable list whose groups match no saved one, while some are still waiting, raises
        ``ValueError``: at its first exchange, on every rank, even when only some ranks loaded
        a checkpoint."""
        self._pending_layouts = list(state_dict["layouts"])
        for layout in self._layouts.values():
            problem = self._restore(layout)
            if problem:
                raise ValueError(problem)

    def _restore(self, layout: Layout) -> str:
        """Load the waiting checkpointed record that matches ``layout`` (same groups, or for a
        MergeComp layout the grouping of the same variables), if any; what is wrong when none
        matches while some are waiting (empty when all is well)."""
        if not self._pending_layouts:
            return ""
        names = sorted(info.name for info in layout.infos)
        signature = {g.name: g.numel for g in layout.groups}

        def matches(saved: Record) -> bool:
            if layout.mergecomp is not None and saved.get("mergecomp") is not None:
                return sorted(saved["mergecomp"]["order"]) == names
            return {name: entry["numel"] for name, entry in saved["groups"].items()} == signature

        position = next((i for i, saved in enumerate(self._pending_layouts) if matches(saved)), None)
        if position is None:
            return (f"checkpoint does not match the exchanger's groups: groups {signature} "
                    f"(name: elements) are not among the saved ones "
                    f"{[{n: r['numel'] for n, r in s['groups'].items()} for s in self._pending_layouts]}; "
                    "load it with the same model and groups= it was saved with")
        saved = self._pending_layouts.pop(position)
        with tf.init_scope():
            try:
                steps = layout.model.restore(saved, layout.groups, functools.partial(self._use_groups, layout))
            except ValueError as error:
                return str(error)
            layout.step_counter().assign(steps)
        return ""

    def _restore_everywhere(self, layout: Layout) -> None:
        """:meth:`_restore` on every rank, then a ``ValueError`` on every rank if it failed on
        any (with Horovod's idiom only rank 0 loads a checkpoint: the others must not wait for
        it in the next collective). Collective, run eagerly."""
        problem = self._restore(layout)
        problems = allgather_bytes(problem.encode(), "hs.restore",
                                   process_set=self.process_set)
        failed = [f"rank {rank}: {text.decode()}" for rank, text in enumerate(problems) if text]
        if failed:
            raise ValueError(" | ".join(failed))

    # -- layout -----------------------------------------------------------------------------------
    def _layout(self, grads: Sequence[Any], sources: Sequence[Any]) -> Layout:
        """The layout of ``sources``; the first time, after checking that every rank has the same
        configuration and restoring a waiting checkpoint (collective: all ranks exchange the same
        variable lists in the same order)."""
        key = tuple(s.ref() for s in sources)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._new_layout(grads, sources)
            self._require_same_configuration(layout)
            self._split_into_tiers(layout)
            self._restore_everywhere(layout)
            self._agree(layout)
            self._layouts[key] = layout
        self._last_layout = layout
        return layout

    def _agree(self, layout: Layout) -> None:
        """Every rank takes the first rank's step counter and method state shared by all ranks
        (thresholds, partition tables, schedules, LAGS's measurements) for this variable list,
        at its first exchange; residuals and per-rank method state (DGC's velocity) stay each
        rank's own. So Horovod's checkpoint idiom (rank 0 alone restores, then broadcasts the
        variables, e.g. Keras' ``BroadcastGlobalVariablesCallback``) resumes in step on every
        rank: rank 0 with its saved residuals, the others with empty ones. Collective, run
        eagerly."""
        if not self.sparse:
            return
        with tf.init_scope():
            steps = layout.model.agree(0, layout.groups, layout.steps(), functools.partial(self._use_groups, layout))
            layout.step_counter().assign(steps)

    def _split_into_tiers(self, layout: Layout) -> None:
        """With ``hierarchical``, find or add the tiers' process sets (once, eagerly: collective,
        after the configuration check, so every rank asks for them or none does) and run the
        method's state of ``layout`` over this rank's cross set."""
        if not self._hierarchical:
            return
        if self.tiers is None:
            with tf.init_scope():
                self.tiers = horovod_tiers(self._hierarchical_arg, hvd, self.process_set, gather_places)
            self._hierarchical = self.tiers is not None  # a flat layout: nothing to split, ever
        if self.tiers is not None:
            layout.model.use_tiers(self.tiers)
            layout.engine.tiers = self.tiers

    def _require_same_configuration(self, layout: Layout) -> None:
        """Every rank raises the same ``ValueError`` unless all have the same configuration
        (:meth:`ModelState.require_same_configuration`). Sparse collectives are named after
        the groups, so their names count; Horovod's dense path names its ops itself, so only
        sizes and dtypes count there. Collective."""
        layout.model.require_same_configuration(
            {"op": op_name(self.op, hvd), "gradient_predivide_factor": self.gradient_predivide_factor,
             "nonfinite": self.nonfinite, "nonfinite_reported_in": self.reports_in,
             "sparse_as_dense": self.sparse_as_dense,
             "backward_passes_per_step": self.backward_passes_per_step, "hierarchical": self._hierarchical,
             "dense": sorted(layout.kept_dense)},
            [(g.name if self.sparse else str(g.index), g.numel, g.dtype.name, [s.as_list() for s in g.shapes])
             for g in layout.groups])

    def _new_layout(self, grads: Sequence[Any], sources: Sequence[Any]) -> Layout:
        names = _unique_names([_source_name(s, i) for i, s in enumerate(sources)])
        shapes = [tf.TensorShape(g.shape) for g in grads]
        for name, shape in zip(names, shapes):
            if not shape.is_fully_defined():
                raise ValueError(f"gradient of {name!r} has shape {shape}, which is not fully defined; "
                                 "horovod_sparse needs static shapes to lay out its flat buffers")
        spec = self.groups_spec
        if isinstance(spec, (list, tuple)):
            position = {s.ref(): i for i, s in enumerate(sources)}
            spec = [[position[v.ref()] for v in members if v.ref() in position] for members in spec]
        mergecomp = MergeCompOptions.from_spec(spec) if self.sparse else None
        kept_dense = chosen_dense(self.dense_spec, names, "variable")
        infos = [ParamInfo(name, int(shape.num_elements()), g.dtype.name)
                 for name, shape, g in zip(names, shapes, grads)]
        scheduler = None if mergecomp is None else MergeCompScheduler(
            mergecomp, names, [info.numel for info in infos], self.process_set, backend)
        engine = StepEngine(self.compression, ModelState(self.compression, backend, self.process_set, scheduler),
                            Communicator, self.process_set)
        engine.place_timeline(lambda: ReadyTimeline(self.clock))
        layout = Layout(infos, shapes, [g.dtype for g in grads], engine, kept_dense=kept_dense)
        layout.groups = self._form_groups(layout, "tensor" if mergecomp is not None else spec)
        layout.host = self.sparse and (self.compression.host_exchange or mergecomp is not None)
        return layout

    def _form_groups(self, layout: Layout, spec: Any) -> List[FlatGroup]:
        default = self.compression.default_grouping if self.sparse else "tensor"
        return [FlatGroup(i, [layout.infos[j].name for j in members], list(members),
                          [layout.shapes[j] for j in members], layout.dtypes[members[0]],
                          kept_dense=layout.infos[members[0]].name in layout.kept_dense)
                for i, members in enumerate(form_groups(
                    layout.infos, spec, default,
                    kept=[j for j, info in enumerate(layout.infos) if info.name in layout.kept_dense]))]

    def _use_groups(self, layout: Layout, members: List[List[int]]) -> List[FlatGroup]:
        """Switch ``layout`` to new groups (lists of positions in the variable list) between
        steps, eagerly: residuals carry over exactly, sparsifier states restart. Returns them."""
        pieces: Dict[int, tf.Tensor] = {}
        for group in layout.groups:
            if group.residual is not None:
                pieces.update(zip(group.positions, tf.split(group.residual_value(), group.numels)))
        layout.groups = self._form_groups(layout, members)
        for group in layout.groups:
            if any(p in pieces for p in group.positions):
                group.store_residual(tf.concat([pieces.get(p, tf.zeros([n], group.dtype))
                                                for p, n in zip(group.positions, group.numels)], axis=0))
        layout.model.states.clear()
        return layout.groups

    # -- the exchange -----------------------------------------------------------------------------
    def __call__(self, grads: Sequence[Any], sources: Sequence[Any], use_generic_names: bool = False) -> List[Any]:
        """The aggregated gradients of ``grads`` (one per source, same order). With a sparsifier a
        floating source without a gradient on this rank gets the others' aggregate (zeros when no
        rank has one); otherwise, and for other dtypes, None stays None.

        ``use_generic_names`` is Horovod's option for its dense op names; sparse exchanges always
        name their collectives after the group.
        """
        if not self.sparse:
            return self._exchange_dense(grads, sources, use_generic_names)
        return self._exchange_sparse(grads, sources)

    @tf.autograph.experimental.do_not_convert
    def _exchange_dense(self, grads: Sequence[Any], sources: Sequence[Any], use_generic_names: bool) -> List[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        layout = None
        # Horovod's reduction needs nothing of ours; the layout only feeds the statistics, which
        # a TF1-style graph (no eager collectives, even at trace time) goes without.
        if present and self.process_set.included() and _eager_capable():
            layout = self._layout([grads[i] for i in present], [sources[i] for i in present])
        reduced = self._horovod_reduce(list(grads), list(sources), use_generic_names)
        if layout is not None:
            counter = layout.step_counter()
            engine = layout.engine
            engine.begin(counter.read_value())
            for group in layout.groups:
                _, stats = engine.plan(group.name, group.numel, True, group.kept_dense)
                self._account_dense(stats, [grads[present[i]] for i in group.positions])
            counter.assign_add(1)
            recording.publish(engine.stats, self._record)
        return reduced

    def _account_dense(self, stats: GroupStats, grads: Sequence[Any]) -> None:
        """Fill a dense group's ``stats`` as Horovod's allreduce moves its ``grads`` (one collective
        per gradient)."""
        stats.selected = stats.union = stats.numel
        stats.collectives = len(grads)
        for grad in grads:
            if isinstance(grad, tf.IndexedSlices):
                stats.sent["values"] += nbytes(grad.values)
                stats.sent["indices"] += nbytes(grad.indices)
            else:
                wire_bytes = nbytes(grad) // grad.dtype.size * self._dense_wire_itemsize(grad.dtype)
                stats.sent["values"] += wire_bytes
                stats.received["values"] += wire_bytes

    def _dense_wire_itemsize(self, dtype: tf.DType) -> int:
        """Bytes per element of a dense allreduce: 2 for floats under ``Compression.fp16``."""
        fp16 = not self.sparse and self.compression is hvd.Compression.fp16
        return tf.float16.size if fp16 and dtype.is_floating else dtype.size

    @tf.autograph.experimental.do_not_convert
    def _exchange_sparse(self, grads: Sequence[Any], sources: Sequence[Any]) -> List[Any]:
        if not self.process_set.included():
            return list(grads)
        eager = tf.executing_eagerly()
        if not _eager_capable():
            raise RuntimeError("horovod_sparse sparsifiers run in TensorFlow 2 (eager, tf.function, Keras "
                               "model.fit), not in a TF1-style graph (tf.compat.v1 sessions, eager execution "
                               "disabled): they agree their configuration across ranks once, eagerly. Use "
                               "Horovod's Compression.none / Compression.fp16 there.")
        results = list(grads)
        positions = [i for i, s in enumerate(sources) if _exchangeable(s)]
        rows = [i for i in positions if isinstance(grads[i], tf.IndexedSlices) and not self.sparse_as_dense]
        if rows:
            # Already a sparse payload: its rows are aggregated exactly, as Horovod does.
            for i, value in zip(rows, self._horovod_reduce([grads[i] for i in rows], [sources[i] for i in rows])):
                results[i] = value
            positions = [i for i in positions if i not in rows]
        if not positions:
            return results
        kept = [self._dense_gradient(grads[i], sources[i]) for i in positions]
        layout = self._layout(kept, [sources[i] for i in positions])
        loss_scale = self.loss_scale()
        if loss_scale is not None:
            # A LossScaleOptimizer around the Keras wrapper, found only now: refused without a
            # policy, as the tape's loss_scaler= is at construction.
            resolve_nonfinite(self.nonfinite, self.sparse, scaled=True)
        if layout.host and not eager:
            exchanged, abandoned = self._host_step(kept, layout, loss_scale)
        else:
            exchanged, abandoned = self._sparse_step(kept, layout, loss_scale)
        if self.reports_in == "apply" and self.nonfinite is not None:
            self._abandoned_flag().assign(abandoned)
        for position, value in zip(positions, exchanged):
            results[position] = value
        return results

    def _host_step(self, kept: List[tf.Tensor], layout: Layout,
                   loss_scale: Optional[tf.Tensor]) -> Tuple[List[tf.Tensor], tf.Tensor]:
        """:meth:`_sparse_step` as eager mode runs it, in one ``tf.py_function`` that runs it,
        collectives included, each time the traced step runs: for a layout whose method decides
        on the host (``Sparsifier.host_exchange``) or whose groups change between steps
        (MergeComp). Only one such function runs at a time on a rank (every one is a stateful
        op, ordered by the function's automatic control dependencies), so ranks cannot block
        each other on two of them."""

        threads = inter_op_threads()
        if threads < 2:
            method = self.compression.method_name
            what = "MergeComp's grouping" if layout.mergecomp is not None else f"{method}'s exchange"
            raise RuntimeError(
                f"horovod_sparse runs {what} on the host inside the traced step, in a tf.py_function that holds "
                f"one TensorFlow inter-op thread while its collectives run and needs another to finish them: with "
                f"{threads} inter-op thread the step would hang. Give TensorFlow at least 2 "
                f"(tf.config.threading.set_inter_op_parallelism_threads(2) before it starts; the default, 0, is one "
                f"per CPU), or run the step eagerly (Keras: run_eagerly=True)")

        def run(*inputs: tf.Tensor) -> List[Any]:
            exchanged, abandoned = self._sparse_step(list(inputs[:len(kept)]), layout,
                                                     None if loss_scale is None else inputs[-1])
            return [*exchanged, abandoned]

        *results, abandoned = tf.py_function(run, inp=kept if loss_scale is None else [*kept, loss_scale],
                                             Tout=[*(g.dtype for g in kept), tf.bool], name="horovod_sparse_host_step")
        for result, grad in zip(results, kept):
            result.set_shape(grad.shape)
        return results, abandoned

    def _sparse_step(self, kept: List[tf.Tensor], layout: Layout,
                     loss_scale: Optional[tf.Tensor]) -> Tuple[List[tf.Tensor], Any]:
        """One counted step of ``layout`` on gradients carrying the loss scale ``loss_scale``
        (None: unscaled): the exchange, behind the non-finite check when ``nonfinite`` is set.
        Returns the aggregated gradients and whether the step was abandoned (a bool, or a
        boolean tensor when traced)."""
        counter = layout.step_counter()
        step: Step = int(counter.numpy()) if tf.executing_eagerly() else counter.read_value()
        if self.nonfinite is not None:
            return self._exchange_if_finite(kept, layout, step, counter, loss_scale)
        exchanged = self._exchange_step(kept, layout, step, loss_scale)
        counter.assign_add(1)
        return exchanged, False

    def _exchange_step(self, kept: List[tf.Tensor], layout: Layout, step: Step,
                       loss_scale: Optional[tf.Tensor]) -> List[tf.Tensor]:
        """:meth:`_exchange_groups`, dense during warm-up: decided in Python on the host; when
        traced with ``warmup_steps`` both paths are traced, each inside a ``tf.cond`` branch
        (every rank takes the same branch)."""
        warmup = self.compression.options.warmup_steps
        if isinstance(step, int):
            return self._exchange_groups(kept, layout, step, self._dense_step(layout, step), loss_scale)
        if warmup:
            return tf.cond(step < warmup, lambda: self._exchange_groups(kept, layout, step, True, loss_scale),
                           lambda: self._exchange_groups(kept, layout, step, False, loss_scale))
        return self._exchange_groups(kept, layout, step, False, loss_scale)

    def _exchange_if_finite(self, kept: List[tf.Tensor], layout: Layout, step: Step, counter: tf.Variable,
                            loss_scale: Optional[tf.Tensor]) -> Tuple[List[tf.Tensor], Any]:
        """The step's exchange if no rank has a non-finite gradient, else :meth:`_abandon`;
        counts the step, then reports it (:meth:`_report_nonfinite`). Returns the gradients and
        whether the step was abandoned: the report's answer (traced: its ``tf.py_function``'s
        output, so that whatever reads it, :meth:`take_abandoned`, runs after the report)."""
        finite = [tf.reduce_all([_all_finite(kept[p]) for p in group.positions])
                  for group in layout.groups]
        local = tf.reshape(tf.cast(tf.logical_not(tf.reduce_all(finite)), tf.int32), [1])
        flags = hvd.allgather(local, name="hs.nonfinite", ignore_name_scope=True, process_set=self.process_set)
        if isinstance(step, int):
            if bool(tf.reduce_any(flags > 0)):
                exchanged = self._abandon(kept, layout, step, finite, loss_scale)
            else:
                exchanged = self._exchange_step(kept, layout, step, loss_scale)
        else:
            exchanged = tf.cond(tf.reduce_any(flags > 0),
                                lambda: self._abandon(kept, layout, step, finite, loss_scale),
                                lambda: self._exchange_step(kept, layout, step, loss_scale))
        counter.assign_add(1)
        report = functools.partial(self._report_nonfinite, [g.name for g in layout.groups])
        if isinstance(step, int):
            return exchanged, report(flags, tf.stack(finite), step)
        return exchanged, tf.py_function(report, inp=[flags, tf.stack(finite), step], Tout=tf.bool,
                                         name="horovod_sparse_nonfinite")

    def _abandon(self, kept: List[tf.Tensor], layout: Layout, step: Step, finite: List[tf.Tensor],
                 loss_scale: Optional[tf.Tensor]) -> List[tf.Tensor]:
        """An abandoned step: nothing is exchanged and every gradient returned is NaN (so a loss
        scaler sees the overflow, as after Horovod's allreduce of one); each sparse group finite
        on this rank adds its gradient (divided by ``loss_scale``) to its residual, the others
        keep their residual as it was."""
        warm = self._dense_step(layout, step)
        for group in layout.groups:
            if not layout.engine.takes_sparse(group.numel, False, group.kept_dense):
                continue  # exchanged densely: this step's gradient is dropped
            before = group.residual_value()
            x = group.load_gradients(kept, loss_scale)
            group.store_residual(tf.where(tf.logical_and(finite[group.index], tf.logical_not(warm)), x, before))
        recording.publish(StepStats(step=step, abandoned=True), self._record)
        if isinstance(step, int):
            self._end_step(layout)
        return [tf.fill(g.shape, tf.constant(np.nan, g.dtype)) for g in kept]

    def _dense_step(self, layout: Layout, step: Step) -> Any:
        """Whether every group of ``layout`` is exchanged dense at ``step``: warm-up, or the
        step MergeComp records the gradients' order on."""
        if layout.mergecomp is not None and layout.mergecomp.recording:
            return True
        return step < self.compression.options.warmup_steps

    def _end_step(self, layout: Layout) -> None:
        """Close a step run eagerly or on the host (every rank, after its collectives): hand its
        timeline to the method (LAGS measures here) and to MergeComp, apply MergeComp's
        ``residual_decay`` and switch groups when it says so."""
        layout.model.end_step(layout.engine.timeline.end_step(), layout.groups,
                              lambda group, factor: group.store_residual(group.residual_value() * factor),
                              functools.partial(self._use_groups, layout))

    def _report_nonfinite(self, names: List[str], flags: Any, finite: Any, step: Any) -> bool:
        """Whether some rank had a non-finite gradient (``flags[r]``: rank r saw a NaN/Inf;
        ``finite[i]``: whether group ``names[i]`` is finite here). If one had, keep the report
        for :meth:`report_abandoned` and, with ``reports_in="exchange"``, apply the
        ``nonfinite`` policy now."""
        bad_ranks = [rank for rank, flag in enumerate(np.asarray(flags)) if flag]
        if not bad_ranks:
            return False
        assert self.nonfinite is not None
        groups = [name for name, ok in zip(names, np.asarray(finite)) if not ok]
        self._abandoned_report = (bad_ranks, int(np.asarray(step)), groups)
        if self.reports_in == "exchange":
            apply_nonfinite_policy(self.nonfinite, *self._abandoned_report)
        return True

    def _exchange_groups(self, kept: List[Any], layout: Layout, step: Any, warm: bool,
                         loss_scale: Optional[tf.Tensor]) -> List[tf.Tensor]:
        """One step's exchange of the (non-None) gradients ``kept``, which carry the loss scale
        ``loss_scale`` (None: unscaled), run by the layout's engine: every group sparsely, in the
        loss's own units (divided by ``loss_scale`` into the residual, the aggregate multiplied by
        it again), except those the engine plans dense (``min_numel``, ``dense=``, two tiers too
        small) and, with ``warm``, all of them (warm-up), which take Horovod's dense allreduce as
        they are. Stores the residuals and publishes the statistics; returns the aggregated
        gradients, in ``kept``'s order."""
        results = list(kept)
        engine = layout.engine
        engine.begin(step)
        size, rank = self.process_set.size(), self.process_set.rank()
        scale = 1.0 / size if self.op == hvd.Average else 1.0
        dense_groups: List[Tuple[FlatGroup, GroupStats]] = []
        host = isinstance(step, int)
        for position in range(len(kept) if host else 0):
            engine.timeline.param_ready(position)
        with tf.device(self.device_dense):
            for group in layout.groups:
                if host:
                    engine.timeline.group_ready(group.name)
                plan, stats = engine.plan(group.name, group.numel, warm, group.kept_dense)
                if plan.sparse:
                    engine.start_sparse(group, plan, stats, size, rank, scale, None,
                                        functools.partial(group.load_gradients, kept, loss_scale))
                else:
                    dense_groups.append((group, stats))
            self._exchange_dense_groups(dense_groups, kept, results)
            for flight in engine.flights:
                update = engine.finish_one(flight, loss_scale)
                if not tf.executing_eagerly():
                    # A graph prunes ops whose outputs are unused, and a collective one rank prunes
                    # (say an alltoall that receives nothing there) would hang the other ranks.
                    with tf.control_dependencies(flight.comm.launched):
                        update = tf.identity(update)
                for position, value in zip(flight.group.positions, flight.group.unflatten(update)):
                    results[position] = tf.cast(value, kept[position].dtype)
        recording.publish(engine.stats, self._record)
        if host:
            self._end_step(layout)
        return results

    def _exchange_dense_groups(self, groups: List[Tuple[FlatGroup, GroupStats]], kept: List[Any],
                               results: List[Any]) -> None:
        """Horovod's dense allreduce for the groups planned dense, with their statistics."""
        if not groups:
            return
        positions = [p for group, _ in groups for p in group.positions]
        # Horovod's TensorFlow allreduce does not take bfloat16: such gradients travel as float32.
        wire = [tf.cast(kept[p], tf.float32) if kept[p].dtype == tf.bfloat16 else kept[p] for p in positions]
        for position, value in zip(positions, self._horovod_reduce(wire)):
            results[position] = tf.cast(value, kept[position].dtype)
        for group, stats in groups:
            self._account_dense(stats, [kept[p] for p in group.positions])

    @staticmethod
    def _dense_gradient(grad: Any, source: Any) -> tf.Tensor:
        """``grad`` as a dense tensor: zeros when this rank has none (every rank then still takes
        part in the group's collectives), a ``tf.IndexedSlices`` (``sparse_as_dense``) converted."""
        if grad is None:
            return tf.zeros(source.shape, dtype=source.dtype)
        return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad


_EXCHANGERS: Dict[Tuple[Any, ...], GradientExchanger] = {}


def _compression_key(compression: Any) -> Any:
    """Sparsifiers compare by method and options (a new but equal ``Compression.topk(...)`` each
    step finds the same residuals); Horovod's compressors by identity."""
    if isinstance(compression, Sparsifier):
        return ("sparsifier", compression.method_name, compression.options)
    return ("horovod", compression)


def _groups_key(groups: Any) -> Any:
    if isinstance(groups, (list, tuple)):
        return tuple(tuple(v.ref() for v in members) for members in groups)
    return groups


def shared_exchanger(name: str, compression: Any, sparse_as_dense: bool, op: Any,
                     gradient_predivide_factor: float, groups: Any, process_set: hvd.ProcessSet,
                     device_dense: str, device_sparse: str, stats_log: Optional[IO[str]],
                     nonfinite: Optional[str], loss_scaler: Any = None,
                     hierarchical: Optional[bool] = None, dense: DenseSpec = None) -> GradientExchanger:
    """The exchanger for these arguments, created once per process and reused.

    A training loop wraps a new ``tf.GradientTape`` every step; the residuals must outlive it.
    As Horovod caches its allreduce function by its arguments, the exchanger is cached by
    them (within it, residuals are keyed by the variable list, so two models never share one).
    The stream and the loss scaler count by identity (the exchanger keeps them alive).
    """
    key = (name, _compression_key(compression), sparse_as_dense, op, gradient_predivide_factor,
           _groups_key(groups), process_set.process_set_id, device_dense, device_sparse, id(stats_log), nonfinite,
           id(loss_scaler), hierarchical, tuple(dense) if isinstance(dense, list) else dense)
    exchanger = _EXCHANGERS.get(key)
    if exchanger is None:
        exchanger = _EXCHANGERS[key] = GradientExchanger(
            name, compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set,
            device_dense, device_sparse, stats_log, nonfinite, loss_scaler=loss_scaler, hierarchical=hierarchical,
            dense=dense)
    return exchanger
