"""What every rank of a Horovod optimizer shares or must agree on: the configuration, checked
across the process set; checkpoints (the step counter, MergeComp's grouping, each group's
residual and method state); the agreement on one rank's shared state before the first exchange,
after a checkpoint loaded on one rank and after an elastic change."""
from __future__ import annotations

from typing import Any, Dict

import horovod.torch as hvd

from horovod_sparse.common.arguments import op_name


class SharedState:
    """The shared state of :class:`~horovod_sparse.torch.exchanging.ExchangingOptimizer` (a base
    of it, its methods copied with it into the user's optimizer class): it reads the optimizer's
    model state (``_model``), groups, step engine and process set."""

    def _require_same_configuration(self) -> None:
        """Every rank of the process set raises the same ``ValueError`` unless they all have the
        same configuration (:meth:`ModelState.require_same_configuration`). Collective."""
        self._model.require_same_configuration(
            {"op": op_name(self.op, hvd), "gradient_predivide_factor": self.gradient_predivide_factor,
             "backward_passes_per_step": self.backward_passes_per_step, "nonfinite": self.nonfinite,
             "sparse_as_dense": self.sparse_as_dense, "hierarchical": self._hierarchical,
             "dense": sorted(self._kept_dense)},
            [(g.name, g.numel, str(g.dtype), [list(p.shape) for p in g.params]) for g in self._groups])

    # -- checkpoints and the state every rank shares ------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state plus, under ``"horovod_sparse"``, this rank's
        sparsification state: step counter, MergeComp's grouping, and per group its residual
        and method state (thresholds, partition tables, schedules, DGC's velocity), as tensors
        and plain containers (``torch.load`` reads it with ``weights_only=True``). Residuals
        are per rank: save every rank's state dict to resume exactly."""
        state = super(self.__class__, self).state_dict()  # type: ignore[misc]
        state["horovod_sparse"] = self._model.record(self._groups, self.steps, per_rank=True)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        The groups must match the checkpoint's by name and size, else ``ValueError`` naming
        both (build the optimizer with the model and ``groups=`` it was saved with; a MergeComp
        grouping is restored when the checkpoint was taken after the search decided). Any
        worker count may load it: each rank keeps the residual it loads, and state built for
        another world size is rebuilt at the next exchange, as after an elastic change (only
        the same worker count resumes exactly)."""
        state_dict = dict(state_dict)
        ours = state_dict.pop("horovod_sparse", None)
        self._engine.flights.clear()
        self._synchronized = False
        self._should_synchronize = True
        self._abandoned.forget()
        self._readiness.restart(self.backward_passes_per_step)
        if ours is not None:
            self._engine.restart_at(self._model.restore(ours, self._groups, self._use_groups))
        super(self.__class__, self).load_state_dict(state_dict)  # type: ignore[misc]

    def _agree_if_due(self) -> None:
        """Before this optimizer's first exchange, and again after the world changed size
        (elastic: a worker removed, after which Horovod syncs nothing), every rank adopts the
        shared state of the agreed rank (see :meth:`agree_shared_state`). A membership change
        that adds a worker, the size changed or not (a worker replaced), is agreed on earlier,
        in ``hvd.elastic.TorchState``'s sync (:mod:`horovod_sparse.torch.elastic`), which every
        rank, the new one included, runs after the change. The size is read once a step (Horovod
        changes it only between steps)."""
        if self._agree_with is None and not self._size_checked and self._world_size != self.process_set.size():
            self._agree_with = 0
        self._size_checked = True
        if self._agree_with is not None:
            self.agree_shared_state(self._agree_with)

    def _take_place(self) -> None:
        """Read the world size and this rank, the exchanges' from now on (at construction and at
        every agreement: Horovod changes them only between steps)."""
        self._world_size, self._rank = self.process_set.size(), self.process_set.rank()
        self._engine.transport.pin(self._world_size, self._rank)

    def agree_shared_state(self, root_rank: int = 0) -> None:
        """Every rank of the process set takes ``root_rank``'s step counter, MergeComp grouping
        and method state shared by all ranks (thresholds, partition tables, schedules);
        residuals and per-rank method state (DGC's velocity) stay each rank's own. Collective.

        It runs by itself before the first exchange of a new optimizer with ``root_rank=0``, so
        Horovod's checkpoint idiom (rank 0 alone loads a checkpoint, then broadcasts) resumes in
        step on every rank: rank 0 with its saved residual, the others with empty residuals (a
        rank-0 checkpoint holds no other rank's residual). :func:`broadcast_optimizer_state`
        calls it with its root. In a Horovod elastic job it first compares the configuration
        across ranks, a joining worker's included (``ValueError`` on every rank if it differs).
        """
        self._agree_with = None
        if not self.process_set.included():
            return
        self._take_place()
        if self._elastic:
            self._require_same_configuration()
        if not self._groups:
            return  # nothing is exchanged, so there is nothing to agree on
        steps = self._model.agree(root_rank, self._groups, self.steps, self._use_groups)
        if self.process_set.rank() != root_rank:
            self._engine.restart_at(steps)
