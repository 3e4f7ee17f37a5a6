"""Outer steps (DiLoCo, SparseLoCo) under ``horovodrun``: :class:`~horovod_sparse.outer.rounds.OuterSteps`
over Horovod's collectives and process sets.

    import horovod.torch as hvd
    import horovod_sparse.torch as hs

    hvd.init()
    outer = hs.OuterSteps(model, torch.optim.AdamW(model.parameters()),
                          compression=hs.Compression.topk(density=1 / 64), every=50)
    for batch in loader:
        loss_fn(model(batch)).backward()
        outer.step()            # the inner step; every 50th call also the outer step (collective)
        outer.zero_grad()

The rounds, their options (``overlap``, ``fragments``, ``offload``, ``hierarchical``) and their
checkpoints are the ``torch.distributed`` outer steps' (:mod:`horovod_sparse.outer.rounds`); only
the collectives differ: the method's exchange through Horovod's (the Horovod optimizer's
transport), the dense average through Horovod's allreduce, the agreement over the process set.
Under Horovod elastic they commit, roll back and agree through ``hvd.elastic.TorchState``
(:mod:`horovod_sparse.torch.elastic`).

In two tiers (``hierarchical=True``) the nodes are Horovod's hosts (``horovodrun -H
host1:L,host2:L``), each host's workers one DiLoCo replica; its inner steps exchange densely inside
the host through Horovod's optimizer over the host's process set, made before the outer steps:

    hvd.init(process_sets="dynamic")
    inner = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters()),
                                     named_parameters=model.named_parameters(),
                                     process_set=hs.node_process_set())
    outer = hs.OuterSteps(model, inner, compression=hs.Compression.topk(density=1 / 64), every=50,
                          hierarchical=True)
"""
from __future__ import annotations

import copy
from typing import IO, Any, Callable, Dict, List, Optional, Sequence

import horovod.torch as hvd
import torch

from horovod_sparse.common.horovod_job import in_elastic_job
from horovod_sparse.common.horovod_tiers import horovod_tiers, node_process_set as find_node_set
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.common.tiers import Tiers
from horovod_sparse.distributed.compression import Compression as DenseWire
from horovod_sparse.distributed.stepping import replicas_dense_average
from horovod_sparse.engine.flight import Flight
from horovod_sparse.engine.model_state import ModelState
from horovod_sparse.engine.step import StepEngine
from horovod_sparse.engine.topology import Transport
from horovod_sparse.methods.base import checked_sparse
from horovod_sparse.outer import rounds
from horovod_sparse.outer.outer_optimizer import OuterOptimizerArgument
from horovod_sparse.outer.checkpoint import no_regrouping
from horovod_sparse.outer.replicas import Replicas
from horovod_sparse.torch import backend
from horovod_sparse.torch.collectives import Communicator, agree_at_step_end, gather_places
from horovod_sparse.torch_core.finiteness import Finite
from horovod_sparse.torch_core.device_figures import read_scalars


def node_process_set() -> hvd.ProcessSet:
    """This rank's host's Horovod process set (its node in two tiers: Horovod's ``cross_rank``),
    found among the registered ones or added (``hvd.init(process_sets="dynamic")``), for the inner
    steps' dense exchange inside the node: ``hvd.DistributedOptimizer(..., process_set=
    hs.node_process_set())``, built before ``OuterSteps(..., hierarchical=True)``, whose tiers take
    the same set. Collective over the job."""
    return find_node_set(hvd, gather_places)


class ProcessSetReplicas:
    """The replicas of a Horovod process set (None: every process)."""

    def __init__(self, process_set: Optional[hvd.ProcessSet]) -> None:
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.agree_at_construction = not in_elastic_job()

    @property
    def job_rank(self) -> int:
        """This process's rank in the job now (an elastic job numbers its workers anew)."""
        return hvd.rank()

    @property
    def job_size(self) -> int:
        """The job's size now (an elastic job's changes)."""
        return hvd.size()

    def checked_sparse(self, compression: Any) -> bool:
        return checked_sparse(compression, "torch", backend,
                              lambda dense: dense in (hvd.Compression.none, hvd.Compression.fp16))

    def engine(self, compression: Any, stats_log: Optional[IO[str]]) -> StepEngine:
        model = ModelState(compression, backend, self.process_set, None)
        return StepEngine(compression, model, Transport(Communicator, self.process_set, True, read_scalars), stats_log)

    def tiers(self, hierarchical: bool, node_size: Optional[int]) -> Optional[Tiers]:
        """The two tiers of Horovod's hosts (:func:`~horovod_sparse.common.horovod_tiers.horovod_tiers`:
        the global process set only; the node's and the slices' process sets found or added),
        or None. ``node_size`` is refused (the hosts are the nodes), as is a Horovod elastic job
        (its hosts change), each naming the fix. Collective."""
        if not hierarchical:
            return None
        if node_size is not None:
            raise ValueError(f"horovod_sparse.torch.OuterSteps takes Horovod's hosts as the nodes (horovodrun -H "
                             f"host1:L,host2:L): leave node_size=None (given: {node_size})")
        if not self.agree_at_construction:  # an elastic job
            raise ValueError("hierarchical=True does not follow elastic changes of the hosts: use "
                             "hierarchical=False in a Horovod elastic job")
        return horovod_tiers(True, hvd, self.process_set, gather_places)

    def dense_flight(self, engine: StepEngine, group: Any, buffer: torch.Tensor, compression: Any,
                     finite: Finite) -> Callable[[GroupStats], Flight]:
        wire = DenseWire.fp16 if compression is hvd.Compression.fp16 else DenseWire.none
        return replicas_dense_average(engine, group, buffer, wire, finite)

    def agreement(self, policy: Optional[str], engine: StepEngine) -> Callable[[Sequence[str]], List[int]]:
        """The ranks that saw a non-finite pseudo-gradient; in two tiers also the ranks' Horovod
        collectives of the round leveled (:func:`~horovod_sparse.torch.collectives.agree_at_step_end`),
        so that the training loop's own unnamed collectives pair up across ranks."""
        return lambda groups: agree_at_step_end(policy, groups, self.process_set, self.process_set.rank(),
                                                engine.tiers, engine.stats)

    def node_group(self, tiers: Tiers) -> hvd.ProcessSet:
        """The node's Horovod process set (:func:`node_process_set`'s)."""
        return tiers.node_set

    def broadcast_from_first(self, tensors: Sequence[torch.Tensor]) -> None:
        root = self.process_set.ranks[0] if self.process_set.ranks else 0
        for i, t in enumerate(tensors):
            hvd.broadcast_(t, root, name=f"hs.outer.start.{i}", process_set=self.process_set)

    def place(self, like: torch.Tensor) -> None:
        """Nothing: Horovod's collectives take the payloads where they are."""


