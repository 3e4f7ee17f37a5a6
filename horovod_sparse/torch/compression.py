"""``horovod_sparse.torch.Compression``: Horovod's ``Compression`` namespace plus the sparsifiers.

``Compression.none`` and ``Compression.fp16`` are Horovod's own. Every registered method is a
factory: ``Compression.topk(density=0.01, min_numel=1024)`` validates its options and returns a
:class:`~horovod_sparse.torch.sparsifier.Sparsifier`. ``Compression.create("topk", ...)`` does the
same from a name (benchmarks, configuration files). Names come from the shared registry.
"""
from __future__ import annotations

from typing import Any, Callable, List

import horovod.torch as hvd

import horovod_sparse.torch.sparsifiers  # noqa: F401  (registers the implementations)
from horovod_sparse.common import registry
from horovod_sparse.torch.sparsifier import Sparsifier

FRAMEWORK = "torch"


class _CompressionNamespace(type):
    """Resolves ``Compression.<method>`` to a factory of the registered implementation."""

    def __getattr__(cls, name: str) -> Callable[..., Sparsifier]:
        if name.startswith("_") or name not in registry.method_names():
            raise AttributeError(f"Compression has no method {name!r}; known methods: none, fp16, "
                                 f"{', '.join(registry.method_names())}")

        def factory(**options: Any) -> Sparsifier:
            return registry.create(FRAMEWORK, name, **options)

        factory.__name__ = name
        factory.__doc__ = registry.method(name).summary
        return factory

    def __dir__(cls) -> List[str]:
        return sorted(set(super().__dir__()) | set(registry.method_names()))


class Compression(metaclass=_CompressionNamespace):
    """Gradient compression: Horovod's dense compressors and horovod_sparse's sparsifiers."""

    none = hvd.Compression.none
    fp16 = hvd.Compression.fp16

    @staticmethod
    def create(name: str, **options: Any) -> Any:
        """The compressor called ``name`` (``"none"``, ``"fp16"`` or a registered method)."""
        if name in ("none", "fp16"):
            if options:
                raise TypeError(f"Compression.{name} takes no options, got {sorted(options)}")
            return getattr(hvd.Compression, name)
        return registry.create(FRAMEWORK, name, **options)

    @staticmethod
    def names() -> List[str]:
        """Every name :meth:`create` accepts."""
        return ["none", "fp16", *registry.method_names()]
