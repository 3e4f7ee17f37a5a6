"""``horovod_sparse.ddp.Compression`` and ``horovod_sparse.fsdp.Compression``: DDP's dense bucket
allreduce plus the sparsifiers, on the ``torch.distributed`` backend.

``Compression.none`` is DDP's default hook (the bucket summed, then averaged), ``Compression.fp16``
PyTorch's ``fp16_compress_hook`` (the same in float16 on the wire). Every registered method is a
factory, as in the Horovod front ends: ``Compression.micro(density=0.01)`` validates its options
and returns a :class:`~horovod_sparse.methods.base.Sparsifier` on the ``torch.distributed``
backend (:mod:`horovod_sparse.distributed.backend`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

import horovod_sparse.methods  # noqa: F401  (registers the methods)
from horovod_sparse.common.compression_namespace import compression_namespace
from horovod_sparse.distributed import backend
from horovod_sparse.methods.base import checked_sparse as checked_for


class DenseCompression:
    """A dense bucket allreduce, in ``wire_dtype`` on the wire (None: the bucket's own dtype)."""

    def __init__(self, name: str, wire_dtype: Optional[torch.dtype]) -> None:
        self.__name__ = name
        self.wire_dtype = wire_dtype

    def __repr__(self) -> str:
        return f"Compression.{self.__name__}"


Compression = compression_namespace(
    "ddp", {"none": DenseCompression("none", None), "fp16": DenseCompression("fp16", torch.float16)},
    "Gradient compression for DDP's comm hook: dense bucket allreduce and horovod_sparse's sparsifiers.")


def checked_sparse(compression: Any, front_end: str) -> bool:
    """Whether ``compression`` is a sparsifier, after checking it suits a ``torch.distributed``
    front end (``front_end``: its module, ``ddp`` or ``fsdp``, named in the error): a method
    built on this backend, or ``Compression.none`` / ``Compression.fp16``
    (:func:`horovod_sparse.methods.base.checked_sparse`)."""
    return checked_for(compression, front_end, backend, lambda dense: isinstance(dense, DenseCompression))
