"""Every horovod_sparse method on the replica axis of FSDP2: the front end for sharded training.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards each unit's parameters inside its mesh's
``shard`` group and, after the backward pass, reduce-scatters the unit's gradients there. The
replicas of a shard (the ranks holding it in the other shard groups: the ``replicate`` axis of a
2-D mesh, one rank per node in HSDP) must still be averaged, and that is the exchange across
the slow network. :func:`compress_replicas` registers one all-reduce hook per FSDP unit
(``FSDPModule.set_all_reduce_hook``): the hook receives the unit's reduce-scattered gradient
shard (the shard group's mean, padded as FSDP pads its shards), adds the unit's error-feedback
residual (sharded like the parameters: one per unit and rank), runs the method's exchange over
the replicate group with the shared driver (the DDP front end's ``torch.distributed``
collectives and backend) and writes the average over every rank back in place, which FSDP then
hands to the sharded ``.grad``.

Semantics: per unit, a step is the flat method over the ``R`` ranks of the replicate group fed
their shards, scaled by ``1 / R``: the same contract as the method over DDP buckets, with the
unit's shard as the group. The hook returns only when the exchange is done (FSDP's hook point
gives no future), so a unit's exchange does not overlap the rest of the backward pass.

A step ends when the backward pass does (a callback queued by the first hook): the non-finite
policy is agreed over the whole job there (one tiny allgather), the statistics settle and
LAGS's measurements are taken. Only FSDP-only meshes per unit (the ``shard`` dimension) are
supported: FSDP's own HSDP (a 2-D mesh given to ``fully_shard``) all-reduces across replicas
itself and hands the hook the all-reduced result, which is refused.
"""
from __future__ import annotations

import io
import math
from typing import IO, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from horovod_sparse.common.dense_choice import DenseSpec, chosen_dense
from horovod_sparse.common.inflight import Inflight
from horovod_sparse.common.model_state import ModelState, Record
from horovod_sparse.common.nonfinite import apply_nonfinite_policy, resolve_nonfinite
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.ddp import backend
from horovod_sparse.ddp.collectives import Communicator, ProcessGroup, ranks_reporting
from horovod_sparse.ddp.compression import checked_sparse
from horovod_sparse.ddp.hook import dense_exchange
from horovod_sparse.torch.buffers import FlatGroup
from horovod_sparse.torch.finiteness import StepFiniteness
from horovod_sparse.torch.loss_scale import LossScale
from horovod_sparse.ddp.steps import StepBook


class ShardGroup(FlatGroup):
    """One FSDP unit's gradient shard on this rank as a flat group: its residual and output
    buffers, of the shard's size, dtype and device (the unit's parameters are FSDP's)."""

    def __init__(self, index: int, name: str, like: torch.Tensor, kept_dense: bool = False) -> None:
        super().__init__(index, [name], [], name=name, kept_dense=kept_dense)
        self.numels = [like.numel()]
        self.numel = like.numel()
        self._like = (like.dtype, like.device)

    @property
    def dtype(self) -> torch.dtype:
        return self._like[0]

    def _allocate(self) -> None:
        dtype, device = self._like
        self.residual = torch.zeros(self.numel, dtype=dtype, device=device)
        self.output = torch.zeros(self.numel, dtype=dtype, device=device)


