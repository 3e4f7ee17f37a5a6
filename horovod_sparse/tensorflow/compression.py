"""``horovod_sparse.tensorflow.Compression``: Horovod's ``Compression`` namespace plus the sparsifiers.

``Compression.none`` and ``Compression.fp16`` are ``horovod.tensorflow``'s own. Every registered
method is a factory: ``Compression.topk(density=0.01, min_numel=1024)`` validates its options
(with the same messages as the PyTorch side: the options classes are shared) and returns a
:class:`~horovod_sparse.methods.base.Sparsifier` running on TensorFlow's backend.
``Compression.create("topk", ...)`` does the same from a name (benchmarks, configuration files).
Names come from the shared registry.
"""
from __future__ import annotations

import horovod.tensorflow as hvd

import horovod_sparse.methods  # noqa: F401  (registers the methods)
from horovod_sparse.common.compression_namespace import compression_namespace

FRAMEWORK = "tensorflow"

Compression = compression_namespace(
    FRAMEWORK, {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16},
    "Gradient compression: Horovod's dense compressors and horovod_sparse's sparsifiers.")
