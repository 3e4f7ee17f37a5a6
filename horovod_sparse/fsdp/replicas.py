"""Every horovod_sparse method on the replica axis of FSDP2: the front end for sharded training.

FSDP2 (``fully_shard``) reduce-scatters each unit's gradients inside its ``shard`` group; the
replicas of a shard (the ``replicate`` axis of a 2-D mesh, one rank per node in HSDP) must still
be averaged across the slow network. :func:`compress_replicas` registers one all-reduce hook per
FSDP unit (``set_all_reduce_hook``): the hook gets the unit's reduce-scattered shard (the shard
group's mean, padded as FSDP pads), adds the unit's error-feedback residual (one per unit and
rank), runs the method over the replicate group through the step engine
(:mod:`horovod_sparse.engine.step`) and writes the average over every rank back in place, which
FSDP hands to the sharded ``.grad``. Per unit a step is the flat method over the ``R`` replicas
fed their shards, scaled by ``1 / R``. FSDP's hook point gives no future, so a unit's exchange
finishes inside its hook. A step ends when the backward pass does (a callback queued by the
first hook): the non-finite policy is agreed over the whole job, the step closes. FSDP's own HSDP
(a 2-D mesh given to ``fully_shard``) all-reduces across replicas itself and is refused.
"""
from __future__ import annotations

import functools
import math
from typing import IO, Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from horovod_sparse.common.dense_choice import DenseSpec
from horovod_sparse.common.nonfinite import resolve_nonfinite
from horovod_sparse.distributed.process_group import ProcessGroup
from horovod_sparse.distributed.compression import checked_sparse
from horovod_sparse.distributed.rank_state import rank_entry, state_of_this_rank
from horovod_sparse.distributed.stepping import dense_average, distributed_engine, nonfinite_agreement
from horovod_sparse.engine.model_state import Record
from horovod_sparse.engine.step import EngineSteps
from horovod_sparse.fsdp.agreement import ShardedModelState
from horovod_sparse.fsdp.checkpoint import unit_group
from horovod_sparse.fsdp.units import ShardGroup, fill_gradients, hook_units, replicate_group_given
from horovod_sparse.torch_core.device_timing import ready_timeline
from horovod_sparse.torch_core.finiteness import StepFiniteness
from horovod_sparse.torch_core.loss_scale import UNSCALED, LossScale, step_scale


