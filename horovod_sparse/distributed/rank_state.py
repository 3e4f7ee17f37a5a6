"""A ``torch.distributed`` front end's state that differs between ranks, as one entry per rank.

``torch.distributed.checkpoint`` keeps one copy of entries sharing a key (it takes them for
replicated), so a front end whose state is each rank's own (residuals, and the outer steps'
parameters mid-round) keys it by rank: ``{"rank<r>": bytes}``, the rank's state serialised with
the job's size. ``dcp.save`` then keeps every rank's, as ``torch.save`` of each rank's
``state_dict()`` does; such a state resumes only in a job of the same size.
"""
from __future__ import annotations

import io
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist


def rank_key(rank: Optional[int] = None) -> str:
    """The key of this rank's entry (``rank``: this process's rank in the job, default
    ``torch.distributed``'s)."""
    return f"rank{dist.get_rank() if rank is None else rank}"


def rank_entry(state: Any, rank: Optional[int] = None, size: Optional[int] = None) -> Dict[str, bytes]:
    """``state`` (plain containers and tensors) serialised with the job's size, under this rank's
    key (``rank`` and ``size``: this process's rank and the job's size, default
    ``torch.distributed``'s; a Horovod job gives Horovod's)."""
    buffer = io.BytesIO()
    torch.save({"world_size": dist.get_world_size() if size is None else size, "record": state}, buffer)
    return {rank_key(rank): buffer.getvalue()}


def state_of_this_rank(state_dict: Dict[str, bytes], what: str, same: str = "ranks", rank: Optional[int] = None,
                       size: Optional[int] = None) -> Any:
    """The state this rank saved in ``state_dict`` (:func:`rank_entry`'s, ``rank`` and ``size``
    as it takes them), on the CPU. Raises ``ValueError`` when it holds no entry of this rank's or
    was saved by a job of another size, naming ``what`` (the state) and ``same`` (what a resume
    must keep)."""
    key, world = rank_key(rank), dist.get_world_size() if size is None else size
    if key not in state_dict:
        raise ValueError(f"this state_dict holds no state of {key[:4]} {key[4:]} (its keys: "
                         f"{sorted(state_dict)[:8]}); load the state_dict this rank saved")
    saved = torch.load(io.BytesIO(state_dict[key]), map_location="cpu", weights_only=True)
    if saved["world_size"] != world:
        raise ValueError(f"{what} was saved by a job of {saved['world_size']} ranks, this job has {world}: "
                         f"it is per rank, so resume with the same {same} (or start it afresh)")
    return saved["record"]
