"""The dense average of a ``torch.distributed`` front end: DDP's own bucket allreduce (the DDP
hook's and FSDP2's ``Compression.none`` / ``Compression.fp16``, and their warm-up and small groups)."""
from __future__ import annotations

from typing import Any

import torch

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
    wire_dtype = compression.wire_dtype if isinstance(compression, DenseCompression) else None
    wire_dtype = wire_dtype or (torch.float32 if buffer.dtype == torch.bfloat16 else buffer.dtype)
    wire = buffer.to(wire_dtype) if buffer.dtype != wire_dtype else buffer
    if finite is True:
        wire.div_(comm.size)
    elif finite is False:
        wire.zero_()
    else:
        wire.div_(comm.size).masked_fill_(finite.logical_not(), 0.0)
    comm.stats.selected = comm.stats.union = buffer.numel()
    (summed,) = yield [comm.allreduce(wire, "values", "values")]
    return summed.to(buffer.dtype)
