"""Outer steps on FSDP2's replica axis: sharded inside a replica, outer steps across replicas.

    mesh = init_device_mesh("cuda", (replicas, gpus_per_replica), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh["shard"])     # 1-D: FSDP never averages across replicas itself
    outer = hso.OuterSteps(model, inner, compression=hso.Compression.topk(density=0.01), every=50,
                           process_group=mesh["replicate"].get_group())

A model whose parameters are DTensors (``fully_shard``) is trained by its replica's ranks, each
holding a shard of every parameter; :class:`~horovod_sparse.outer.rounds.OuterSteps` then works on
each rank's local shards (:func:`local_shard`): one group per parameter's shard, its anchor and
residual of the shard's size, exchanged across ``process_group``, the ranks holding the same
shard in every replica (the replicas of one shard position). The outer optimizer steps the
DTensor parameters, each given the average of its shard as a DTensor gradient of the same
placement (:func:`gradient_like`), so its state is sharded like them (with ``offload``, it steps
the anchor's local shards in CPU memory instead). Streamed fragments are cut by the whole
parameters' sizes, so every shard of a parameter ends its round at the same inner step. The
configuration is agreed over the whole job
(with each parameter's whole shape) and then over the replicas (with the local shards' shapes),
and a non-finite shard abandons the round over the whole job: every shard of a round is
abandoned, or none.
"""
from __future__ import annotations

import functools
from typing import IO, Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from horovod_sparse.distributed.process_group import ProcessGroup
from horovod_sparse.distributed.stepping import distributed_engine, nonfinite_agreement
from horovod_sparse.engine.step import StepEngine
from horovod_sparse.fsdp.agreement import ShardedModelState
from horovod_sparse.fsdp.units import require_one_dimensional_meshes, require_replicas_of_one_shard
from horovod_sparse.outer.replicas import ProcessGroupReplicas, Replicas

def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any trainable parameter of ``model`` is a DTensor (sharded by FSDP2's ``fully_shard``)."""
    return any(isinstance(p, DTensor) for p in model.parameters() if p.requires_grad)


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """What the groups hold of parameter ``p``: this rank's shard of a DTensor (sharing its
    memory: writing it writes the parameter), or ``p`` itself."""
    if not isinstance(p, DTensor):
        return p
    with torch.no_grad():
        return p.to_local().detach()


def gradient_like(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard of an average) as the gradient of ``t``: a DTensor of ``t``'s
    mesh, placements, shape and stride when ``t`` is one, else ``local`` itself."""
    if not isinstance(t, DTensor):
        return local
    return DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())


def replicas_of(process_group: Optional[dist.ProcessGroup], model: torch.nn.Module) -> Replicas:
    """The replicas :class:`~horovod_sparse.outer.rounds.OuterSteps` exchanges across: those of one
    shard position for a model sharded by FSDP2 (:class:`ShardedReplicas`), else
    ``process_group``'s (:class:`~horovod_sparse.outer.replicas.ProcessGroupReplicas`)."""
    return ShardedReplicas(model, process_group) if is_sharded(model) else ProcessGroupReplicas(process_group)


class ShardedReplicas(ProcessGroupReplicas):
    """The replicas of this rank's shard position of an FSDP2 model: ``process_group`` (the
    ``replicate`` dimension of a ``("replicate", "shard")`` mesh) after checking, collectively
    over it, that the model was sharded over 1-D meshes (FSDP's own HSDP, a 2-D mesh, would
    average across replicas at every backward pass) and that the group's ranks hold the same
    shards (:func:`~horovod_sparse.fsdp.units.require_replicas_of_one_shard`): ``ValueError``
    naming the fix otherwise, on every rank of the group. The non-finite agreement runs over the
    whole job (every shard of a round abandoned together), and so does the configuration's
    (:class:`ShardedModelState`)."""

    def __init__(self, model: torch.nn.Module, process_group: Optional[dist.ProcessGroup]) -> None:
        require_one_dimensional_meshes(model, "process_group")
        super().__init__(process_group)
        require_replicas_of_one_shard(model, process_group)
        #: Each trainable parameter's key as the whole job sees it: its whole size and shape.
        self.whole = [(name, p.numel(), str(p.dtype), [list(p.shape)])
                      for name, p in model.named_parameters() if p.requires_grad]

    def engine(self, compression: Any, stats_log: Optional[IO[str]]) -> StepEngine:
        return distributed_engine(compression, self.process_group, stats_log,
                                  model_state=functools.partial(ShardedModelState, whole=self.whole))

    def agreement(self, policy: Optional[str], engine: StepEngine) -> Callable[[Sequence[str]], List[int]]:
        return nonfinite_agreement(policy, ProcessGroup(None))
