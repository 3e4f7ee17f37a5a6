"""This rank's finiteness decisions of one step, as both PyTorch front ends make them.

Each group's gradients are checked when the group is launched; the step's decisions are
learnt together when the step ends (:meth:`StepFiniteness.nonfinite`). On the host the check
is a bool read at once (:func:`~horovod_sparse.torch_core.tensor_backend.all_finite`); on an
accelerator it stays a 0-dim bool tensor on the device
(:func:`~horovod_sparse.torch_core.tensor_backend.finite_flag`), which the launch uses without
reading it, so a step reads finiteness on the host once per device, however many groups.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from horovod_sparse.common.stats import ReadScalars

from horovod_sparse.torch_core.buffers import Finite
from horovod_sparse.torch_core.selection import on_accelerator
from horovod_sparse.torch_core.device_figures import read_scalars
from horovod_sparse.torch_core.tensor_backend import all_finite, finite_flag


class StepFiniteness:
    """The decisions of the current step, in launch order.

    Args:
        checking: whether the front end checks gradients at all (it has a ``nonfinite`` policy);
            without one every group is finite and nothing is checked or noted.
    """

    def __init__(self, checking: bool) -> None:
        self.checking = checking
        self._decisions: List[Tuple[Sequence[str], Finite]] = []

    def check(self, names: Sequence[str], *tensors: torch.Tensor) -> Finite:
        """Whether every element of ``tensors`` (the gradients of the groups ``names``, on one
        device) is finite, noted for :meth:`nonfinite`; True when there are none, or when not
        :attr:`checking`."""
        if not self.checking:
            return True
        finite: Finite = (finite_flag(*tensors) if tensors and on_accelerator(tensors[0])
                          else all_finite(*tensors))
        self._decisions.append((names, finite))
        return finite

    def note(self, names: Sequence[str], finite: bool) -> None:
        """Note a decision made elsewhere (a sparse gradient's rows)."""
        self._decisions.append((names, finite))

    def count_on_host(self) -> Optional[int]:
        """How many of the step's groups so far were not finite on this rank, when every decision
        is known on the host (CPU tensors, or none checked); None while one is left on a device."""
        if any(isinstance(finite, torch.Tensor) for _, finite in self._decisions):
            return None
        return sum(len(names) for names, finite in self._decisions if not finite)

    def nonfinite(self, read: ReadScalars = read_scalars) -> List[str]:
        """The groups of this step whose gradients were not finite on this rank, in launch order
        (the decisions left on devices read together by ``read``: one host read per
        device, shared with the step's statistics when the engine's
        :meth:`~horovod_sparse.engine.step.StepEngine.read_with_figures` is given); clears the
        step's decisions."""
        deferred = [finite for _, finite in self._decisions if isinstance(finite, torch.Tensor)]
        values = iter(read(deferred))
        names = [name for names, finite in self._decisions
                 if not (next(values) if isinstance(finite, torch.Tensor) else finite) for name in names]
        self._decisions = []
        return names
