"""Blocking ``torch.distributed`` collectives whose results the host reads: every rank's ints,
arrays or bytes (agreements, checkpoints, the alpha-beta calibration), and the allgather of
rank-dependent lengths the communicator launches. ``torch.distributed`` has no variable-length
allgather: the lengths are exchanged first (one small blocking collective) unless known, then the
payload moves padded to the longest.
"""
from __future__ import annotations

import pickle
from typing import Any, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from horovod_sparse.distributed.process_group import ProcessGroup
from horovod_sparse.torch_core.tensor_backend import synchronize


#: The allgather into one tensor (``all_gather_single`` from torch 2.13, which deprecates the
#: older name): no list of outputs to allocate and concatenate.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_ints(value: int, process_group: ProcessGroup) -> List[int]:
    """Every rank's ``value``, in rank order (one blocking allgather of one int64 each into one
    tensor, read on the host at once: three operations whatever the number of ranks)."""
    mine = torch.tensor([value], dtype=torch.int64, device=process_group.device)
    every = mine.new_empty(process_group.size())
    _ALL_GATHER_SINGLE(every, mine, group=process_group.group)
    return every.tolist()


def ranks_reporting(count: int, process_group: ProcessGroup) -> List[int]:
    """The ranks whose ``count`` is not zero (one tiny blocking allgather, :func:`gather_ints`)."""
    return [rank for rank, theirs in enumerate(gather_ints(count, process_group)) if theirs]


def launch_allgather(tensor: torch.Tensor, process_group: ProcessGroup,
                     lengths: Optional[List[int]] = None) -> Tuple[Any, Any, List[int]]:
    """Start an allgather along dim 0 of rank-dependent lengths: the lengths first (blocking,
    unless every rank's ``lengths`` are given), then every rank's rows padded to the longest.
    Returns ``(work, finish, lengths)``: ``finish()``, after ``work.wait()``, gives the rows of
    every rank, concatenated in rank order."""
    if lengths is None:
        lengths = gather_ints(tensor.shape[0], process_group)
    longest = max(max(lengths), 1)  # every rank sends at least one row, even when none has any
    if tensor.shape[0] == longest:
        padded = tensor.contiguous()
    else:
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
    gathered = padded.new_empty((len(lengths) * longest, *padded.shape[1:]))
    work = _ALL_GATHER_SINGLE(gathered, padded, group=process_group.group, async_op=True)
    if all(n == longest for n in lengths):  # a fixed count (a capacity): the rows as they came
        return work, lambda: gathered, lengths
    return work, lambda: torch.cat([chunk[:n] for chunk, n in zip(gathered.split(longest), lengths)]), lengths


def allgather_payload(numel: int, like: Optional[torch.Tensor], process_set: ProcessGroup, name: str) -> None:
    """Allgather ``numel`` float32 zeros on ``like``'s device (the group's when None) and wait
    for the result (what the alpha-beta calibration times; ``name`` is Horovod's, unused here)."""
    tensor = torch.zeros(numel, dtype=torch.float32, device=process_set.device if like is None else like.device)
    work, finish, _ = launch_allgather(tensor, process_set)
    work.wait()
    synchronize(finish())


def allgather_array(array: np.ndarray, process_set: ProcessGroup, name: str) -> np.ndarray:
    """Every rank's ``array`` concatenated along the first axis, in rank order (blocking;
    ``name`` is Horovod's, unused here)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(process_set.device)
    work, finish, _ = launch_allgather(tensor, process_set)
    work.wait()
    return finish().cpu().numpy()


def allgather_bytes(payload: bytes, name: str, process_set: ProcessGroup) -> List[bytes]:
    """Every rank's ``payload``, in rank order (blocking; for rare metadata only)."""
    gathered: List[Any] = [None] * process_set.size()
    dist.all_gather_object(gathered, pickle.dumps(payload), group=process_set.group)
    return [pickle.loads(item) for item in gathered]
