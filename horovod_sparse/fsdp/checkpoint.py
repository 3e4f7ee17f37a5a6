"""The FSDP2 front end's checkpoint: this rank's record (:meth:`ModelState.record`) under a key of
its own, and each unit's share of a loaded record taken as the unit's hook first comes.

The entry is keyed by rank (:mod:`horovod_sparse.distributed.rank_state`):
``dcp.save({"model": model, "replicas": state}, ...)`` keeps every rank's state, as ``torch.save``
of each rank's ``state_dict()`` does. Residuals are per rank and shard, so a record resumes only
in a job of the same size, model and mesh.
"""
from __future__ import annotations

from typing import Optional

import torch

from horovod_sparse.engine.model_state import ModelState, Record
from horovod_sparse.fsdp.units import ShardGroup


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
        model.states[group.index] = model.states.from_record(saved["state"], group.numel)
    return group
