"""Horovod's state-broadcast helpers, adapted to the sparse optimizer."""
from __future__ import annotations

from typing import Optional

import horovod.torch as hvd
import torch


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None) -> None:
    """``hvd.broadcast_optimizer_state`` without a gradient exchange.

    On an optimizer with no state yet, Horovod initialises the state by calling ``step()`` on zero
    gradients; through the wrapper that would run one (harmless but counted) exchange of zeros.
    This runs it under ``skip_synchronize()`` instead. Sparsification state (residuals,
    thresholds) is not broadcast: each rank's residual is its own.
    """
    with optimizer.skip_synchronize():  # type: ignore[attr-defined]
        hvd.broadcast_optimizer_state(optimizer, root_rank, model)