class State(StepBook):
    """The replica exchange of one FSDP2 model (build it with :func:`compress_replicas`).

    Args:
        compression: ``horovod_sparse.fsdp.Compression.<method>(...)`` (the DDP front end's
            namespace: the same backend), or ``Compression.none`` / ``Compression.fp16`` (a
            dense average across replicas).
        replicate_group: the ``torch.distributed`` group of this rank's replicas (for a 2-D
            mesh ``mesh["replicate"].get_group()``); None: the default group, or the one
            :func:`compress_replicas` is given with this state. Nothing asks
            ``torch.distributed`` anything before :meth:`attach`: a trainer may build the state
            before ``init_process_group``.
        nonfinite: what a NaN/Inf gradient on any rank does, as in the other front ends
            (``"raise"`` by default with a sparsifier: ``backward()`` raises
            ``FloatingPointError`` on every rank; ``"skip"``: a warning and zero gradients; None:
            no check). The residuals are restored first. With a ``loss_scaler`` the gradients of
            an abandoned step are NaN on every rank instead and nothing is raised or warned: the
            scaler sees the overflow on every rank alike (``scaler.step`` skips, ``update``
            backs the scale off).
        stats_log: a text stream receiving one JSON line of statistics per step.
        loss_scaler: the ``torch.amp.GradScaler`` whose ``scale(loss)`` the gradients come from
            (float16 training): each shard is divided by the scale as it enters the residual
            and the average multiplied by it again, so the method and error feedback work in
            the loss's own units and a scale change loses nothing (as in the DDP front end).
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
        sparse = checked_sparse(compression, "fsdp")
        self.compression = compression
        self.sparse = sparse
        self.nonfinite = resolve_nonfinite(nonfinite, sparse, scaled=loss_scaler is not None)
        self._loss_scale = LossScale(loss_scaler) if loss_scaler is not None else None
        #: This step's ``(scale, 1 / scale)`` of the loss scaler, read at its first hook.
        self._scale_factors: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.process_group = ProcessGroup(replicate_group)
        self._world = ProcessGroup(None)
        self._model = ModelState(compression, backend, self.process_group, None)
        super().__init__(stats_log)
        self._groups: Dict[str, ShardGroup] = {}
        self._finiteness = StepFiniteness()
        self._done: List[Inflight] = []
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
        units = [(name or "root", module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]
        if not units:
            raise ValueError("compress_replicas needs a model sharded with torch.distributed.fsdp.fully_shard "
                             "(no FSDPModule found in it)")
        meshes = set()
        for name, p in model.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and mesh.ndim != 1:
                raise ValueError(f"parameter {name!r} was sharded with a {mesh.ndim}-D mesh (FSDP's own HSDP, which "
                                 "all-reduces across replicas itself); shard with the 1-D mesh['shard'] and pass "
                                 "mesh['replicate'].get_group() as replicate_group")
            if mesh is not None:
                meshes.add((tuple(mesh.mesh.tolist()), mesh.get_local_rank()))
        self._require_replicas_of_one_shard(sorted(meshes))
        self._kept_units = kept_dense_units(model, units, self._dense_spec)
        for name, module in units:
            module.set_all_reduce_hook(self._hook(name))
        self._params = list(model.parameters())

    def _require_replicas_of_one_shard(self, meshes: List[Any]) -> None:
        """Refuse a replicate group whose ranks hold different shards: every rank of it must
        shard over a mesh of the same size at the same position (``meshes``: this rank's
        ``(ranks, position)`` per mesh its parameters use), else the exchange would average
        different slices of the parameters together."""
        layout = [(len(ranks), position) for ranks, position in meshes]
        group = self.process_group.group
        everyone: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, layout, group=group)
        if any(other != layout for other in everyone):
            replicas = dist.get_process_group_ranks(group) if group is not None else list(range(len(everyone)))
            raise ValueError(f"the replicate group (ranks {replicas}) does not hold replicas of one shard: its ranks "
                             f"shard as (shard group size, position) {everyone}; give the group of ranks at the "
                             "same position of every shard group (mesh['replicate'] of a ('replicate', 'shard') mesh)")

    def _hook(self, name: str) -> Any:
        def hook(reduce_output: torch.Tensor) -> None:
            self.exchange(name, reduce_output)
        return hook

    # -- the exchange -----------------------------------------------------------------------------
    def exchange(self, name: str, shard: torch.Tensor) -> None:
        """Exchange FSDP unit ``name``'s reduce-scattered gradient ``shard`` across the replicas
        and write the average over every rank into it (what the unit's hook runs)."""
        if not self._in_step:
            self._begin_step(shard)
        group = self._group(name, shard)
        self.timeline.group_ready(name)
        usable = True if self.nonfinite is None else self._finiteness.check([name], shard)
        options = getattr(self.compression, "options", None)
        sparse = (self.sparse and not group.kept_dense and self.steps >= options.warmup_steps
                  and group.numel >= options.min_numel)
        size, rank = self.process_group.size(), self.process_group.rank()
        target = options.count(group.numel, self.steps) if sparse else group.numel
        stats = GroupStats(name, group.numel, target, dense=not sparse, kept_dense=group.kept_dense)
        self._step_stats.groups.append(stats)
        comm = Communicator(self.process_group, name, stats, 1.0 / size, size, rank, shard.device, self.steps)
        if sparse:
            state = self._model.method_state(group, size)
            with comm.timer("flatten"):
                x = group.load_flat(shard, None if self._scale_factors is None else self._scale_factors[1], usable)
                comm.output_buffer = group.zeroed_output()
            exchange = self.compression.exchange(x, comm, state, self.steps)
        else:
            exchange = dense_exchange(shard, comm, self.compression, usable)
        inflight = Inflight(exchange, comm, group, sparse)
        inflight.advance()
        update, residual = inflight.finish()
        if sparse:
            group.take_result(update, residual)
            update = group.output
            if self._scale_factors is not None:
                update.mul_(self._scale_factors[0])
        if update is not shard:
            shard.copy_(update)
        self._done.append(inflight)

    def _begin_step(self, shard: torch.Tensor) -> None:
        """The first hook of a step: queue its end after the backward pass, check the
        configuration where due."""
        self._in_step = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_step)
        self._place_timeline(shard)
        if self._loss_scale is not None:
            self._scale_factors = self._loss_scale.factors()
        if self._check_due:
            self._check_due = False
            self._model.require_same_configuration({"nonfinite": self.nonfinite, "steps": self.steps,
                                                    "dense": self._kept_units}, [])

    def _group(self, name: str, shard: torch.Tensor) -> ShardGroup:
        """Unit ``name``'s group, made at its first exchange (taking a loaded checkpoint's
        residual and method state)."""
        group = self._groups.get(name)
        if group is not None:
            return group
        group = ShardGroup(len(self._groups), name, shard, kept_dense=name in self._kept_units)
        saved = None if self._saved is None else self._saved["groups"].get(name)
        if saved is not None:
            if int(saved["numel"]) != group.numel:
                raise ValueError(f"checkpoint does not match the model: its FSDP unit {name!r} has a shard of "
                                 f"{saved['numel']} elements on this rank, the model's {group.numel}; load the state "
                                 "this rank saved with the same model and mesh")
            if saved.get("residual") is not None:
                group.load_residual(saved["residual"].to(shard.device))
            if saved.get("state") is not None:
                self._model.states[group.index] = self._model.saved_group_state(saved["state"], group.numel)
        self._groups[name] = group
        return group

    def _finish_step(self) -> None:
        """After the backward pass: agree on non-finite gradients over the whole job (undo the
        step everywhere if any rank saw one), close the step."""
        self.timeline.backward_ended()
        done, self._done, self._in_step = self._done, [], False
        nonfinite_groups = self._finiteness.nonfinite()
        bad_ranks = [] if self.nonfinite is None else ranks_reporting(len(nonfinite_groups), self._world)
        if bad_ranks:
            for inflight in done:
                if inflight.sparse:
                    inflight.comm.undo_deliveries()
            for p in self._params:
                if p.grad is not None:
                    p.grad.to_local().fill_(math.nan if self._loss_scale is not None else 0.0)
            self._step_stats.abandoned = True
        self._close_step(self._model)
        if bad_ranks and self._loss_scale is None:  # with a scaler, the NaN gradients tell it
            apply_nonfinite_policy(self.nonfinite, bad_ranks, self.steps - 1, nonfinite_groups)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, bytes]:
        """This rank's state under a key of its own, ``{"rank<r>": bytes}``: the serialised step
        counter, the method's own state and, per FSDP unit, its shard's residual and method
        state. Residuals are per rank and shard, and ``torch.distributed.checkpoint`` keeps one
        copy of the entries that share a key, so the key is the rank's: ``dcp.save({"model":
        model, "replicas": state}, ...)`` keeps every rank's state, and ``torch.save`` of each
        rank's ``state_dict()`` does too (``torch.load(weights_only=True)`` reads it)."""
        record = self._model.record(list(self._groups.values()), self.steps, per_rank=True)
        buffer = io.BytesIO()
        torch.save({"world_size": dist.get_world_size(), "record": record}, buffer)
        return {self._key(): buffer.getvalue()}

    def load_state_dict(self, state_dict: Dict[str, bytes]) -> None:
        """Continue from a :meth:`state_dict` this rank saved in a job of the same size, model
        and mesh (``dcp.load`` calls it with what ``dcp.save`` kept). The residuals and method
        states are taken as the units' hooks come; a shard of another size raises ``ValueError``
        then, another job size at once; tensors go to the shards' device (a checkpoint saved on
        GPUs loads on the CPU and back)."""
        key, world = self._key(), dist.get_world_size()
        if key not in state_dict:
            raise ValueError(f"this state_dict holds no state of rank {dist.get_rank()} (its keys: "
                             f"{sorted(state_dict)[:8]}); load the state_dict this rank saved")
        saved = torch.load(io.BytesIO(state_dict[key]), map_location="cpu", weights_only=True)
        if saved["world_size"] != world:
            raise ValueError(f"the replicas' state was saved by a job of {saved['world_size']} ranks, this job has "
                             f"{world}: residuals are per rank and shard, so resume with the same ranks and mesh "
                             "(or start the replicas' state afresh)")
        record = saved["record"]
        self._saved = record
        self._groups.clear()
        self._model.states.clear()
        if self.sparse and record.get("method") is not None:
            self.compression.load_method_state(record["method"])
        self._restart_at(int(record["steps"]))
        self._check_due = True

    @staticmethod
    def _key() -> str:
        return f"rank{dist.get_rank()}"


