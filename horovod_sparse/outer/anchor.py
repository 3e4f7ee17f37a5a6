"""Where every replica started the current round: the parameters of the last outer step.

A round's pseudo-gradient is ``anchor - θ`` (what the inner steps moved, with DiLoCo's sign: a
descent direction, as a gradient is), and an outer step starts from the anchor again: every
replica resets to it, the outer optimizer applies the averaged pseudo-gradient, and the result
is the next anchor. One flat buffer per group, each parameter's slice laid out as the parameter
is in memory (:meth:`~horovod_sparse.torch_core.buffers.FlatGroup.views`), on the parameters'
device or, offloaded, in CPU memory (pinned where the parameters are on a GPU), where the outer
optimizer then steps it (:attr:`Anchor.masters`).
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import torch

from horovod_sparse.torch_core.buffers import FlatGroup


class Anchor:
    """The anchor of each of ``groups`` (the parameters' values when it is built).

    Args:
        groups: the front end's groups, every parameter in exactly one.
        offload: keep the anchor in CPU memory (pinned where a group's parameters are on a GPU)
            instead of on the parameters' device.

    Attributes:
        masters: offloaded, per group the anchor of each of its parameters as a leaf tensor of
            the parameter's shape sharing the anchor's memory (what the outer optimizer steps);
            else empty.
    """

    def __init__(self, groups: Sequence[FlatGroup], offload: bool = False) -> None:
        self.groups = list(groups)
        self.flat: List[torch.Tensor] = [
            torch.empty(g.numel, dtype=g.dtype, device="cpu", pin_memory=g.params[0].is_cuda) if offload
            else torch.empty(g.numel, dtype=g.dtype, device=g.params[0].device) for g in self.groups]
        self.masters: List[List[torch.nn.Parameter]] = [
            [torch.nn.Parameter(view) for view in g.views(flat)] for g, flat in zip(self.groups, self.flat)
        ] if offload else []
        self.take()

    def _chosen(self, indices: Optional[Iterable[int]]) -> Iterable[int]:
        return range(len(self.groups)) if indices is None else indices

    @torch.no_grad()
    def take(self, indices: Optional[Iterable[int]] = None) -> None:
        """Make the parameters' current values the anchor of the groups ``indices`` (default:
        every group), after their outer step or at the first."""
        for index in self._chosen(indices):
            group = self.groups[index]
            for view, p in zip(group.views(self.flat[index]), group.params):
                view.copy_(p)

    @torch.no_grad()
    def pseudo_gradient(self, index: int) -> torch.Tensor:
        """Group ``index``'s pseudo-gradient ``anchor - θ``, flat (a new tensor on the parameters' device)."""
        group = self.groups[index]
        delta = self.flat[index].to(group.params[0].device, copy=True)
        for view, p in zip(group.views(delta), group.params):
            view.sub_(p)
        return delta

    @torch.no_grad()
    def reset(self, indices: Optional[Iterable[int]] = None) -> None:
        """Put the parameters of the groups ``indices`` (default: every group) back at their
        anchor (the start of an outer step, or of the next round)."""
        for index in self._chosen(indices):
            group = self.groups[index]
            for view, p in zip(group.views(self.flat[index]), group.params):
                p.copy_(view)

    def load(self, saved: Sequence[torch.Tensor]) -> None:
        """Take a checkpoint's anchors (:attr:`flat`'s, in group order), copied to the groups' devices."""
        if [s.numel() for s in saved] != [f.numel() for f in self.flat]:
            raise ValueError(f"checkpoint does not match the model: its anchors have {[s.numel() for s in saved]} "
                             f"elements per group, the model's groups {[f.numel() for f in self.flat]}; load the "
                             "state saved with this model")
        for flat, s in zip(self.flat, saved):
            flat.copy_(s.reshape(-1))
