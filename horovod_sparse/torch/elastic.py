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

Outer steps (:class:`horovod_sparse.torch.OuterSteps`) have a handler of their own,
:class:`OuterStepsStateHandler`, with a round boundary as the commit point:

    outer = hs.OuterSteps(model, inner, compression=hs.Compression.topk(density=1 / 64), every=50)
    state = hvd.elastic.TorchState(outer=outer, batch=0)   # outer only: it holds model and optimizers

    @hvd.elastic.run
    def train(state):
        while state.batch < batches:
            loss_fn(model(data(state.batch))).backward()
            outer.step()
            outer.zero_grad()
            state.batch += 1
            if outer.position == 0:     # a round just ended (every replica at the same anchor)
                state.commit()

``state.commit()`` is collective (and with ``overlap`` ends the exchange in flight), so it is the
user's call; committing only where ``outer.position == 0`` makes each round all or nothing. A
worker lost mid-round makes the others' round-end exchange fail (Horovod's
``HorovodInternalError``): every survivor rolls back to the last commit, the start of that round
(its inner steps, and whatever the failed exchange had done to residuals, step counter and
parameters, undone: nothing applied twice), and the new world trains the round again. A worker
added (or replacing one) takes rank 0's state in the sync, its configuration checked first. The
exchange follows the new world's size by itself (its collectives, the average's ``1 / n``, method
states built for the size), as does :meth:`~horovod_sparse.torch.OuterSteps.state_dict`'s rank key.
"""
from __future__ import annotations

from typing import Any, Dict

from horovod.torch.elastic import state as elastic_state

from horovod_sparse.torch.functions import broadcast_optimizer_state
from horovod_sparse.torch.optimizer import SparseDistributedOptimizer
from horovod_sparse.torch.outer_steps import OuterSteps


class SparseOptimizerStateHandler(elastic_state.OptimizerStateHandler):
    """``TorchState``'s handler of a horovod_sparse optimizer: saves and restores it as Horovod's
    optimizer handler does (its ``state_dict``, residuals included), and syncs it with rank 0's
    optimizer state and shared sparsification state (residuals stay each rank's own; a new
    worker's are empty)."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class OuterStepsStateHandler(elastic_state.StateHandler):
    """``TorchState``'s handler of :class:`~horovod_sparse.torch.OuterSteps` (the module's
    docstring): ``save()`` (at ``state.commit()``) keeps a :meth:`~horovod_sparse.torch.OuterSteps.snapshot`
    of this rank's whole state, ``restore()`` (after a worker was lost) rolls back to it,
    ``sync()`` (after a membership change, on every worker at once) makes every rank take rank
    0's shared state (:meth:`~horovod_sparse.torch.OuterSteps.agree_after_change`). A worker is new
    until it first commits: until then a roll-back takes it to its state at construction, and a
    sync puts its parameters at the anchor with empty residuals."""

    def __init__(self, outer: OuterSteps) -> None:
        super().__init__(outer)
        self._saved: Dict[str, Any] = outer.snapshot()
        self._new = True

    def save(self) -> None:
        self._saved = self.value.snapshot()
        self._new = False

    def restore(self) -> None:
        self.value.roll_back(self._saved)

    def sync(self) -> None:
        self.value.agree_after_change(new=self._new)


def register() -> None:
    """Put :class:`SparseOptimizerStateHandler` and :class:`OuterStepsStateHandler` first in
    ``TorchState``'s handler registry (once)."""
    registry = elastic_state.get_handler_registry()
    for entry in ((SparseDistributedOptimizer, SparseOptimizerStateHandler), (OuterSteps, OuterStepsStateHandler)):
        if entry not in registry:
            registry.insert(0, entry)
