"""Figures a step left on a device (counts, flags, thresholds), read on the host in one read per
device however many there are: what a PyTorch front end's transport gives the step engine as its
``read_scalars`` (:class:`~horovod_sparse.engine.topology.Transport`;
:func:`horovod_sparse.common.stats.finish_step`)."""
from __future__ import annotations

import itertools
from typing import Any, Dict, List

import torch

__all__ = ["read_scalars"]


def read_scalars(scalars: List[torch.Tensor]) -> List[Any]:
    """The values of tensors left on a device (counts, flags, thresholds), in order: for a 0-dim
    tensor an int (integer and bool tensors) or a float (floating ones, exactly: read as
    float64), for a 1-D one a list of them; one host read per device, however many
    (:func:`horovod_sparse.common.stats.finish_step`), gathered in a few operations per dtype
    (a stack, a cast), not per tensor."""
    values: List[Any] = [0] * len(scalars)
    by_device: Dict[torch.device, Dict[torch.dtype, List[int]]] = {}
    for i, scalar in enumerate(scalars):
        by_device.setdefault(scalar.device, {}).setdefault(scalar.dtype, []).append(i)
    for by_dtype in by_device.values():
        parts = [_flat(*[scalars[i] for i in positions]).to(torch.float64) for positions in by_dtype.values()]
        read = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        start = 0
        for i in itertools.chain(*by_dtype.values()):
            kind = float if scalars[i].is_floating_point() else int
            value = [kind(v) for v in read[start:start + scalars[i].numel()]]
            values[i], start = (value if scalars[i].dim() else value[0]), start + scalars[i].numel()
    return values


def _flat(*tensors: torch.Tensor) -> torch.Tensor:
    """The elements of ``tensors`` (one dtype) in one 1-D tensor: one stack when all are 0-dim."""
    if all(t.dim() == 0 for t in tensors):
        return torch.stack(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])