class State(EngineSteps):
    """The replica exchange of one FSDP2 model (build it with :func:`compress_replicas`).

    Args:
        compression: ``horovod_sparse.fsdp.Compression.<method>(...)`` (the DDP front end's
            namespace), or ``Compression.none`` / ``Compression.fp16`` (a dense average).
        replicate_group: the ``torch.distributed`` group of this rank's replicas (a 2-D mesh's
            ``mesh["replicate"].get_group()``); None: the default group, or the one
            :func:`compress_replicas` is given with this state. Nothing asks ``torch.distributed``
            anything before :meth:`attach`: a trainer may build the state before
            ``init_process_group``.
        nonfinite: what a NaN/Inf gradient on any rank does, as in the other front ends
            (``"raise"`` by default with a sparsifier: ``backward()`` raises ``FloatingPointError``
            on every rank; ``"skip"``: a warning and zero gradients; None: no check), after the
            residuals are restored. With a ``loss_scaler`` the gradients of an abandoned step are
            NaN on every rank instead, and the scaler skips the step and backs off.
        stats_log: a text stream receiving one JSON line of statistics per step.
        loss_scaler: the ``torch.amp.GradScaler`` the gradients were scaled by: each shard enters
            the residual divided by the scale and the average is multiplied by it again, so the
            method works in the loss's own units and a scale change loses nothing.
        dense: parameters exchanged dense at every step whatever ``compression`` is (names of
            ``model.named_parameters()``, ``fnmatch`` patterns such as ``"*.bias"``, a list of
            them, or a predicate on the name: :mod:`horovod_sparse.common.dense_choice`),
            resolved by :meth:`attach`. An FSDP unit's shard is one flat buffer whose layout is
            FSDP's, so the choice is per unit: a unit whose parameters are all chosen is averaged
            densely (``kept_dense`` in the statistics); a unit mixing chosen and other
            parameters is refused (``ValueError`` naming both): ``fully_shard`` the layers to
            keep dense as units of their own, before their parent.

    Attributes:
        steps: steps taken (backward passes that reached the hooks).
        last_stats: the last step's statistics (one group per FSDP unit, its shard's figures).
    """

    def __init__(self, compression: Any, replicate_group: Optional[dist.ProcessGroup] = None,
                 nonfinite: Optional[str] = "default", stats_log: Optional[IO[str]] = None,
                 loss_scaler: Optional[torch.amp.GradScaler] = None, dense: DenseSpec = None) -> None:
        self.compression = compression
        self.sparse = checked_sparse(compression, "fsdp")
        self.nonfinite = resolve_nonfinite(nonfinite, self.sparse, scaled=loss_scaler is not None)
        self._loss_scale = LossScale(loss_scaler) if loss_scaler is not None else None
        #: This step's loss scale, read at its first hook.
        self._scale = UNSCALED
        self.process_group = ProcessGroup(replicate_group)
        # The configuration is agreed over the whole job (every replicate group stops together).
        self._engine = distributed_engine(compression, self.process_group, stats_log,
                                          model_state=functools.partial(ShardedModelState, whole=[]))
        self._model = self._engine.model
        # Every rank of the job agrees: a step abandoned on one replica's shards is abandoned on all.
        self._agree = nonfinite_agreement(self.nonfinite, ProcessGroup(None))
        self._groups: Dict[str, ShardGroup] = {}
        self._finiteness = StepFiniteness(self.nonfinite is not None)
        self._in_step = False
        self._check_due = True
        self._saved: Optional[Record] = None
        self._params: List[torch.Tensor] = []
        self._dense_spec = dense
        #: The FSDP units kept dense (``dense``), found by :meth:`attach`.
        self._kept_units: List[str] = []

    def attach(self, model: torch.nn.Module, replicate_group: Optional[dist.ProcessGroup] = None) -> None:
        """Register the exchange as the all-reduce hook of every FSDP unit in ``model``, across
        ``replicate_group`` when given (else the one the state was built with)."""
        if replicate_group is not None:
            if self._params:
                raise ValueError("this state is attached to a model already: build one State per model")
            self.process_group.group = replicate_group
        # self.exchange looked up at each call, as the hooks always did (a wrapper set later is called).
        self._kept_units = hook_units(model, self.process_group.group, self._dense_spec,
                                      lambda name, shard: self.exchange(name, shard))
        self._params = list(model.parameters())

    def exchange(self, name: str, shard: torch.Tensor) -> None:
        """Exchange FSDP unit ``name``'s reduce-scattered gradient ``shard`` across the replicas
        and write the average over every rank into it (what the unit's hook runs)."""
        engine = self._engine
        if not self._in_step:
            self._begin_step(shard)
        group = self._groups.get(name)
        if group is None:  # the unit's first exchange
            group = self._groups[name] = unit_group(len(self._groups), name, shard, name in self._kept_units,
                                                    self._saved, self._model)
        engine.timeline.group_ready(name)
        finite = self._finiteness.check([name], shard)
        flight = engine.start(group, lambda: group.load_flat(shard, self._scale.inverse, finite, hand_over=True),
                              dense_average(engine, group, shard, self.compression, finite))
        update = engine.finish_one(flight, self._scale.scale)
        if update is not shard:
            shard.copy_(update)

    def _begin_step(self, shard: torch.Tensor) -> None:
        """The first hook of a step: queue its end after the backward pass, check the
        configuration where due."""
        self._in_step = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_step)
        self._engine.place_timeline(lambda: ready_timeline(shard.device))
        self._scale = step_scale(self._loss_scale)
        if self._check_due:
            self._check_due = False
            self._model.require_same_configuration({"nonfinite": self.nonfinite, "steps": self.steps,
                                                    "dense": self._kept_units}, [])

    def _finish_step(self) -> None:
        """After the backward pass: agree on non-finite gradients over the whole job (the step
        abandoned everywhere if a rank saw one), close the step."""
        engine, self._in_step = self._engine, False
        engine.timeline.backward_ended()
        outcome = engine.end(self._finiteness, self._agree, self._deliver, self._model.end_step)
        if self._loss_scale is None:  # with a scaler, the NaN gradients tell it
            outcome.apply_policy(self.nonfinite)

    def _deliver(self, abandoned: bool) -> None:
        """The hooks wrote each shard's average already: an abandoned step's gradients become
        NaN for a loss scaler (it skips the step), else zeros."""
        if abandoned:
            fill_gradients(self._params, math.nan if self._loss_scale is not None else 0.0)

    def state_dict(self) -> Dict[str, bytes]:
        """This rank's state under a key of its own, ``{"rank<r>": bytes}``: the serialised step
        counter, the method's own state and, per FSDP unit, its shard's residual and method
        state; ``dcp.save({"model": model, "replicas": state}, ...)`` keeps every rank's
        (:mod:`horovod_sparse.fsdp.checkpoint`)."""
        return rank_entry(self._model.record(list(self._groups.values()), self.steps, per_rank=True))

    def load_state_dict(self, state_dict: Dict[str, bytes]) -> None:
        """Continue from a :meth:`state_dict` this rank saved in a job of the same size, model
        and mesh (``dcp.load`` calls it with what ``dcp.save`` kept). Residuals and method states
        are taken as the units' hooks come (a shard of another size raises ``ValueError`` then,
        another job size at once); tensors go to the shards' device."""
        self._saved = record = state_of_this_rank(state_dict, "the replicas' state", "ranks and mesh")
        self._groups.clear()
        self._model.states.clear()
        self._model.load_method(record)
        self._engine.restart_at(int(record["steps"]))
        self._check_due = True


def compress_replicas(model: torch.nn.Module, compression: Any,
                      replicate_group: Optional[dist.ProcessGroup] = None, *, mesh: Optional[DeviceMesh] = None,
                      nonfinite: Optional[str] = "default", stats_log: Optional[IO[str]] = None,
                      loss_scaler: Optional[torch.amp.GradScaler] = None, dense: DenseSpec = None) -> State:
    """Exchange every FSDP unit of ``model`` across the replicas with ``compression`` (see
    :class:`State` for the arguments); returns the state (checkpoints, statistics). The replicas
    are ``replicate_group`` or the ``replicate`` dimension of ``mesh``, a 2-D ``DeviceMesh`` named
    ``("replicate", "shard")`` whose ``mesh["shard"]`` sharded every unit: exactly one of the two.
    ``compression`` may also be a :class:`State` built earlier (before the process group existed,
    as trainers build theirs): it is attached as built (its own ``nonfinite``, ``stats_log``,
    ``loss_scaler`` and ``dense``)."""
    replicate_group = replicate_group_given(model, replicate_group, mesh)
    state = compression if isinstance(compression, State) else State(
        compression, nonfinite=nonfinite, stats_log=stats_log, loss_scaler=loss_scaler, dense=dense)
    state.attach(model, replicate_group)
    return state
