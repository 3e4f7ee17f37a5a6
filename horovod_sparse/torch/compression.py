"""``horovod_sparse.torch.Compression``: Horovod's ``Compression`` namespace plus the sparsifiers.

``Compression.none`` and ``Compression.fp16`` are Horovod's own. Every registered method is a
factory: ``Compression.topk(density=0.01, min_numel=1024)`` validates its options and returns a
:class:`~horovod_sparse.methods.base.Sparsifier` running on PyTorch's backend.
``Compression.create("topk", ...)`` does the same from a name (benchmarks, configuration files).
Names come from the shared registry; the
namespace itself is shared with the TensorFlow side
(:mod:`horovod_sparse.common.compression_namespace`).
"""
from __future__ import annotations

import horovod.torch as hvd

import horovod_sparse.methods  # noqa: F401  (registers the methods)
from horovod_sparse.common.compression_namespace import compression_namespace

FRAMEWORK = "torch"

Compression = compression_namespace(
    FRAMEWORK, {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16},
    "Gradient compression: Horovod's dense compressors and horovod_sparse's sparsifiers.")