def kept_dense_units(model: torch.nn.Module, units: List[Tuple[str, torch.nn.Module]], dense: DenseSpec) -> List[str]:
    """The names of the FSDP ``units`` (``(name, module)`` pairs) of ``model`` whose own
    parameters (those of no unit inside them) are all chosen by ``dense``; a unit mixing chosen
    and other parameters raises ``ValueError`` naming both."""
    if dense is None:
        return []
    chosen = chosen_dense(dense, [name for name, _ in model.named_parameters()])
    depth = {id(module): name.count(".") + 1 if name else 0 for name, module in model.named_modules()}
    # The deeper units are written last: a parameter belongs to the innermost unit holding it.
    owner = {id(p): unit_name for unit_name, unit in sorted(units, key=lambda pair: depth[id(pair[1])])
             for p in unit.parameters()}
    own: Dict[str, List[str]] = {}
    for name, p in model.named_parameters():
        own.setdefault(owner[id(p)], []).append(name)
    kept = []
    for unit_name, params in own.items():
        inside = [name for name in params if name in chosen]
        if inside and len(inside) < len(params):
            outside = [name for name in params if name not in chosen]
            raise ValueError(f"dense= chooses {inside} of FSDP unit {unit_name!r}, not its other parameters {outside}: "
                             "a unit's shard is exchanged whole; fully_shard the layers to keep dense as units of "
                             "their own (before their parent), or choose the whole unit")
        if inside:
            kept.append(unit_name)
    return sorted(kept)


