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

import warnings
from contextlib import contextmanager
from typing import IO, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from horovod_sparse.common.grouping import ParamInfo, form_groups
from horovod_sparse.common.stats import GroupStats, StatsLog, StepStats
from horovod_sparse.torch.buffers import FlatGroup
from horovod_sparse.torch.collectives import Communicator, Pending
from horovod_sparse.torch.sparsifier import Exchange, Sparsifier

NamedParameters = Iterable[Tuple[str, torch.Tensor]]


class _Inflight:
    """A group's exchange that has been launched and not yet finished."""

    def __init__(self, exchange: Exchange, comm: Communicator, group: FlatGroup, sparse: bool) -> None:
        self.exchange = exchange
        self.comm = comm
        self.group = group
        self.sparse = sparse
        self.pendings: Optional[Sequence[Pending]] = None

    def advance(self, outputs: Optional[List[Any]]) -> bool:
        """Run the exchange up to its next wait; False once it has finished."""
        try:
            self.pendings = next(self.exchange) if outputs is None else self.exchange.send(outputs)
            return True
        except StopIteration:
            self.pendings = None
            return False

    def finish(self) -> None:
        """Drive the exchange to completion, waiting for each round's collectives."""
        while self.pendings is not None:
            outputs = self.comm.wait(self.pendings)
            self.advance(outputs)