class OuterSteps(rounds.OuterSteps):
    """:class:`horovod_sparse.outer.rounds.OuterSteps` over Horovod: every argument as there, but
    ``compression`` a method of ``horovod_sparse.torch.Compression`` (or its ``none``, DiLoCo's
    dense average, and ``fp16``) and ``process_set`` the Horovod process set of the replicas
    (default: every process) in place of ``process_group``; with ``hierarchical=True`` the nodes
    are Horovod's hosts (``node_size`` refused; the module's docstring). Build it after
    ``hvd.init()``, on every rank of the process set.

    In a Horovod elastic job (``HOROVOD_ELASTIC=1``: ``horovodrun --min-np``/``--max-np``), over
    every worker: construction is not collective (a worker may join a running job), and
    ``hvd.elastic.TorchState(outer=outer, ...)`` commits, rolls back and agrees its state
    (:mod:`horovod_sparse.torch.elastic`: :meth:`snapshot`, :meth:`roll_back`,
    :meth:`agree_after_change`)."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 compression: Any = hvd.Compression.none, every: int = 50,
                 outer_optimizer: OuterOptimizerArgument = None,
                 process_set: Optional[hvd.ProcessSet] = None, nonfinite: Optional[str] = "default",
                 stats_log: Optional[IO[str]] = None, overlap: bool = False, fragments: int = 1,
                 offload: bool = False, hierarchical: bool = False, node_size: Optional[int] = None) -> None:
        super().__init__(model, inner_optimizer, compression, every, outer_optimizer, process_set, nonfinite,
                         stats_log, overlap, fragments, offload, hierarchical, node_size)

    @staticmethod
    def _replicas_of(process_set: Any, model: torch.nn.Module) -> Replicas:
        """The replicas of ``process_set`` (a Horovod process set)."""
        return ProcessSetReplicas(process_set)

    def snapshot(self) -> Dict[str, Any]:
        """A copy of this rank's whole state, in memory and for any job size (:meth:`state_dict`'s:
        the model, both optimizers, the anchor, the position, the step counter, residuals and
        method states, what landed of an overlapped exchange): what ``TorchState.commit()``
        keeps. Collective with an exchange in flight (``overlap``: it is ended first), else not."""
        return copy.deepcopy(self._whole_state())

    def roll_back(self, snapshot: Dict[str, Any]) -> None:
        """Back to ``snapshot`` (this rank's :meth:`snapshot`) exactly, which stays as it was for
        another roll-back. Not collective (after a worker was lost every collective of the old
        world fails): an exchange the loss interrupted is dropped with all it had changed, so
        nothing of the lost round is applied, and nothing twice when it is trained again."""
        self._continue_from(copy.deepcopy(snapshot))

    def agree_after_change(self, new: bool) -> None:
        """After a membership change, on every worker of the new world at once (``TorchState``'s
        sync): every rank takes rank 0's position and step counter; the configuration is checked
        (the same ``ValueError`` on every rank naming what differs: a joining worker built
        otherwise is refused before anything of it is used); every rank takes rank 0's method
        state shared by all ranks, anchor, outer optimizer state and what landed. A ``new``
        worker (none of its state committed in this job) puts its parameters at the anchor and
        keeps its empty residuals and fresh inner optimizer; the others keep theirs (at a round
        boundary every replica's parameters are the anchor). Collective."""
        first = hvd.broadcast_object(
            {"position": self.position, "steps": self.steps, "outer": self.outer_optimizer.state_dict(),
             "landed": None if self._landed is None else self._landed.record()} if hvd.rank() == 0 else None,
            root_rank=0, name="hs.outer.elastic")
        self.position = int(first["position"])
        self._engine.restart_at(int(first["steps"]))
        self._require_same_configuration()
        self._state.agree(0, self.groups, self.steps, no_regrouping)
        for i, flat in enumerate(self.anchor.flat):
            hvd.broadcast_(flat, 0, name=f"hs.outer.elastic.anchor.{i}")
        if new:
            self.anchor.reset()
        self.outer_optimizer.load_state_dict(first["outer"])
        self._land_record(first["landed"])