def replicate_group_of(mesh: DeviceMesh, model: torch.nn.Module) -> dist.ProcessGroup:
    """The replicate group of a 2-D ``mesh`` named ``("replicate", "shard")``, after checking that
    every parameter of ``model`` was sharded with ``mesh["shard"]`` (the mesh the hooks assume)."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or set(names) != {"replicate", "shard"}:
        raise ValueError(f"compress_replicas(mesh=...) takes a 2-D DeviceMesh with dimensions named "
                         f"('replicate', 'shard'); this one has {mesh.ndim} dimension(s) named {names}. Build it with "
                         "init_device_mesh(device, (nodes, gpus_per_node), mesh_dim_names=('replicate', 'shard')) "
                         "or pass replicate_group= instead")
    shard = mesh["shard"]
    for name, p in model.named_parameters():
        used = getattr(p, "device_mesh", None)
        if used is not None and used.ndim == 1 and not torch.equal(used.mesh, shard.mesh):
            raise ValueError(f"parameter {name!r} was sharded over ranks {used.mesh.tolist()}, not over this rank's "
                             f"mesh['shard'] ({shard.mesh.tolist()}); shard every unit with "
                             "fully_shard(module, mesh=mesh['shard'])")
    return mesh["replicate"].get_group()


def compress_replicas(model: torch.nn.Module, compression: Any,
                      replicate_group: Optional[dist.ProcessGroup] = None, *, mesh: Optional[DeviceMesh] = None,
                      nonfinite: Optional[str] = "default", stats_log: Optional[IO[str]] = None,
                      loss_scaler: Optional[torch.amp.GradScaler] = None, dense: DenseSpec = None) -> State:
    """Exchange every FSDP unit of ``model`` across the replicas with ``compression`` (see
    :class:`State` for the arguments); returns the state (checkpoints, statistics).

    The replicas are either ``replicate_group`` (a ``torch.distributed`` group) or the
    ``replicate`` dimension of ``mesh``, a 2-D ``DeviceMesh`` named ``("replicate", "shard")``
    whose ``mesh["shard"]`` sharded every unit. Give exactly one of the two. ``compression`` may
    also be a :class:`State` built earlier (before the process group existed, as trainers build
    their states): it is attached as it was built (``nonfinite``, ``stats_log``,
    ``loss_scaler`` and ``dense`` are its own then)."""
    if (mesh is None) == (replicate_group is None):
        raise ValueError("compress_replicas needs exactly one of replicate_group= (the torch.distributed group of "
                         "this rank's replicas) and mesh= (a 2-D DeviceMesh named ('replicate', 'shard'))")
    if mesh is not None:
        replicate_group = replicate_group_of(mesh, model)
    if isinstance(compression, State):
        state = compression
    else:
        state = State(compression, nonfinite=nonfinite, stats_log=stats_log, loss_scaler=loss_scaler, dense=dense)
    state.attach(model, replicate_group)
    return state

