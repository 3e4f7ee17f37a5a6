"""The mixed-precision loop of the AMP tests, shared by the Horovod and the DDP workers: a small
regression net trained under float16 autocast on CPU with a ``torch.amp.GradScaler`` whose first
steps overflow on purpose (its initial scale far too large)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch


def regression_model() -> torch.nn.Module:
    """The same initial net on every rank."""
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def regression_batch(step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: inputs and a linear target."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(32, 32, generator=generator)
    return x, x[:, :4] * 0.5 + 0.1


def train(model: torch.nn.Module, scaler: torch.amp.GradScaler, steps: int, rank: int,
          step_fn: Callable[[torch.Tensor], None], residuals: Callable[[], List[torch.Tensor]],
          dtype: torch.dtype = torch.float16) -> Dict[str, Any]:
    """``steps`` steps under ``dtype`` autocast; ``step_fn(loss)`` runs the caller's recipe from
    ``scaler.scale(loss)`` to ``scaler.update()``. Records per step the scale it ran at, whether
    the parameters moved, the loss and whether every residual (``residuals()``) is finite; the
    final parameters."""
    record = []
    for step in range(steps):
        x, y = regression_batch(step, rank)
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scale = scaler.get_scale()
        step_fn(loss)
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        record.append({"scale": scale, "moved": moved, "loss": float(loss),
                       "residuals_finite": all(bool(torch.isfinite(r).all()) for r in residuals())})
    return {"steps": record, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()}
