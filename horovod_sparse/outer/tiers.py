"""What :class:`~horovod_sparse.outer.rounds.OuterSteps` says of its two tiers (a base of it): the
tiers' groups, and the node's group for the inner steps' dense exchange inside the node (DDP)."""
from __future__ import annotations

from typing import Any, Optional

from horovod_sparse.common.tiers import Tiers
from horovod_sparse.engine.step import StepEngine
from horovod_sparse.outer.replicas import Replicas


class NodeTiers:
    """The tiers of an outer-steps object's engine (its ``_engine``) over its ``replicas``."""

    _engine: StepEngine
    replicas: Replicas

    @property
    def tiers(self) -> Optional[Tiers]:
        """The two tiers' groups (:class:`~horovod_sparse.common.tiers.Tiers`), None when flat."""
        return self._engine.tiers

    @property
    def node_group(self) -> Any:
        """This rank's node's group in two tiers, for the inner steps' dense exchange inside the
        node: on ``torch.distributed`` a group (``DDP(model, process_group=outer.node_group)``),
        under Horovod the host's process set (the one :func:`horovod_sparse.torch.node_process_set`
        gives). ``ValueError`` when the outer steps run flat (no node to exchange in)."""
        if self.tiers is None:
            raise ValueError("these outer steps run flat (hierarchical=False, or a job of one node or of one worker "
                             "per node): there is no node group; build OuterSteps with hierarchical=True and "
                             "node_size= the workers per node on a job of several nodes, or train without DDP")
        return self.replicas.node_group(self.tiers)

    def node_size_in_tiers(self) -> Optional[int]:
        """The workers per node of the two tiers, None when flat (a checkpoint's layout)."""
        return None if self.tiers is None else self.tiers.node_size
