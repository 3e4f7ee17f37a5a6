"""The one registry of sparsification methods, shared by both frameworks and the benchmarks.

A method is registered once, by its one implementation (:func:`implements`, on the class in
its module of :mod:`horovod_sparse.methods`), with its options class and summary; it runs in
either framework with that framework's backend. The registry is framework-free: importing
:mod:`horovod_sparse.methods` fills it. ``Compression.<name>(...)`` in either framework,
the benchmarks' ``--compressor NAME`` and configuration files all resolve names here.
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple, Type, TypeVar

from horovod_sparse.common.options import SparsifierOptions

T = TypeVar("T")


@dataclass
class MethodSpec:
    """A registered method: its name, options class, one-line summary and implementation."""

    name: str
    options: Type[SparsifierOptions]
    summary: str
    implementation: type


_METHODS: Dict[str, MethodSpec] = {}


def implements(name: str, options: Type[SparsifierOptions], summary: str) -> Callable[[Type[T]], Type[T]]:
    """Class decorator: register the class as method ``name`` (unique), with its options class
    and a one-line summary (``python -m benchmarks`` and the docs list it)."""

    def decorate(cls: Type[T]) -> Type[T]:
        if name in _METHODS:
            raise ValueError(f"method {name!r} is already registered")
        # Each options class belongs to exactly one method; subclass to share fields.
        options_for_method = type(options.__name__, (options,), {"method": name, "__doc__": options.__doc__})
        _METHODS[name] = MethodSpec(name, options_for_method, summary, cls)
        cls.method_name = name  # type: ignore[attr-defined]
        return cls

    return decorate


def method(name: str) -> MethodSpec:
    """Look up a method by name, raising a ValueError that lists the known ones."""
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown sparsification method {name!r}; known methods: "
                         f"{', '.join(sorted(_METHODS))}") from None


def method_names() -> List[str]:
    """Names of all registered methods, sorted."""
    return sorted(_METHODS)


def make_options(name: str, **kwargs: Any) -> SparsifierOptions:
    """Build validated options for method ``name``; unknown option names are refused."""
    spec = method(name)
    try:
        return spec.options(**kwargs)
    except TypeError as err:
        if "unexpected keyword argument" not in str(err):
            raise
        known = ", ".join(f.name for f in spec.options.__dataclass_fields__.values())
        raise TypeError(f"{name}: {err.args[0].split('__init__() ')[-1]}; options of {name!r} are: {known}") from None


#: The backend module of each framework key: Horovod's PyTorch, TensorFlow, and ``torch.distributed``
#: (the DDP hook's and FSDP2's, keyed ``"ddp"`` as its methods' ``B.name`` says).
BACKENDS = {"torch": "horovod_sparse.torch.backend", "tensorflow": "horovod_sparse.tensorflow.backend",
            "ddp": "horovod_sparse.distributed.backend"}


def create(framework: str, name: str, **kwargs: Any) -> Any:
    """Instantiate method ``name`` with validated options for ``framework`` (a key of
    :data:`BACKENDS`: ``"torch"``, ``"tensorflow"`` or ``"ddp"``)."""
    spec = method(name)
    options = make_options(name, **kwargs)
    return spec.implementation(options, importlib.import_module(BACKENDS[framework]))


def parse_spec(text: str) -> Tuple[str, Dict[str, Any]]:
    """Parse a command-line method spec: ``"topk"`` or ``"topk:density=0.01,min_numel=0"``.

    Values are read as JSON where they parse (numbers, true/false, null), else kept as strings.
    """
    name, _, rest = text.partition(":")
    options: Dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"bad option {item!r} in {text!r}: expected key=value, e.g. density=0.01")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return name.strip(), options
