"""A group's loading of its gradients into the residual (``FlatGroup.load_gradients``): on the
host a group of large parameters adds each gradient where it lies, nothing staged, bitwise what
the staged path gives and what an independent reference gives, in every parameter layout."""
from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from horovod_sparse.torch_core.buffers import ADD_IN_PLACE_FROM, FlatGroup

SENTINEL = 7.0


def _parameters() -> List[torch.nn.Parameter]:
    """A contiguous matrix, a transposed one, a ``channels_last`` kernel and a bias."""
    return [torch.nn.Parameter(torch.zeros(3, 4)),
            torch.nn.Parameter(torch.zeros(4, 3).t()),
            torch.nn.Parameter(torch.zeros(2, 3, 2, 2).to(memory_format=torch.channels_last)),
            torch.nn.Parameter(torch.zeros(5))]


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in the order they lie in memory (its dimensions by falling stride)."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(*order).reshape(-1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bits, so that a comparison tells -0.0 from +0.0."""
    return t.contiguous().view(torch.int32)


def _group(seed: int, in_place: bool = True) -> FlatGroup:
    """A group of :func:`_parameters` that adds its gradients in place or not (``in_place``)
    with a random residual, a sentinel output and random gradients in each parameter's layout
    (zeros of both signs among them)."""
    params = _parameters()
    generator = torch.Generator().manual_seed(seed)
    group = FlatGroup(0, [f"p{i}" for i in range(len(params))], params)
    group.adds_in_place = in_place
    group.load_residual(torch.randn(group.numel, generator=generator))
    group.load_gradients(lambda tensors: False)  # makes the output buffer, adds nothing
    assert group.output is not None
    group.output.fill_(SENTINEL)
    for p in params:
        values = torch.randn(p.shape, generator=generator)
        values[values.abs() < 0.3] = -0.0
        p.grad = torch.empty_like(p).copy_(values)
    return group


def _reference(group: FlatGroup, residual: torch.Tensor, inv_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``e + g`` (``e + g * inv_scale``) element by element, each gradient read in its
    parameter's memory order."""
    chunks = []
    for p, chunk in zip(group.params, residual.split(group.numels)):
        g = _memory_order(p.grad)
        chunks.append(chunk + g if inv_scale is None else chunk + g * inv_scale)
    return torch.cat(chunks)


@pytest.mark.parametrize("inv_scale", [None, torch.tensor(0.125)])
def test_host_adds_every_gradient_where_it_lies(inv_scale):
    """On the host the residual becomes ``e + g`` bitwise, the check sees the gradients
    themselves, and nothing is staged in the output; the staged path gives the same bits."""
    group, staged = _group(0), _group(0, in_place=False)
    before = group.residual.clone()
    seen = []
    x = group.load_gradients(lambda tensors: seen.append(tensors) or True, inv_scale)
    assert x is group.residual
    assert torch.equal(_bits(x), _bits(_reference(group, before, inv_scale)))
    assert len(seen) == 1 and all(t is p.grad for t, p in zip(seen[0], group.params))
    assert bool((group.output == SENTINEL).all()), "the host staged the gradients"
    staged_x = staged.load_gradients(lambda tensors: True, inv_scale)
    assert torch.equal(_bits(staged_x), _bits(x))
    assert not bool((staged.output == SENTINEL).any())


def test_host_leaves_the_residual_when_the_gradients_are_not_finite():
    """A check that says False leaves every bit of the residual as it was."""
    group = _group(1)
    group.params[2].grad[0, 1, 0, 0] = float("nan")
    before = group.residual.clone()
    x = group.load_gradients(lambda tensors: False)
    assert torch.equal(_bits(x), _bits(before))


def test_a_parameter_without_gradient_adds_zeros():
    """A parameter with no gradient contributes zeros (the group is staged then: its output
    holds them), the others their gradients."""
    group = _group(2)
    group.params[1].grad = None
    before = group.residual.clone()
    x = group.load_gradients()
    expected = list(before.split(group.numels))
    for i, p in enumerate(group.params):
        if p.grad is not None:
            expected[i] = expected[i] + _memory_order(p.grad)
    assert torch.equal(x, torch.cat(expected))


def test_groups_of_large_parameters_add_in_place():
    """A group adds in place from :data:`ADD_IN_PLACE_FROM` elements per parameter on average."""
    def group(*numels: int) -> FlatGroup:
        return FlatGroup(0, [str(n) for n in numels], [torch.nn.Parameter(torch.zeros(n)) for n in numels])
    assert group(ADD_IN_PLACE_FROM + 1, ADD_IN_PLACE_FROM - 1).adds_in_place
    assert not group(ADD_IN_PLACE_FROM, ADD_IN_PLACE_FROM - 1).adds_in_place
