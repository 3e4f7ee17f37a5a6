"""The ``torch.sparse`` gradients of a Horovod optimizer's step, aggregated as Horovod aggregates
them: with ``sparse_as_dense`` made dense, exchanged with their group and handed back sparse;
otherwise their rows allgathered (averaged for ``op=Average``) whatever the compression, since
the rows present are already a sparse payload, sent exactly, with no residual."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Set

import horovod.torch as hvd
import torch

from horovod_sparse.torch_core.buffers import FlatGroup
from horovod_sparse.torch_core.finiteness import StepFiniteness
from horovod_sparse.torch_core.tensor_backend import all_finite


class SparseRows:
    """One optimizer's ``torch.sparse`` gradients, step after step.

    Args:
        names: every parameter's name (the collectives' and the finiteness report's).
        sparse_as_dense: exchange them densely with their group instead.
        op: Horovod's reduction (``hvd.Average`` or ``hvd.Sum``).
        process_set: the Horovod process set to aggregate over.
        finiteness: the step's finiteness decisions: where it is checking, a rank's non-finite
            rows are reported there and replaced by none.
    """

    def __init__(self, names: Dict[torch.Tensor, str], sparse_as_dense: bool, op: Any,
                 process_set: hvd.ProcessSet, finiteness: StepFiniteness) -> None:
        self._names = names
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._process_set = process_set
        self._finiteness = finiteness
        #: Aggregations of rows in flight, by parameter.
        self._launched: Dict[torch.Tensor, Callable[[], torch.Tensor]] = {}
        #: The aggregates waited for, until :meth:`hand_back`.
        self._aggregates: Dict[torch.Tensor, torch.Tensor] = {}
        #: Parameters whose sparse gradient travels dense this step (``sparse_as_dense``).
        self._densified: Set[torch.Tensor] = set()

    def prepare(self, group: FlatGroup) -> None:
        """Make ``group``'s gradients ready for its exchange: each sparse one densified or its rows
        launched (``.grad`` None until :meth:`hand_back`: it contributes zeros to the group), and
        zeros for a parameter without a gradient on this rank (a dynamic graph; another rank may
        have one)."""
        for p in group.params:
            if p.grad is not None and p.grad.is_sparse:
                if self._sparse_as_dense:
                    p.grad = p.grad.to_dense()
                    self._densified.add(p)
                else:
                    self._launch(p)
            elif p.grad is None and p not in self._launched:
                p.grad = torch.zeros_like(p)

    def _launch(self, p: torch.Tensor) -> None:
        """Start the aggregation of ``p``'s rows."""
        # Sent as it is, duplicate rows and all (as Horovod sends it): coalescing first would sum
        # each rank's duplicates before the ranks' rows, another order, other float rounding.
        grad = p.grad
        p.grad = None
        if self._finiteness.checking and not all_finite(grad._values()):
            self._finiteness.note([self._names[p]], False)
            grad = torch.sparse_coo_tensor(grad._indices()[:, :0], grad._values()[:0], grad.shape)
        self._launched[p] = hvd.sparse_allreduce_async(grad, name=f"hs.rows.{self._names[p]}", op=self._op,
                                                       process_set=self._process_set)

    def wait(self) -> None:
        """Wait for every aggregation of rows launched this step."""
        self._aggregates = {p: handle() for p, handle in self._launched.items()}
        self._launched.clear()

    def hand_back(self, abandoned: bool) -> None:
        """Put the aggregated rows into ``.grad`` (NaN values when the step is ``abandoned``) and
        make the densified gradients sparse again, the layout the optimizer expects (as Horovod
        does)."""
        for p, aggregate in self._aggregates.items():
            p.grad = aggregate
            if abandoned:
                aggregate._values().fill_(math.nan)
        self._aggregates = {}
        for p in self._densified:
            p.grad = p.grad.to_sparse()
        self._densified.clear()
