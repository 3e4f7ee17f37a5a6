"""Flat buffers of a parameter group: the error-feedback residual and the aggregated update.

Both buffers are allocated once, on the group's first sparse step, and reused every step: no
full-size allocation happens per step (allocating 25.6M zeros costs ~45 ms on a CPU core). A
front end that hands over its flat gradient's memory (DDP's bucket, which its own allreduce
overwrites with the average; FSDP2's reduce-scattered shard) has the update written there
instead: the group then allocates no update buffer at all (:meth:`FlatGroup.load_flat`).

Each parameter's slice of a buffer is laid out as the parameter is in memory (PyTorch's gradient
layout contract, which autograd and DDP keep): a ``channels_last`` or transposed parameter gets
a ``.grad`` with its own strides, which fused and foreach optimizers assume (they step the
parameter and its gradient as flat memory).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from horovod_sparse.torch_core.selection import on_accelerator

#: Whether a group's gradients are all finite: a host bool, or a 0-dim bool tensor on a device.
Finite = Union[bool, torch.Tensor]


def dense_layout(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill its memory without gaps or overlaps (contiguous in
    some order of its dimensions, as ``channels_last`` is): such a tensor's gradient takes its
    strides; any other gets contiguous ones (autograd's rule)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def layout_view(chunk: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``param``'s flat slice ``chunk`` of a buffer seen with ``param``'s shape and, where
    :func:`dense_layout`, its strides (the slice then holds the elements in memory order)."""
    if param.is_contiguous() or not dense_layout(param):
        return chunk.view(param.shape)
    return chunk.as_strided(param.shape, param.stride())


#: On the host, a group whose parameters hold this many elements each on average or more adds
#: every gradient into the residual where it lies; a group of smaller ones stages them first (one
#: check and one addition for the group, where adding in place takes one of each per parameter):
#: in place took 0.72 of the staged time on ResNet-50's and VGG's 161 and 18 parameters, 1.08 and
#: 1.64 of it on the digits MLP's 6 and ResNet-20's 65 (``python -m benchmarks.costs.gradient_loading``).
ADD_IN_PLACE_FROM = 65_536


