"""The ``Compression`` namespace both front ends expose, built from the shared registry.

``Compression.none`` and ``Compression.fp16`` are the front end's dense compressors (Horovod's own, or
DDP's averaging for :mod:`horovod_sparse.ddp`).
Every registered method is a factory: ``Compression.topk(density=0.01, min_numel=1024)``
validates its options and returns that framework's implementation; ``Compression.create(name,
**options)`` does the same from a name (benchmarks, configuration files). Framework-free: the
front-end packages pass in their dense compressors.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

from horovod_sparse.common import registry

DENSE_NAMES = ("none", "fp16")


class _CompressionNamespace(type):
    """Resolves ``Compression.<method>`` to a factory of the registered implementation."""

    framework: str

    def __getattr__(cls, name: str) -> Callable[..., Any]:
        if name.startswith("_") or name not in registry.method_names():
            raise AttributeError(f"Compression has no method {name!r}; known methods: "
                                 f"{', '.join(DENSE_NAMES)}, {', '.join(registry.method_names())}")

        def factory(**options: Any) -> Any:
            return registry.create(cls.framework, name, **options)

        factory.__name__ = name
        factory.__doc__ = registry.method(name).summary
        return factory

    def __dir__(cls) -> List[str]:
        return sorted(set(super().__dir__()) | set(registry.method_names()))


def compression_namespace(framework: str, dense: Dict[str, Any], doc: str) -> type:
    """Build the ``Compression`` class of ``framework``.

    Args:
        framework: the registry's framework key (``"torch"``, ``"tensorflow"``, ``"ddp"``).
        dense: the front end's dense compressors, ``{"none": ..., "fp16": ...}``.
        doc: the class docstring.
    """
    if sorted(dense) != sorted(DENSE_NAMES):
        raise ValueError(f"dense compressors must be exactly {DENSE_NAMES}, got {sorted(dense)}")

    def create(name: str, **options: Any) -> Any:
        """The compressor called ``name`` (``"none"``, ``"fp16"`` or a registered method)."""
        if name in dense:
            if options:
                raise TypeError(f"Compression.{name} takes no options, got {sorted(options)}")
            return dense[name]
        return registry.create(framework, name, **options)

    def names() -> List[str]:
        """Every name :meth:`create` accepts."""
        return [*DENSE_NAMES, *registry.method_names()]

    attributes = {"__doc__": doc, "framework": framework, **dense,
                  "create": staticmethod(create), "names": staticmethod(names)}
    return _CompressionNamespace("Compression", (), attributes)
