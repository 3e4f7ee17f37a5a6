"""The outer optimizer of :class:`~horovod_sparse.outer.rounds.OuterSteps` (a base of it): DiLoCo's
by default, over what it steps (the model's trainable parameters, or with ``offload`` the anchor's
tensors in CPU memory), and its step with a round's averages as the gradients.
"""
from __future__ import annotations

from typing import Any, Callable, List, Sequence, Union

import torch

from horovod_sparse.outer.sharded import gradient_like
from horovod_sparse.torch_core.buffers import FlatGroup

#: A function building an optimizer over the tensors it is given (``outer_optimizer`` with ``offload``).
OptimizerFactory = Callable[[List[torch.Tensor]], torch.optim.Optimizer]
#: What ``outer_optimizer`` may be: None (DiLoCo's), an optimizer, or a function building one.
OuterOptimizerArgument = Union[None, torch.optim.Optimizer, OptimizerFactory]

#: DiLoCo's outer optimizer (Douillard et al. 2023): Nesterov SGD, learning rate 0.7, momentum 0.9.
DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def diloco_outer_optimizer(params: List[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer over ``params`` (:data:`DILOCO_OUTER`)."""
    return torch.optim.SGD(params, **DILOCO_OUTER)


def check_outer_optimizer(given: OuterOptimizerArgument, offload: bool, named: List[Any]) -> None:
    """Refuse, before any collective, an optimizer ``given`` that cannot step what the outer steps
    step: an optimizer object with ``offload`` (``TypeError``: it must step the anchor in CPU
    memory, so a function of the tensors is needed), or one not over exactly the model's
    trainable parameters ``named`` (``ValueError``)."""
    if not isinstance(given, torch.optim.Optimizer):
        return
    if offload:
        raise TypeError("with offload=True the outer optimizer steps the anchor in CPU memory: give "
                        "outer_optimizer as a function of the tensors to step, e.g. "
                        "outer_optimizer=lambda params: torch.optim.SGD(params, lr=1.0), or None for DiLoCo's")
    _require_over(given, [p for _, p in named], named)


class OuterOptimizer:
    """The outer optimizer of an outer-steps object over its ``groups``."""

    groups: List[FlatGroup]

    def _use_outer_optimizer(self, given: OuterOptimizerArgument, stepped: List[List[torch.Tensor]],
                             named: List[Any]) -> None:
        """Step ``stepped`` (per group, the tensors the outer optimizer steps: the parameters, or
        the anchor's) with ``given`` (checked by :func:`check_outer_optimizer`), or with the
        optimizer it builds over them (None: :func:`diloco_outer_optimizer`)."""
        #: The tensors the outer optimizer steps, group by group.
        self._stepped = stepped
        tensors = [t for each in stepped for t in each]
        built = given if isinstance(given, torch.optim.Optimizer) else (given or diloco_outer_optimizer)(tensors)
        _require_over(built, tensors, named)
        self.outer_optimizer = built

    def _outer_step(self, indices: Sequence[int], updates: Sequence[torch.Tensor]) -> None:
        """The outer optimizer's step with the averages ``updates`` of the groups ``indices`` as
        the gradients of what it steps (:attr:`_stepped`; copied to its device), the others
        without one; their gradients (the parameters' inner ones) put back afterwards."""
        stepped = [t for tensors in self._stepped for t in tensors]
        saved = [t.grad for t in stepped]
        for t in stepped:
            t.grad = None
        for index, update in zip(indices, updates):
            for t, view in zip(self._stepped[index], self.groups[index].views(update)):
                t.grad = gradient_like(t, view.to(t.device))
        self.outer_optimizer.step()
        for t, grad in zip(stepped, saved):
            t.grad = grad


def _require_over(optimizer: torch.optim.Optimizer, params: List[torch.Tensor], named: List[Any]) -> None:
    """Raise ``ValueError`` unless ``optimizer`` steps exactly ``params`` (the model's trainable
    parameters, or their anchors with ``offload``; ``named``: the parameters' names, in order)."""
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if given != {id(p) for p in params}:
        missing = [name for (name, _), p in zip(named, params) if id(p) not in given]
        raise ValueError(f"outer_optimizer must step exactly the model's trainable parameters: it misses "
                         f"{missing[:5]} and has {len(given - {id(p) for p in params})} others; build it over "
                         "model.parameters() (with offload=True: over the tensors it is given), or leave it None "
                         "for DiLoCo's Nesterov SGD")
