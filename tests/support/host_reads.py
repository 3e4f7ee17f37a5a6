"""Counting host reads of tensor values on the CPU, what would synchronise with a GPU, and the
operations dispatched (:class:`DispatchedOps`).

On CUDA, ``torch.cuda.set_sync_debug_mode`` reports every operation that waits for the device;
on the CPU nothing waits, so the tests count, through a ``TorchFunctionMode``, the operations
that would: reading a value on the host (``bool()``, ``int()``, ``float()``, ``item()``,
``tolist()``, ``numpy()``, ``cpu()``, using a tensor as a Python index) and operations whose
output size depends on the values (``nonzero``, ``unique``, ``masked_select``, indexing with a
boolean mask, ``repeat_interleave`` without ``output_size``, ``bincount``). ``numpy()`` of what
``cpu()`` just returned is the same read, counted once. Reads that C++ makes on its own are
counted at the dispatcher (:class:`_ScalarReads`): ``aten::_local_scalar_dense`` outside one of the
Python reads above, as when a 0-dim tensor indexes another or is passed where a number goes
(``torch.full((1,), n)`` with ``n`` a tensor: a fill value is a host scalar).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.costs.exchange_cost import DispatchedOps  # noqa: F401  (the operations counted, for the workers)
from horovod_sparse.torch_core.selection import accelerator_paths

#: The operations counted, by name (see the module docstring).
READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "cpu", "nonzero", "unique",
         "unique_consecutive", "masked_select", "bincount", "equal"}


def _bool_mask(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


class _ScalarReads(TorchDispatchMode):
    """Counts into ``reads`` the ``aten::_local_scalar_dense`` calls (a value read on the host)
    that no Python read counted by ``reads`` made (:class:`HostReads` sets ``reads.inside``)."""

    def __init__(self, reads: "HostReads") -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func: Any, types: Tuple[type, ...], args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and not self.reads.inside:
            self.reads.names.append("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...``; then ``reads.count`` and ``reads.names`` (the module
    docstring: the Python reads, and C++'s own at the dispatcher)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: List[str] = []
        self._copied: List[torch.Tensor] = []  # what cpu() returned: its numpy() reads nothing more
        #: Whether a counted Python read is running (its own scalar reads are that read).
        self.inside = False
        self._scalars = _ScalarReads(self)

    @property
    def count(self) -> int:
        return len(self.names)

    def __enter__(self) -> "HostReads":
        super().__enter__()
        self._scalars.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scalars.__exit__(*exc)
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Tuple[type, ...], args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "numpy" and any(args[0] is copied for copied in self._copied):
            return func(*args, **kwargs)
        counted = (name in READS or (name == "__getitem__" and len(args) > 1 and _bool_mask(args[1]))
                   or (name == "repeat_interleave" and kwargs.get("output_size") is None))
        if counted:
            self.names.append(name)
        outer, self.inside = self.inside, self.inside or counted
        try:
            result = func(*args, **kwargs)
        finally:
            self.inside = outer
        if name == "cpu":
            self._copied = [result]
        return result


@contextmanager
def reads_on_accelerator_paths(into: List[str]) -> Iterator[None]:
    """Run the block on the accelerators' paths with its host reads counted, their names
    appended to ``into``: for code the autograd engine runs (hooks), outside the function modes
    the caller entered, so the count is taken inside it."""
    with accelerator_paths(), HostReads() as host:
        yield
    into.extend(host.names)