def _dense_exchange(group: FlatGroup, compression: Any, comm: Communicator, op: Any,
                    prescale: float, postscale: float) -> Exchange:
    """Horovod's own path: one in-place allreduce per gradient, through ``compression``."""
    pendings, contexts = [], []
    for name, p in zip(group.names, group.params):
        compressed, ctx = compression.compress(p.grad)
        pendings.append(comm.allreduce(compressed, name, "values", op=op, prescale_factor=prescale,
                                       postscale_factor=postscale))
        contexts.append(ctx)
    comm.stats.selected = comm.stats.union = group.numel
    outputs = yield pendings
    for p, output, ctx in zip(group.params, outputs, contexts):
        p.grad.set_(compression.decompress(output, ctx))


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer` (as Horovod does)."""

    def __init__(self, params: Any, named_parameters: Optional[NamedParameters], compression: Any,
                 backward_passes_per_step: int, op: Any, gradient_predivide_factor: float,
                 groups: Any, sparse_as_dense: bool, process_set: hvd.ProcessSet,
                 stats_log: Optional[IO[str]]) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[misc]
        self._compression = compression
        self._sparse = isinstance(compression, Sparsifier)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._stats_log = StatsLog(stats_log) if stats_log is not None else None

        names = _parameter_names(self.param_groups, named_parameters)
        ordered = [(names[p], p) for group in self.param_groups for p in group["params"]
                   if p.requires_grad and (p.is_floating_point() or p.is_complex())]
        self._groups = self._form_groups(ordered, groups)
        self._group_of = {p: g for g in self._groups for p in g.params}
        self._states: Dict[int, Any] = {}
        self._delay = {p: backward_passes_per_step for _, p in ordered}
        self._ready_count = {g.index: 0 for g in self._groups}
        self._inflight: Dict[int, _Inflight] = {}
        self._step_stats = StepStats(step=0)
        self.last_stats: Optional[StepStats] = None
        self.steps = 0
        self._synchronized = False
        self._should_synchronize = True
        if self.process_set.included():
            for _, p in ordered:
                p.register_post_accumulate_grad_hook(self._hook)

    # -- grouping ---------------------------------------------------------------------------------
    def _form_groups(self, ordered: List[Tuple[str, torch.Tensor]], spec: Any) -> List[FlatGroup]:
        infos = [ParamInfo(name, p.numel(), f"{p.dtype}/{p.device}") for name, p in ordered]
        if isinstance(spec, (list, tuple)):
            position = {id(p): i for i, (_, p) in enumerate(ordered)}
            for members in spec:
                for p in members:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
            spec = [[position[id(p)] for p in members if id(p) in position] for members in spec]
        default = self._compression.default_grouping if self._sparse else "tensor"
        return [FlatGroup(i, [ordered[j][0] for j in members], [ordered[j][1] for j in members])
                for i, members in enumerate(form_groups(infos, spec, default))]

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
        group = self._group_of[p]
        self._ready_count[group.index] += 1
        if self._ready_count[group.index] == len(group.params):
            self._launch(group)

    def _is_dense(self, group: FlatGroup) -> bool:
        return (not self._sparse or self.steps < self._compression.options.warmup_steps
                or group.numel < self._compression.options.min_numel)

    def _launch(self, group: FlatGroup) -> None:
        for p in group.params:
            if p.grad is None:
                # Not computed on this rank this step (dynamic graph); another rank may have it.
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                if not self.sparse_as_dense:
                    raise ValueError(f"parameter {self._group_of[p].name!r} has a sparse gradient; "
                                     "pass sparse_as_dense=True to exchange it as a dense one")
                p.grad = p.grad.to_dense()
        sparse = not self._is_dense(group)
        target = self._compression.options.count(group.numel) if sparse else group.numel
        stats = GroupStats(group.name, group.numel, target, dense=not sparse)
        self._step_stats.groups.append(stats)
        size = self.process_set.size()
        if self.op == hvd.Average:
            prescale, postscale = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
            scale = 1.0 / size
        else:
            prescale = postscale = scale = 1.0
        comm = Communicator(self.process_set, group.name, stats, scale)
        if sparse:
            if group.index not in self._states:
                self._states[group.index] = self._compression.new_state(group.numel, size)
            with comm.timer("flatten"):
                x = group.load_gradients()
                out = group.zeroed_output()
            exchange = self._compression.exchange(x, out, comm, self._states[group.index], self.steps)
        else:
            compression = hvd.Compression.none if self._sparse else self._compression
            exchange = _dense_exchange(group, compression, comm, self.op, prescale, postscale)
        inflight = _Inflight(exchange, comm, group, sparse)
        if inflight.advance(None):
            self._inflight[group.index] = inflight
        elif sparse:
            group.publish()

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
        for group in self._groups:
            if group.index not in self._inflight and self._ready_count[group.index] < len(group.params):
                self._launch(group)
        for index in sorted(self._inflight):
            inflight = self._inflight[index]
            inflight.finish()
            if inflight.sparse:
                inflight.group.publish()
        self._inflight.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        for index in self._ready_count:
            self._ready_count[index] = 0
        self._close_step()
        self._synchronized = True

    def _close_step(self) -> None:
        self._step_stats.groups.sort(key=lambda s: s.name)
        self.last_stats = self._step_stats
        if self._stats_log is not None:
            self._stats_log.write(self._step_stats)
        self.steps += 1
        self._step_stats = StepStats(step=self.steps)

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
                              "after optimizer.synchronize(). This can cause training slowdown.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._inflight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as "
                                 "it can cause a race condition.")
        super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes


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
                         stats_log: Optional[IO[str]] = None) -> torch.optim.Optimizer:
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
        op: ``hvd.Average`` or ``hvd.Sum``. ``hvd.Adasum`` is only available with a dense
            compression (it is delegated to Horovod's own Adasum optimizer).
        gradient_predivide_factor: splits the averaging before and after the sum (dense path).
        num_groups: deprecated alias of ``groups`` (as in Horovod).
        groups: an int, lists of parameters (Horovod's meaning), or ``"tensor"`` / ``"model"``;
            ``None`` uses the sparsifier's natural grouping (per tensor for Top-k).
        sparse_as_dense: exchange ``torch.sparse`` gradients as dense tensors (required for
            them; sparse gradients are otherwise refused with an error).
        process_set: the Horovod process set to reduce over.
        stats_log: optional text stream; one JSON line of statistics is written per step.

    Returns:
        An optimizer of the same class as ``optimizer`` (dynamically subclassed, as Horovod
        does), with ``synchronize()``, ``skip_synchronize()``, ``last_stats`` and ``groups``.
    """
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`.", DeprecationWarning)
        groups = num_groups if groups is None else groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    sparse = isinstance(compression, Sparsifier)
    if isinstance(compression, type) and issubclass(compression, Sparsifier):
        raise TypeError(f"compression={compression.__name__} is a class; create an instance with "
                        f"Compression.{compression.method_name}(density=...)")
    if op == hvd.Adasum:
        if sparse:
            raise ValueError("op=hvd.Adasum combines dense gradients and cannot be used with a "
                             "sparsifier; use op=hvd.Average")
        return hvd.DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step,
                                        op, gradient_predivide_factor, 0, groups, sparse_as_dense, process_set)
    if sparse and gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor applies to dense allreduces only; sparse exchanges "
                         "sum exactly the selected values. Leave it at 1.0 with a sparsifier.")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, stats_log)


__all__ = ["DistributedOptimizer"]
