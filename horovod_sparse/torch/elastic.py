"""Horovod elastic with the sparse optimizer: ``hvd.elastic.TorchState`` syncs it in full.

After a membership change Horovod's ``TorchState`` brings the workers together: when a worker
was added (the world grown, or a worker replaced at the same size) or a worker failed, every
rank, the new one included, runs the state's ``sync()``, which for an optimizer is
``hvd.broadcast_optimizer_state(optimizer, 0)``. For a horovod_sparse optimizer that is not
enough: the new worker must also take the state every rank shares (step counter, thresholds,
partition tables, schedules, MergeComp's grouping), and the configuration must be compared with
the new worker's. Importing ``horovod_sparse.torch`` registers :class:`SparseOptimizerStateHandler`
with ``TorchState`` (Horovod's handler registry), whose ``sync()`` does both
(:func:`horovod_sparse.torch.broadcast_optimizer_state`) at that point, on every rank at once.
A worker removed without a replacement is followed by no sync: the optimizer agrees at its
next exchange, having seen the world size change.
"""
from __future__ import annotations

from horovod.torch.elastic import state as elastic_state

from horovod_sparse.torch.functions import broadcast_optimizer_state
from horovod_sparse.torch.optimizer import SparseDistributedOptimizer


class SparseOptimizerStateHandler(elastic_state.OptimizerStateHandler):
    """``TorchState``'s handler of a horovod_sparse optimizer: saves and restores it as Horovod's
    optimizer handler does (its ``state_dict``, residuals included), and syncs it with rank 0's
    optimizer state and shared sparsification state (residuals stay each rank's own; a new
    worker's are empty)."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


def register() -> None:
    """Put :class:`SparseOptimizerStateHandler` first in ``TorchState``'s handler registry (once)."""
    registry = elastic_state.get_handler_registry()
    entry = (SparseDistributedOptimizer, SparseOptimizerStateHandler)
    if entry not in registry:
        registry.insert(0, entry)
