"""The gradient-exchange driver behind ``DistributedGradientTape`` and the Keras optimizer.

The counterpart of the driving half of :mod:`horovod_sparse.torch.exchanging`. A
:class:`GradientExchanger` takes the list of gradients of one step and returns the aggregated
ones, in the same order:

* with Horovod's own ``Compression.none`` / ``Compression.fp16`` it is exactly Horovod's
  gradient-allreduce function (``horovod.tensorflow._make_allreduce_grads_fn``: same ops, same
  names, same grouping), so the tape behaves like ``hvd.DistributedGradientTape``;
* with a sparsifier, gradients are grouped into flat buffers (the shared
  :func:`~horovod_sparse.common.grouping.form_groups`) and the step runs on the step engine of
  the PyTorch front ends (:class:`~horovod_sparse.engine.step.StepEngine`): each group's
  ``g + e`` is handed to the sparsifier's exchange generator, all groups are started in group
  order and then finished in group order, the residuals are written back, and groups the engine
  plans dense (below ``min_numel``, kept dense, within ``warmup_steps``) take Horovod's dense
  allreduce (:mod:`horovod_sparse.tensorflow.dense`).

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
import time
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_sparse.common.arguments import check_wrapper_arguments, op_name
from horovod_sparse.common.dense_choice import DenseSpec
from horovod_sparse.common.nonfinite import resolve_nonfinite
from horovod_sparse.common.stats import StatsLog, StepStats
from horovod_sparse.common.tiers import Tiers, wants_hierarchical
from horovod_sparse.methods.base import Sparsifier, Step
from horovod_sparse.tensorflow import recording
from horovod_sparse.tensorflow.collectives import eager_capable
from horovod_sparse.tensorflow.dense import DenseExchange, PlannedDense, horovod_groups
from horovod_sparse.tensorflow.elastic import refuse_elastic
from horovod_sparse.tensorflow.host_step import host_step
from horovod_sparse.tensorflow.layout import Layout, Layouts
from horovod_sparse.tensorflow.loss_scale import ScaleReader, scale_of
from horovod_sparse.tensorflow.nonfinite_steps import NonfiniteSteps
from horovod_sparse.tensorflow.shared_state import SharedState


def _exchangeable(source: Any) -> bool:
    """Whether a sparsifier exchanges ``source``'s gradient: floating dtype, at least one element."""
    return tf.as_dtype(source.dtype).is_floating and tf.TensorShape(source.shape).num_elements() != 0


class GradientExchanger(Layouts, SharedState, NonfiniteSteps, DenseExchange):
    """Exchanges one step's gradients over Horovod: sparsely through a sparsifier, or densely
    through Horovod's own allreduce function.

    Args:
        name: prefix of Horovod's op names on the dense path (as Horovod's wrappers use).
        compression: a horovod_sparse sparsifier or Horovod's ``Compression.none`` / ``.fp16``.
        sparse_as_dense: exchange ``tf.IndexedSlices`` gradients as dense tensors (sparsified
            too, with a sparsifier); otherwise their rows are aggregated exactly, as Horovod does.
        op: ``hvd.Average`` or ``hvd.Sum`` with a sparsifier; any Horovod op densely.
        gradient_predivide_factor: dense path only (a sparsifier refuses anything but 1.0).
        groups: with a sparsifier: an int, ``"buckets"``, ``"buckets:M"``, ``"tensor"``,
            ``"model"``, ``"size:N"`` or lists of variables (``None``: the method's natural
            grouping); densely: Horovod's meaning.
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
        if self.sparse and compression.residual_decay != 1.0:
            raise ValueError(f"{compression.method_name}'s error_decay={compression.residual_decay} is applied by the "
                             "PyTorch front ends only; with TensorFlow give error_decay=1.0 (nothing lost)")
        if self.sparse and compression.needs_shapes:
            raise ValueError(f"{compression.method_name}'s blocks=True runs in the PyTorch front ends only (its blocks "
                             "are built once per group on the device); with TensorFlow give blocks=False")
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
        self._horovod_reduce = hvd._make_allreduce_grads_fn(
            name, device_dense, device_sparse, hvd.Compression.none if self.sparse else compression,
            sparse_as_dense, op, gradient_predivide_factor, None if self.sparse else horovod_groups(groups),
            process_set)
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
    def _exchange_sparse(self, grads: Sequence[Any], sources: Sequence[Any]) -> List[Any]:
        if not self.process_set.included():
            return list(grads)
        eager = tf.executing_eagerly()
        if not eager_capable():
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
            what = ("MergeComp's grouping" if layout.mergecomp is not None
                    else f"{self.compression.method_name}'s exchange")
            exchanged, abandoned = host_step(lambda grads, scale: self._sparse_step(grads, layout, scale),
                                             kept, loss_scale, what)
        else:
            exchanged, abandoned = self._sparse_step(kept, layout, loss_scale)
        if self.reports_in == "apply" and self.nonfinite is not None:
            self._abandoned_flag().assign(abandoned)
        for position, value in zip(positions, exchanged):
            results[position] = value
        return results

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
                              functools.partial(self._use_groups, layout))

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
        host = isinstance(step, int)
        for position in range(len(kept) if host else 0):
            engine.timeline.param_ready(position)
        with tf.device(self.device_dense):
            for group in layout.groups:
                if host:
                    engine.timeline.group_ready(group.name)
                engine.start(group, functools.partial(group.load_gradients, kept, loss_scale),
                             functools.partial(PlannedDense, group), dense_step=warm)
            self._exchange_dense_groups([f for f in engine.flights if not f.sparse], kept, results)
            for flight in [f for f in engine.flights if f.sparse]:
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
