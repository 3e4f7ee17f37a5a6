"""Horovod's state-broadcast helpers, adapted to the sparse optimizer."""
from __future__ import annotations

from typing import Optional

import horovod.torch as hvd
import torch


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None) -> None:
    """``hvd.broadcast_optimizer_state``, then every rank takes ``root_rank``'s sparsification
    state shared by all ranks (step counter, thresholds, partition tables, schedules,
    MergeComp's grouping: ``optimizer.agree_shared_state``). Residuals and other per-rank state
    are not broadcast: after rank 0 alone loaded a checkpoint, rank 0 continues with its saved
    residual and the other ranks with theirs (empty in a fresh process).

    ``hvd.broadcast_optimizer_state`` alone also works with the wrapper: the same agreement then
    happens, with rank 0 as root, before the optimizer's first exchange.
    """
    hvd.broadcast_optimizer_state(optimizer, root_rank, model)
    optimizer.agree_shared_state(root_rank)  # type: ignore[attr-defined]
