"""The DDP comm hook: every horovod_sparse method on ``torch.distributed``, used like PowerSGD.

    state = hsd.State(compression=hsd.Compression.micro(density=0.01))
    ddp_model.register_comm_hook(state, hsd.hook)

DDP's buckets are the groups. DDP calls :func:`hook` once per bucket, in bucket order, on every
rank; the hook adds the bucket to its error-feedback residual (``x = g + e``), starts the
method's exchange (its first collectives overlap the rest of the backward pass) and returns a
future. The last bucket's call finishes every exchange in bucket order (as the Horovod front
end's ``synchronize()`` does), agrees on non-finite gradients, closes the step and completes the
futures with the aggregated buckets, written over the buckets' own buffers as DDP's allreduce
writes its average (the hook keeps one buffer of the model's size, the residuals); DDP then
writes them into ``.grad``.

DDP rebuilds its buckets after the first synchronised backward pass (in torch 2.x its first
iteration puts every parameter in one bucket), so the first step of every :class:`State` is a
dense allreduce, as PowerSGD's ``start_powerSGD_iter``. Groups are kept per set of parameters,
not per bucket index (:mod:`horovod_sparse.ddp.buckets`): when buckets change, residuals follow
their parameters (nothing is lost), and the first iteration after loading a checkpoint, whose
single bucket holds every saved group, is exchanged as those groups, so the resume is exact.
"""
from __future__ import annotations

import math
from typing import IO, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from horovod_sparse.common.dense_choice import DenseSpec, chosen_dense
from horovod_sparse.common.nonfinite import resolve_nonfinite
from horovod_sparse.common.stall import ExchangeStalled
from horovod_sparse.common.tiers import Tiers, wants_hierarchical
from horovod_sparse.ddp.buckets import BucketGroups, join, split
from horovod_sparse.distributed.process_group import ProcessGroup
from horovod_sparse.distributed.tiers import ddp_tiers
from horovod_sparse.distributed.compression import Compression, checked_sparse
from horovod_sparse.distributed.stepping import dense_average, distributed_engine, nonfinite_agreement
from horovod_sparse.engine.flight import Flight
from horovod_sparse.engine.step import EngineSteps, StepOutcome
from horovod_sparse.torch_core.buffers import FlatGroup
from horovod_sparse.torch_core.device_timing import ready_timeline
from horovod_sparse.torch_core.finiteness import StepFiniteness, Finite
from horovod_sparse.torch_core.loss_scale import UNSCALED, LossScale, step_scale