def _add_into(buffer: torch.Tensor, gradient: torch.Tensor, inv_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``buffer += gradient``, or with ``inv_scale`` ``buffer += gradient * inv_scale``, in place."""
    return buffer.add_(gradient) if inv_scale is None else buffer.addcmul_(gradient, inv_scale)


class FlatGroup:
    """Parameters whose gradients are selected and exchanged as one flat buffer.

    Args:
        index: position of the group in the optimizer's group list (same on every rank).
        names: parameter names, in flattening order.
        params: the parameters, same order; one dtype and device.
        name: the group's name (default: the parameter's name, or ``group<index>.<first name>``).

    After a sparse step of :meth:`load_gradients` every parameter's ``.grad`` is a view into
    :attr:`output` (no copy); the views are made once, with the buffer, so that a step dispatches
    nothing per parameter for them.
    """

    def __init__(self, index: int, names: List[str], params: List[torch.Tensor], name: Optional[str] = None,
                 kept_dense: bool = False) -> None:
        self.index = index
        self.names = names
        #: Whether the group holds parameters kept dense (``dense=``): dense at every step.
        self.kept_dense = kept_dense
        self.params = params
        self.name = name or (names[0] if len(names) == 1 else f"group{index}.{names[0]}")
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        #: Whether the host adds the gradients in place (:data:`ADD_IN_PLACE_FROM`; a benchmark may set it).
        self.adds_in_place = bool(params) and self.numel >= ADD_IN_PLACE_FROM * len(params)
        self.residual: Optional[torch.Tensor] = None
        #: Where this step's update is written: the group's own buffer, or a handed-over gradient.
        self.output: Optional[torch.Tensor] = None
        self._own_output: Optional[torch.Tensor] = None
        self._output_views: List[torch.Tensor] = []
        self._residual_views: List[torch.Tensor] = []
        self._negative_zero: Optional[torch.Tensor] = None

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        """Where the group's tensors live (its phases are timed there)."""
        return self.params[0].device

    @property
    def shapes(self) -> List[Tuple[int, ...]]:
        """The parameters' shapes, in flattening order."""
        return [tuple(p.shape) for p in self.params]

    @property
    def collective_name(self) -> str:
        """The name the group's collectives carry (its :attr:`name`)."""
        return self.name

    def _allocate(self) -> None:
        self.residual = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self._residual_views = []  # made by the first load that adds in place (DDP's buckets never do)

    def _owned_output(self) -> torch.Tensor:
        """The group's own update buffer (allocated, with its parameters' views, at the first
        call), made :attr:`output`."""
        if self._own_output is None:
            self._own_output = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            self._output_views = self.views(self._own_output)
        self.output = self._own_output
        return self._own_output

    def load_gradients(self, check: Callable[[Sequence[torch.Tensor]], Finite] = lambda tensors: True,
                       inv_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Add every parameter's gradient into the residual and return it: ``x = g + e`` (only
        ``e`` when the gradients are not finite).

        On the host, when every parameter has a gradient and the group :attr:`adds_in_place`, each
        is added into its slice of the residual where it lies: nothing is staged (no copy: five
        passes over the group's memory with the exchange's zeroing where staging takes seven),
        and ``check(gradients)`` says whether they are finite (a host bool) before anything is
        added. Elsewhere the gradients are first staged in :attr:`output` (which the exchange zeroes
        next: no allocation), copied into the parameters' layout views by one ``_foreach_copy_``
        for the group (nothing dispatched per parameter), none at all where the ``.grad`` tensors
        still are the views the last step published (a ``zero_grad`` that zeroes rather than drops
        them: backward wrote into the buffer itself), zeros for parameters without a gradient (one
        ``_foreach_zero_``); ``check([staged])`` then says whether they are finite: a
        bool, or a 0-dim bool tensor on the gradients' device (decided there, not read on the
        host), where False stages ``-0.0``, which leaves every element of ``e`` as it is, and
        one flat addition follows. Both give the same residual bitwise (the same addition per
        element). With ``inv_scale`` (a 0-dim tensor: the reciprocal of a loss scale) the
        gradients are unscaled as they are added, so the residual and what the method selects
        stay in the loss's own units.
        """
        if self.residual is None:
            self._allocate()
        assert self.residual is not None
        staged = self._owned_output()
        gradients = [p.grad for p in self.params]
        if self.adds_in_place and not on_accelerator(self.residual) and all(g is not None for g in gradients):
            if check(gradients):
                if not self._residual_views:
                    self._residual_views = self.views(self.residual)
                for view, gradient in zip(self._residual_views, gradients):
                    _add_into(view, gradient, inv_scale)
            return self.residual
        views = self._output_views
        copied = [(view, gradient) for view, gradient in zip(views, gradients)
                  if gradient is not None and gradient is not view]
        if copied:  # one operation for the group (a multi-tensor kernel on a GPU), not one per parameter
            torch._foreach_copy_([view for view, _ in copied], [gradient for _, gradient in copied])
        missing = [view for view, gradient in zip(views, gradients) if gradient is None]
        if missing:
            torch._foreach_zero_(missing)
        finite = check([staged])
        if finite is False:
            return self.residual
        if finite is not True:
            torch.where(finite, staged, self._nonfinite_fill(), out=staged)
        return _add_into(self.residual, staged, inv_scale)

    def load_flat(self, gradient: torch.Tensor, inv_scale: Optional[torch.Tensor] = None,
                  finite: Union[bool, torch.Tensor] = True, hand_over: bool = False) -> torch.Tensor:
        """Add the group's flat ``gradient`` into the residual and return it: ``x = g + e``
        (``finite`` and ``inv_scale`` as in :meth:`load_gradients`). With ``hand_over`` the
        gradient's memory becomes this step's :attr:`output`: the exchange zeroes it once the
        gradient is added and writes the update there (DDP's bucket, as DDP's own allreduce
        does), and the group keeps no update buffer of its own; else its own buffer is."""
        if self.residual is None:
            self._allocate()
        assert self.residual is not None
        if hand_over:
            self.output = gradient
        else:
            self._owned_output()
        if finite is False:
            return self.residual
        if finite is not True:
            gradient = torch.where(finite, gradient, self._nonfinite_fill(), out=self.output)
        return _add_into(self.residual, gradient, inv_scale)

    def _nonfinite_fill(self) -> torch.Tensor:
        """What a non-finite step stages: ``-0.0`` on the group's device and dtype, made once."""
        if self._negative_zero is None:
            assert self.residual is not None
            self._negative_zero = self.residual.new_full((), -0.0)
        return self._negative_zero

    def load_residual(self, residual: torch.Tensor) -> None:
        """Restore the residual from a checkpoint (copied into this group's own buffer)."""
        if residual.numel() != self.numel:
            raise ValueError(f"residual of group {self.name!r} has {residual.numel()} elements, "
                             f"expected {self.numel}")
        if self.residual is None:
            self._allocate()
        assert self.residual is not None
        self.residual.copy_(residual.reshape(-1))

    def zeroed_output(self) -> torch.Tensor:
        """The output buffer, zeroed, ready to receive the aggregated update."""
        assert self.output is not None
        return self.output.zero_()

    def take_result(self, update: torch.Tensor, residual: torch.Tensor) -> None:
        """Keep an exchange's ``(update, residual)`` as the group's output and residual (a copy
        only when the method returned other tensors than the group's own buffers)."""
        assert self.output is not None and self.residual is not None
        if update is not self.output:
            self.output.copy_(update)
        if residual is not self.residual:
            self.residual.copy_(residual)

    def scale_output(self, scale: torch.Tensor) -> None:
        """Multiply the output by ``scale`` (a loss scale the gradients were divided by), in place."""
        assert self.output is not None
        self.output.mul_(scale)

    def decay_residual(self, factor: float) -> None:
        """Multiply the residual by ``factor``, in place (error feedback with decay, MergeComp's
        ``residual_decay``)."""
        assert self.residual is not None
        self.residual.mul_(factor)

    def views(self, buffer: torch.Tensor) -> List[torch.Tensor]:
        """Every parameter's slice of the flat ``buffer``, in the parameter's layout
        (:func:`layout_view`)."""
        return [layout_view(chunk, p) for p, chunk in zip(self.params, buffer.split(self.numels))]

    def publish(self, scale: Optional[torch.Tensor] = None) -> None:
        """Make every parameter's ``.grad`` the matching view of the aggregated update, with the
        parameter's strides; with ``scale`` (a 0-dim tensor: the loss scale :meth:`load_gradients`
        divided out) the update is multiplied by it first, so a loss scaler's ``unscale_`` finds
        it in the units it expects."""
        assert self.output is not None
        if scale is not None:
            self.output.mul_(scale)
        for p, view in zip(self.params, self._output_views):
            p.grad = view


def carry_residuals(old: Sequence[FlatGroup], new: Sequence[FlatGroup]) -> None:
    """Give ``new`` groups the residuals ``old`` groups hold for the same parameters, so
    regrouping loses nothing. Groups whose parameters have no residual yet stay unallocated."""
    pieces: Dict[int, torch.Tensor] = {}
    for group in old:
        if group.residual is not None:
            for p, chunk in zip(group.params, group.residual.split(group.numels)):
                pieces[id(p)] = chunk
    for group in new:
        if any(id(p) in pieces for p in group.params):
            group.load_residual(torch.cat([pieces[id(p)] if id(p) in pieces else p.new_zeros(p.numel())
                                           for p in group.params]))
