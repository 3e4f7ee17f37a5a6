"""What the FSDP2 front end reads of a sharded model: its units, the meshes they were sharded
with, each unit's gradient shard as a flat group, the replicate group of a 2-D mesh; and the
units' all-reduce hooks and local gradient shards it writes."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from horovod_sparse.common.dense_choice import DenseSpec, chosen_dense
from horovod_sparse.torch_core.buffers import FlatGroup


class ShardGroup(FlatGroup):
    """One FSDP unit's gradient shard on this rank as a flat group: its residual, of the shard's
    size, dtype and device (the unit's parameters are FSDP's; the update is written over the
    shard itself)."""

    def __init__(self, index: int, name: str, like: torch.Tensor, kept_dense: bool = False) -> None:
        super().__init__(index, [name], [], name=name, kept_dense=kept_dense)
        self.numels = [like.numel()]
        self.numel = like.numel()
        self._like = (like.dtype, like.device)

    @property
    def dtype(self) -> torch.dtype:
        return self._like[0]

    @property
    def device(self) -> torch.device:
        return self._like[1]

    @property
    def shapes(self) -> None:  # type: ignore[override]
        """None: a shard is a slice of the unit's parameters, not whole ones."""
        return None


def fsdp_units(model: torch.nn.Module) -> List[Tuple[str, Any]]:
    """``model``'s FSDP units as ``(name, module)`` (the root named ``root``), after checking
    that it was sharded with ``fully_shard`` and never with a 2-D mesh (FSDP's own HSDP, which
    all-reduces across replicas itself and would hand the hooks the all-reduced result)."""
    units = [(name or "root", module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if not units:
        raise ValueError("compress_replicas needs a model sharded with torch.distributed.fsdp.fully_shard "
                         "(no FSDPModule found in it)")
    require_one_dimensional_meshes(model, "replicate_group")
    return units


def require_one_dimensional_meshes(model: torch.nn.Module, argument: str) -> None:
    """Refuse a ``model`` with a parameter sharded over a mesh of more than one dimension (FSDP's
    own HSDP, which all-reduces across replicas itself), naming the fix: the 1-D ``mesh['shard']``,
    and ``mesh['replicate'].get_group()`` as the front end's ``argument``."""
    for name, p in model.named_parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"parameter {name!r} was sharded with a {mesh.ndim}-D mesh (FSDP's own HSDP, which "
                             "all-reduces across replicas itself); shard with the 1-D mesh['shard'] and pass "
                             f"mesh['replicate'].get_group() as {argument}")


def require_replicas_of_one_shard(model: torch.nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Refuse, on every rank of ``group``, a replicate group whose ranks hold different shards:
    every rank of it must shard over a mesh of the same size at the same position, else the
    exchange would average different slices of the parameters together. Collective."""
    meshes = sorted({(tuple(p.device_mesh.mesh.tolist()), p.device_mesh.get_local_rank())
                     for p in model.parameters() if getattr(p, "device_mesh", None) is not None})
    layout = [(len(ranks), position) for ranks, position in meshes]
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, layout, group=group)
    if any(other != layout for other in everyone):
        replicas = dist.get_process_group_ranks(group) if group is not None else list(range(len(everyone)))
        raise ValueError(f"the replicate group (ranks {replicas}) does not hold replicas of one shard: its ranks "
                         f"shard as (shard group size, position) {everyone}; give the group of ranks at the "
                         "same position of every shard group (mesh['replicate'] of a ('replicate', 'shard') mesh)")


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


def replicate_group_given(model: torch.nn.Module, replicate_group: Optional[dist.ProcessGroup],
                          mesh: Optional[DeviceMesh]) -> Optional[dist.ProcessGroup]:
    """The replicate group given to :func:`~horovod_sparse.fsdp.replicas.compress_replicas`:
    ``replicate_group``, or that of ``mesh`` (:func:`replicate_group_of`); ``ValueError`` unless
    exactly one of the two is given."""
    if (mesh is None) == (replicate_group is None):
        raise ValueError("compress_replicas needs exactly one of replicate_group= (the torch.distributed group of "
                         "this rank's replicas) and mesh= (a 2-D DeviceMesh named ('replicate', 'shard'))")
    return replicate_group if mesh is None else replicate_group_of(mesh, model)


def hook_units(model: torch.nn.Module, group: Optional[dist.ProcessGroup], dense: DenseSpec,
               exchange: Callable[[str, torch.Tensor], None]) -> List[str]:
    """Make ``exchange(name, shard)`` the all-reduce hook of every FSDP unit of ``model``, after
    checking the units (:func:`fsdp_units`) and that ``group`` holds replicas of one shard
    (:func:`require_replicas_of_one_shard`, collective). Returns the units ``dense`` keeps dense
    (:func:`kept_dense_units`)."""
    units = fsdp_units(model)
    require_replicas_of_one_shard(model, group)
    kept = kept_dense_units(model, units, dense)
    for name, module in units:
        module.set_all_reduce_hook(lambda shard, name=name: exchange(name, shard))
    return kept


def fill_gradients(params: List[torch.Tensor], value: float) -> None:
    """Fill this rank's shard of the gradient of each of ``params`` that has one with ``value``."""
    for p in params:
        if p.grad is not None:
            p.grad.to_local().fill_(value)
