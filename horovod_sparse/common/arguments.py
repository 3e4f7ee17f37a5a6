"""Checks of the wrapper arguments that both front ends take from Horovod (``op``,
``gradient_predivide_factor``, ``compression``), with the same messages in both frameworks."""
from __future__ import annotations

import numbers
import warnings
from typing import Any


#: Horovod's reduction ops, by their attribute names in ``horovod.torch`` / ``horovod.tensorflow``.
_OPS = ("Average", "Sum", "Adasum", "Min", "Max", "Product")


def op_name(op: Any, hvd: Any) -> str:
    """``op``'s name as :func:`check_wrapper_arguments` takes it (``"average"``, ``"sum"``, ...),
    looked up in the framework's Horovod module ``hvd``; ``str(op)`` for an unknown op."""
    return next((name.lower() for name in _OPS if getattr(hvd, name) == op), str(op))


def check_wrapper_arguments(compression: Any, sparse: bool, sparsifier_base: type, op_name: str,
                            gradient_predivide_factor: float, framework: str) -> None:
    """Refuse combinations a sparse exchange cannot honour, naming what to use instead.

    Args:
        compression: the ``compression=`` argument as given.
        sparse: whether ``compression`` is a sparsifier instance.
        sparsifier_base: the framework's sparsifier base class (to recognise a class passed
            where an instance is expected).
        op_name: ``"average"``, ``"sum"``, ``"adasum"`` or another Horovod reduction's name.
        gradient_predivide_factor: as given.
        framework: the front end's framework (``"torch"`` or ``"tensorflow"``); a sparsifier
            built for the other one is refused.
    """
    if gradient_predivide_factor != 1.0 and op_name != "average":
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if isinstance(compression, type) and issubclass(compression, sparsifier_base):
        raise TypeError(f"compression={compression.__name__} is a class; create an instance with "
                        f"Compression.{compression.method_name}(density=...)")
    if not sparse:
        return
    if compression.B.name != framework:
        raise TypeError(f"{compression!r} was built by horovod_sparse.{compression.B.name}.Compression and "
                        f"runs on {compression.B.name} tensors; build it with "
                        f"horovod_sparse.{framework}.Compression.{compression.method_name}(...) instead")
    if op_name == "adasum":
        raise ValueError("op=hvd.Adasum combines dense gradients and cannot be used with a "
                         "sparsifier; use op=hvd.Average")
    if op_name not in ("average", "sum"):
        raise ValueError(f"a sparsifier sums the selected values over ranks, so op must be hvd.Average "
                         f"or hvd.Sum, got op={op_name}")
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor applies to dense allreduces only; sparse exchanges "
                         "sum exactly the selected values. Leave it at 1.0 with a sparsifier.")


def check_backward_passes(passes: Any) -> int:
    """``backward_passes_per_step`` as an int >= 1: a fraction or a bool would make the hooks
    count down past the step they should exchange at."""
    if isinstance(passes, bool) or not isinstance(passes, numbers.Integral):
        raise TypeError(f"backward_passes_per_step must be an integer > 0, got {passes!r}")
    if passes <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    return int(passes)


def merge_num_groups(num_groups: int, groups: Any) -> Any:
    """Horovod's deprecated ``num_groups``: warn, and use it where ``groups`` is not given."""
    if num_groups == 0:
        return groups
    warnings.warn("Parameter `num_groups` has been replaced by `groups`.", DeprecationWarning, stacklevel=3)
    return num_groups if groups is None else groups
