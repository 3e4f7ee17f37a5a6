"""The dense average of a ``torch.distributed`` front end: DDP's own bucket allreduce (the DDP
hook's and FSDP2's ``Compression.none`` / ``Compression.fp16``, and their warm-up and small groups),
and the outer steps' dense average in two tiers (:func:`two_tier_dense_exchange`)."""
from __future__ import annotations

from typing import Any, List

import torch

from horovod_sparse.common.tiers import NODE_KIND, slice_bounds
from horovod_sparse.distributed.communicator import Communicator
from horovod_sparse.distributed.compression import DenseCompression
from horovod_sparse.methods.base import Exchange
from horovod_sparse.torch_core.finiteness import Finite


def dense_exchange(buffer: torch.Tensor, comm: Communicator, compression: Any, finite: Finite) -> Exchange:
    """DDP's own averaging of a bucket (``Compression.none``: PyTorch's ``allreduce_hook``;
    ``fp16``: its ``fp16_compress_hook``): divided by the world size, then summed, in float16
    on the wire with ``fp16`` and bfloat16 as float32 (Gloo sums no bfloat16). Zeros instead
    of this rank's bucket when it is not ``finite`` (non-finite; a device flag is applied on
    the device)."""
    wire = _share(buffer, compression, finite, comm.size)
    comm.stats.selected = comm.stats.union = buffer.numel()
    (summed,) = yield [comm.allreduce(wire, "values", "values")]
    return summed.to(buffer.dtype)


def two_tier_dense_exchange(buffer: torch.Tensor, node: Communicator, cross: Communicator, compression: Any,
                            finite: Finite) -> Exchange:
    """The dense average of ``buffer`` over a job in two tiers (:mod:`horovod_sparse.common.tiers`):
    each rank's share (divided by the job's size, on the wire as :func:`dense_exchange` puts it)
    summed in the node by a reduce-scatter, this rank's slice of the node sum summed across
    nodes over its cross set (``cross``), the slices gathered in the node (``node``). Every rank
    gets the whole average; only a slice per rank crosses the nodes."""
    wire = _share(buffer, compression, finite, node.size * cross.size)
    numel = buffer.numel()
    rows: List[int] = [hi - lo for lo, hi in (slice_bounds(numel, node.size, r) for r in range(node.size))]
    cross.stats.selected = cross.stats.union = numel
    (node_sum,) = yield [node.reducescatter(wire, "node.sum", NODE_KIND)]
    (summed,) = yield [cross.allreduce(node_sum, "values", "values")]
    (whole,) = yield [node.allgather(summed, "node.update", NODE_KIND, rows=rows)]
    return whole.to(buffer.dtype)


def _share(buffer: torch.Tensor, compression: Any, finite: Finite, size: int) -> torch.Tensor:
    """This rank's share of a dense average over ``size`` ranks, in the wire's dtype: ``buffer``
    divided by ``size`` (float16 with ``fp16``; bfloat16 as float32), zeros where not ``finite``
    (written into ``buffer`` itself when it is already in the wire's dtype)."""
    wire_dtype = compression.wire_dtype if isinstance(compression, DenseCompression) else None
    wire_dtype = wire_dtype or (torch.float32 if buffer.dtype == torch.bfloat16 else buffer.dtype)
    wire = buffer.to(wire_dtype) if buffer.dtype != wire_dtype else buffer
    if finite is True:
        return wire.div_(size)
    if finite is False:
        return wire.zero_()
    return wire.div_(size).masked_fill_(finite.logical_not(), 0.0)