class State(EngineSteps):
    """The hook's state: the method, its per-bucket residuals and state, and the step counter
    (one ``State`` per DDP model, as PowerSGD's).

    Args:
        compression: ``horovod_sparse.ddp.Compression.<method>(...)``, or ``Compression.none``
            / ``Compression.fp16`` (DDP's dense averaging).
        process_group: the ``torch.distributed`` group DDP reduces over (None: the default).
        nonfinite: what a NaN/Inf gradient on any rank does, as in the Horovod front ends:
            ``"raise"`` (default with a sparsifier) or ``"skip"``; None (default densely)
            checks nothing. Either way an affected step is abandoned on every rank: every
            aggregated gradient is zero, the residuals get back what the step delivered (each
            healthy rank keeps its gradient there: nothing lost) and a non-finite gradient
            never reaches a residual. ``"raise"`` then makes ``loss.backward()`` raise on every
            rank (a ``RuntimeError`` carrying the ``FloatingPointError`` message); ``"skip"``
            warns. DDP does not call the optimizer: skip ``optimizer.step()`` when
            ``state.last_stats.abandoned`` (zero gradients still move parameters under momentum
            or weight decay). With a ``loss_scaler`` the aggregated gradients of an abandoned
            step are NaN instead, and nothing is raised or warned: the scaler is told, as by
            DDP's own allreduce of an overflow (``scaler.step`` skips the step, ``update`` backs
            the scale off).
        stats_log: optional text stream; one JSON line of statistics per step.
        loss_scaler: the ``torch.amp.GradScaler`` whose ``scale(loss)`` the gradients come from
            (mixed precision): each gradient is divided by the scale as it enters the residual
            and the aggregate multiplied by it again, so the method and error feedback work in
            the loss's own units (a scale change loses nothing), and a non-finite step is left
            to the scaler (see ``nonfinite``). Required with a scaler and a sparsifier: without
            it the first overflow raises (``"raise"``).
        hierarchical: the two-tier sparse exchange (:mod:`horovod_sparse.common.tiers`, as the
            Horovod front ends' argument): each node sums its buckets densely (reduce-scatter),
            each slice of the node sum is exchanged by the method across nodes among the ranks
            owning it, and the node gathers the slices' updates. ``None`` follows
            ``HOROVOD_HIERARCHICAL_ALLREDUCE``. It needs the default process group; its
            subgroups (one per node, one per slice) are made at the first exchange.
        node_size: workers per node with ``hierarchical``, ranks ``[c * node_size, (c + 1) *
            node_size)`` on node ``c`` (as ``torchrun`` numbers them); default: ``torchrun``'s
            ``LOCAL_WORLD_SIZE`` (one node without it). Every rank must see the same.
        dense: parameters exchanged dense at every step whatever ``compression`` is (embeddings,
            normalisation layers, biases): names of the model's parameters (without DDP's
            ``module.`` prefix), ``fnmatch`` patterns (``"*.bias"``), a list of them, or a
            predicate on the name (:mod:`horovod_sparse.common.dense_choice`). DDP's buckets do
            not know names: call :meth:`attach` with the model before the first backward pass.
            In each bucket they form a group of their own (marked ``kept_dense`` in the
            statistics) averaged as DDP does, the rest of the bucket being sparsified.

    Every rank compares the configuration (method and options, ``nonfinite``, step counter)
    at its first exchange and after :meth:`load_state_dict`, and raises the same
    ``ValueError`` naming what differs before anything is exchanged.

    Attributes:
        steps: synchronised steps so far (hooks run; ``no_sync`` passes not counted).
        last_stats: the last step's statistics (``abandoned`` after a non-finite gradient).
        buckets: the groups, found from DDP's buckets.
    """

    def __init__(self, compression: Any = Compression.none, process_group: Optional[dist.ProcessGroup] = None,
                 nonfinite: Optional[str] = "default", stats_log: Optional[IO[str]] = None,
                 loss_scaler: Optional[torch.amp.GradScaler] = None, hierarchical: Optional[bool] = None,
                 node_size: Optional[int] = None, dense: DenseSpec = None) -> None:
        sparse = checked_sparse(compression, "ddp")
        self.compression = compression
        self.sparse = sparse
        self.nonfinite = resolve_nonfinite(nonfinite, sparse, scaled=loss_scaler is not None)
        self._loss_scale = LossScale(loss_scaler) if loss_scaler is not None else None
        self.process_group = ProcessGroup(process_group)
        #: This step's loss scale, read at its first bucket.
        self._scale = UNSCALED
        # The first step is dense: DDP's buckets are final after it.
        self._engine = distributed_engine(compression, self.process_group, stats_log, first_dense_steps=1)
        self._model = self._engine.model
        self._agree = nonfinite_agreement(self.nonfinite, self.process_group)
        self._hierarchical = sparse and wants_hierarchical(hierarchical)
        self._hierarchical_arg = hierarchical
        self._node_size = node_size
        self.buckets = BucketGroups(self._model)
        self._buckets_in_flight: List[Tuple[torch.futures.Future, List[torch.Tensor], List[Flight]]] = []
        self._finiteness = StepFiniteness(self.nonfinite is not None)
        self._check_due = True
        self._dense_spec = dense
        #: The names of the parameters kept dense, once :meth:`attach` resolved ``dense``.
        self._kept_dense: Optional[List[str]] = None if dense is not None else []

    def attach(self, model: torch.nn.Module) -> None:
        """Resolve ``dense`` against ``model``'s parameter names (``model``: the DDP model or the
        module it wraps). Raises ``ValueError`` naming the closest names when a name or pattern
        matches no parameter."""
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        chosen = chosen_dense(self._dense_spec, [name for name, _ in named])
        self._kept_dense = sorted(chosen)
        self.buckets.kept_dense = {p for name, p in named if name in chosen}

    @property
    def tiers(self) -> Optional[Tiers]:
        """The two-tier exchange's groups (None: flat), made after the first configuration check."""
        return self._engine.tiers

    # -- the hook -----------------------------------------------------------------------------
    def exchange(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Start the exchange of ``bucket``'s groups; the future completes once the last
        bucket's call finished the step. What :func:`hook` runs."""
        buffer, params = bucket.buffer(), bucket.parameters()
        self.process_group.place_payloads_with(buffer)
        self._engine.place_timeline(lambda: ready_timeline(buffer.device))
        if self._check_due:
            self._check_configuration()
        if bucket.index() == 0:
            self._scale = step_scale(self._loss_scale)
        groups = self.buckets.of_bucket(bucket.index(), params)
        finite = self._finiteness.check([g.name for g in groups], buffer)
        gradients = split(buffer, params, groups)
        started = [self._start(group, gradient, finite) for group, gradient in zip(groups, gradients)]
        future: torch.futures.Future = torch.futures.Future()
        self._buckets_in_flight.append((future, params, started))
        if bucket.is_last():
            self._finish_step()
        return future

    def _check_configuration(self) -> None:
        """At the first exchange after building or loading: every rank's configuration agreed,
        and in two tiers the nodes' groups made (collective)."""
        if self._kept_dense is None:
            raise ValueError("State(dense=...) names parameters, which DDP's buckets do not carry: call "
                             "state.attach(model) before the first backward pass")
        self._check_due = False
        self._model.require_same_configuration({"nonfinite": self.nonfinite, "steps": self.steps,
                                                "hierarchical": self._hierarchical,
                                                "dense": self._kept_dense}, [])
        if self._hierarchical and self.tiers is None:  # every rank asks for it: checked just now
            self._engine.tiers = ddp_tiers(self._hierarchical_arg, self._node_size, self.process_group)
            if self.tiers is not None:
                self._model.use_tiers(self.tiers)

    def _start(self, group: FlatGroup, gradient: torch.Tensor, finite: Finite) -> Flight:
        """Launch ``group``'s exchange of its flat ``gradient`` (the bucket's buffer, or the
        group's parameters copied out of it): the update is written over it, as DDP's own
        allreduce writes the average into the bucket, so a group keeps its residual and no
        update buffer of its own."""
        engine = self._engine
        engine.timeline.group_ready(group.name)
        return engine.start(group, lambda: group.load_flat(gradient, self._scale.inverse, finite, hand_over=True),
                            dense_average(engine, group, gradient, self.compression, finite))

    def _finish_step(self) -> None:
        """Finish every group's exchange in bucket order, abandon the step everywhere if a rank
        saw a non-finite gradient, close the step and complete the futures."""
        engine = self._engine
        engine.timeline.backward_ended()
        finished, self._buckets_in_flight = self._buckets_in_flight, []
        try:
            results = [self._finish_bucket(params, started) for _, params, started in finished]
        except ExchangeStalled as stalled:  # backward() raises it on every rank left waiting
            for future, _, _ in finished:
                future.set_exception(stalled)
            return

        def deliver(abandoned: bool) -> None:  # DDP writes the results into .grad
            if abandoned:
                for update in results:
                    update.fill_(math.nan if self._loss_scale is not None else 0.0)

        error = self._nonfinite_error(engine.end(self._finiteness, self._agree, deliver, self._end_step))
        futures = [future for future, _, _ in finished]
        for future, update in zip(futures if error is None else futures[:-1], results):
            future.set_result(update)
        # DDP recovers from a failed future (its next step runs normally), not from a hook
        # that raises: the error goes to the last bucket's future, which backward() waits for.
        if error is not None:
            futures[-1].set_exception(error)

    def _finish_bucket(self, params: List[torch.Tensor], started: List[Flight]) -> torch.Tensor:
        """Finish the exchanges of one bucket's groups: the bucket's aggregate."""
        updates = [self._engine.finish_one(flight, self._scale.scale) for flight in started]
        return join(updates, params, [flight.group for flight in started])

    def _nonfinite_error(self, outcome: StepOutcome) -> Optional[FloatingPointError]:
        """Apply the ``nonfinite`` policy to an abandoned step: warn (``"skip"``), or return the
        ``FloatingPointError`` to raise (``"raise"``); nothing with a loss scaler (the NaN
        aggregate tells it)."""
        if self._loss_scale is not None:
            return None
        try:
            outcome.apply_policy(self.nonfinite)
        except FloatingPointError as error:
            return error
        return None

    def _end_step(self, timeline: Any) -> None:
        """The model's end of step (:meth:`StepEngine.close`): buckets, then the method."""
        self.buckets.end_step()
        self._model.end_step(timeline)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's state: the step counter, the method's own state (LAGS's measurements)
        and per group its residual and method state, with the numbers and sizes of its
        parameters; tensors and plain containers (``torch.load(weights_only=True)`` reads it).
        Residuals are per rank: save every rank's state to resume exactly."""
        return self.buckets.record(self.steps)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`, on any number of workers (state built for another
        world size is rebuilt at the next exchange; only the same number resumes exactly). The
        residuals and method states are taken as DDP hands over the buckets; a parameter of
        another size raises ``ValueError`` then, on every rank."""
        self.buckets.load(state_dict)
        self._model.load_method(state_dict)
        self._engine.restart_at(int(state_dict["steps"]))
        self._check_due = True


#: The refusal of a comm-hook call without a bucket (Dynamo's Python reducer).
PYTHON_REDUCER_REFUSAL = (
    "horovod_sparse.ddp.hook was called with a {got}, not a torch.distributed.GradBucket: "
    "torch._dynamo.config.optimize_ddp = 'python_reducer' hands comm hooks one (grad, param) pair per parameter, "
    "and a sparse exchange needs DDP's buckets. Keep Dynamo's default optimize_ddp ('ddp_optimizer'; compiled "
    "autograd works with it) when compiling a DDP model that uses this hook.")


def hook(state: State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook: ``ddp_model.register_comm_hook(state, hook)`` (see :class:`State`).

    Under ``torch.compile`` it runs with DDP's buckets as usual (Dynamo's default
    ``optimize_ddp="ddp_optimizer"``, compiled autograd or not). Dynamo's Python reducer
    (``optimize_ddp="python_reducer"``) calls a comm hook with one ``(grad, param)`` pair per
    parameter instead of a bucket: refused, with the fix, before anything is exchanged."""
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(PYTHON_REDUCER_REFUSAL.format(got=type(bucket).__name__))
    return state.exchange(bucket)


# DDP compares the hook's annotations with the objects themselves, not with their names.
hook.__annotations__ = {"state": State, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
