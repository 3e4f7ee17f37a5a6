"""When the Horovod optimizer's gradients and groups are ready: a parameter's gradient is final
after ``backward_passes_per_step`` backward passes (the earlier ones accumulate locally, as in
Horovod), and a group is ready to exchange once all its parameters' gradients are final."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from horovod_sparse.torch_core.buffers import FlatGroup


class Readiness:
    """The current step's backward passes left per parameter and final gradients per group.

    Args:
        params: the exchanged parameters.
        groups: their groups.
        passes: the backward passes of a step (``backward_passes_per_step``).
    """

    def __init__(self, params: Iterable[torch.Tensor], groups: Sequence[FlatGroup], passes: int) -> None:
        self._passes_left = {p: passes for p in params}
        self.use_groups(groups)

    def use_groups(self, groups: Sequence[FlatGroup]) -> None:
        """Count the final gradients of ``groups`` from now on (the groups changed), none yet."""
        self._group_of = {p: g for g in groups for p in g.params}
        self._final = {g.index: 0 for g in groups}

    def final(self, p: torch.Tensor) -> bool:
        """Count a backward pass of ``p``: whether its gradient is final now. Raises
        ``AssertionError`` (Horovod's) for a pass past the step's last."""
        if self._passes_left[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                 "before call to step(). Increase backward_passes_per_step to "
                                 "accumulate gradients locally.")
        self._passes_left[p] -= 1
        return self._passes_left[p] == 0

    def group_ready(self, p: torch.Tensor) -> Optional[FlatGroup]:
        """Count ``p``'s final gradient in its group: the group, when that makes it ready."""
        group = self._group_of[p]
        self._final[group.index] += 1
        return group if self._final[group.index] == len(group.params) else None

    def ready(self, group: FlatGroup) -> bool:
        """Whether every gradient of ``group`` is final this step."""
        return self._final[group.index] == len(group.params)

    def restart(self, passes: int) -> None:
        """Give every parameter ``passes`` backward passes from now on."""
        for p in self._passes_left:
            self._passes_left[p] = passes

    def next_step(self, passes: int) -> None:
        """Start the next step: ``passes`` backward passes per parameter, no group ready."""
        self.restart(passes)
        for index in self._final:
            self._final[index] = 0
