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
from typing import IO, Any, Callable, Dict, Optional, Union

import horovod.torch as hvd
import horovod.torch.optimizer as horovod_optimizer
import torch
from horovod.torch.compression import Compressor

from horovod_sparse.common.arguments import check_backward_passes, check_wrapper_arguments, merge_num_groups, op_name
from horovod_sparse.common.dense_choice import DenseSpec
from horovod_sparse.common.nonfinite import resolve_nonfinite
from horovod_sparse.engine.step import EngineSteps
from horovod_sparse.methods.base import Sparsifier
from horovod_sparse.torch.exchanging import ExchangingOptimizer
from horovod_sparse.torch.loop_calls import LoopCalls
from horovod_sparse.torch.parameters import NamedParameters
from horovod_sparse.torch.shared_state import SharedState
from horovod_sparse.torch_core.loss_scale import LossScale


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
        groups: an int or lists of parameters (Horovod's meaning); ``"buckets"`` (flat buckets of
            at most 25 MiB, as DDP's, filled from the last parameter, whose gradient is ready
            first), ``"buckets:M"`` (M MiB), ``"tensor"`` (one group per parameter), ``"model"``
            (one group), ``"size:N"`` (adjacent parameters merged up to N elements); or
            ``"mergecomp"`` / a ``MergeCompOptions`` (the MergeComp scheduler chooses from
            measured step times: see ``optimizer.mergecomp.result``). ``None`` uses the
            sparsifier's natural grouping (``"buckets"``; ``"size:8192"`` for LAGS, the whole
            model for MiCRO, ExDyna and gTop-k).
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
    # What the mixed-in classes define, not their instance-dict descriptors (the user's class has its own).
    attributes: Dict[str, Any] = {}
    for mixin in (EngineSteps, LoopCalls, SharedState, ExchangingOptimizer):
        attributes.update((name, value) for name, value in mixin.__dict__.items()
                          if name not in ("__dict__", "__weakref__"))
    attributes.update(__module__=horovod_optimizer.__name__, _base_step=base.step)
    cls = type(base.__name__, (initialising,), attributes)
    SparseDistributedOptimizer.register(cls)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, stats_log, nonfinite, loss_scale,
               hierarchical, dense)


__all__ = ["DistributedOptimizer", "SparseDistributedOptimizer"]
