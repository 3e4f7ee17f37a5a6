"""The FSDP2 front end's checkpoint: this rank's record (:meth:`ModelState.record`) under a key of
its own, and each unit's share of a loaded record taken as the unit's hook first comes.

``torch.distributed.checkpoint`` keeps one copy of entries sharing a key, so the entry is keyed
by rank (``{"rank<r>": bytes}``): ``dcp.save({"model": model, "replicas": state}, ...)`` keeps
every rank's state, as ``torch.save`` of each rank's ``state_dict()`` does. Residuals are per
rank and shard, so a record resumes only in a job of the same size, model and mesh.
"""
from __future__ import annotations

import io
from typing import Dict, Optional

import torch
import torch.distributed as dist

from horovod_sparse.engine.model_state import ModelState, Record
from horovod_sparse.fsdp.units import ShardGroup


def rank_key() -> str:
    """The key of this rank's entry in the front end's ``state_dict()``."""
    return f"rank{dist.get_rank()}"


def rank_entry(record: Record) -> Dict[str, bytes]:
    """``record`` serialised with the job's size, under this rank's key."""
    buffer = io.BytesIO()
    torch.save({"world_size": dist.get_world_size(), "record": record}, buffer)
    return {rank_key(): buffer.getvalue()}


def record_of_rank(state_dict: Dict[str, bytes]) -> Record:
    """The record this rank saved in ``state_dict`` (:func:`rank_entry`'s), on the CPU. Raises
    ``ValueError`` when it holds no entry of this rank's or was saved by a job of another size."""
    key, world = rank_key(), dist.get_world_size()
    if key not in state_dict:
        raise ValueError(f"this state_dict holds no state of rank {dist.get_rank()} (its keys: "
                         f"{sorted(state_dict)[:8]}); load the state_dict this rank saved")
    saved = torch.load(io.BytesIO(state_dict[key]), map_location="cpu", weights_only=True)
    if saved["world_size"] != world:
        raise ValueError(f"the replicas' state was saved by a job of {saved['world_size']} ranks, this job has "
                         f"{world}: residuals are per rank and shard, so resume with the same ranks and mesh "
                         "(or start the replicas' state afresh)")
    return saved["record"]


def unit_group(index: int, name: str, shard: torch.Tensor, kept_dense: bool, record: Optional[Record],
               model: ModelState) -> ShardGroup:
    """FSDP unit ``name``'s group (the ``index``-th made) for its gradient ``shard``, with the
    residual (on the shard's device) and method state of a loaded ``record`` (None, or no entry
    for the unit: none to take). Raises ``ValueError`` when the record's shard has another size."""
    group = ShardGroup(index, name, shard, kept_dense=kept_dense)
    saved = None if record is None else record["groups"].get(name)
    if saved is None:
        return group
    if int(saved["numel"]) != group.numel:
        raise ValueError(f"checkpoint does not match the model: its FSDP unit {name!r} has a shard of "
                         f"{saved['numel']} elements on this rank, the model's {group.numel}; load the state "
                         "this rank saved with the same model and mesh")
    if saved.get("residual") is not None:
        group.load_residual(saved["residual"].to(shard.device))
    if saved.get("state") is not None:
        model.states[group.index] = model.saved_group_state(saved["state"], group.numel)
    return group
