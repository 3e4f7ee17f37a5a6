"""A loss scaler seen from the exchange: the scale that this step's gradients carry.

Mixed precision scales the loss (``scaler.scale(loss).backward()``), so gradients arrive
multiplied by the scaler's current scale, which changes from step to step (it backs off after
an overflow and grows after a run of clean steps). Error feedback must not carry that factor
from one step to the next. Given the scaler (``loss_scaler=``), the PyTorch front ends divide
the scale out of each gradient as it enters the residual, run the method in the loss's own
units (its thresholds, momentum and residuals do not depend on the scale, and a scale change
loses nothing) and multiply the aggregate by the scale again, so that the scaler's
``unscale_`` / ``step`` / ``update`` work on it as on a dense allreduce's. The scale is read as
the scaler's own tensor, on its device: no host synchronisation.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch


class StepScale(NamedTuple):
    """The loss scale a step's gradients carry, ``scale``, and its ``inverse`` (0-dim float32
    tensors), or None for both: the gradients are unscaled."""

    scale: Optional[torch.Tensor]
    inverse: Optional[torch.Tensor]


#: A step without loss scaling.
UNSCALED = StepScale(None, None)


class LossScale:
    """The scale of a ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` is one)."""

    def __init__(self, scaler: Any) -> None:
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"loss_scaler={scaler!r}: pass the torch.amp.GradScaler whose scale(loss) the "
                            "loss is backpropagated through (or None without loss scaling)")
        self._scaler = scaler

    def factors(self) -> StepScale:
        """``(scale, 1 / scale)`` as 0-dim float32 tensors for the gradients of the current
        backward pass, or :data:`UNSCALED` when the scaler is disabled or has not scaled a loss yet."""
        # GradScaler keeps its scale as this tensor from its first scale() call on (torch 1.6 to
        # 2.13); get_scale() would read it on the host, a synchronisation on CUDA.
        scale = getattr(self._scaler, "_scale", None)
        if not self._scaler.is_enabled() or scale is None:
            return UNSCALED
        return StepScale(scale, scale.double().reciprocal().float())


def step_scale(loss_scale: Optional[LossScale]) -> StepScale:
    """The current step's :class:`StepScale` of ``loss_scale`` (:data:`UNSCALED` without one)."""
    return UNSCALED if loss_scale is None else loss_scale.factors()
