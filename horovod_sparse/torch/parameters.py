"""The parameters of the Horovod optimizer: their names (with Horovod's checks), the ones whose
gradients are exchanged, their flat groups, and the hooks that report their gradients ready."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Collection, Dict, Iterable, List, Optional, Tuple

import torch

from horovod_sparse.common.grouping import ParamInfo, form_groups
from horovod_sparse.torch_core.buffers import FlatGroup

NamedParameters = Iterable[Tuple[str, torch.Tensor]]
#: The exchanged parameters with their names, in the optimizer's order (the same on every rank).
Ordered = List[Tuple[str, torch.Tensor]]


def parameter_names(param_groups: List[Dict[str, Any]],
                    named_parameters: Optional[NamedParameters]) -> Dict[torch.Tensor, str]:
    """Map every parameter to a name, with Horovod's checks (tuples, unique, complete)."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(sorted(dups))}")
    names = {p: name for name, p in named}
    unnamed = [p for group in param_groups for p in group["params"] if p not in names]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         f"not named ({len(unnamed)} of them).")
    return names


def exchanged_parameters(param_groups: List[Dict[str, Any]], names: Dict[torch.Tensor, str]) -> Ordered:
    """The parameters with a gradient to exchange, named, in the optimizer's order: integer and
    bool parameters, frozen ones and zero-size ones carry none."""
    return [(names[p], p) for group in param_groups for p in group["params"]
            if p.requires_grad and p.is_floating_point() and p.numel() > 0]


def flat_groups(ordered: Ordered, spec: Any, default: Any, kept_dense: Collection[str]) -> List[FlatGroup]:
    """The flat groups of ``ordered`` that ``spec`` asks for (the ``groups=`` argument of
    :func:`~horovod_sparse.common.grouping.form_groups`, whose explicit lists here hold tensors;
    ``default``: the grouping for None), the parameters named in ``kept_dense`` in groups of
    their own, marked ``kept_dense``. Raises ``ValueError`` for a list holding anything but tensors."""
    infos = [ParamInfo(name, p.numel(), f"{p.dtype}/{p.device}", p.element_size()) for name, p in ordered]
    kept = [i for i, (name, _) in enumerate(ordered) if name in kept_dense]
    if isinstance(spec, (list, tuple)):
        position = {id(p): i for i, (_, p) in enumerate(ordered)}
        for members in spec:
            for p in members:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
        spec = [[position[id(p)] for p in members if id(p) in position] for members in spec]
    return [FlatGroup(i, [ordered[j][0] for j in members], [ordered[j][1] for j in members],
                      kept_dense=ordered[members[0]][0] in kept_dense)
            for i, members in enumerate(form_groups(infos, spec, default, kept=kept))]


def hook_gradients(ordered: Ordered, method: Callable[[torch.Tensor], None]) -> None:
    """Call the bound ``method(p)`` whenever a gradient was accumulated into ``p.grad``, for every
    parameter of ``ordered``. Through a weak reference to ``method``'s object (a no-op once it is
    gone): a tensor's hooks are invisible to the garbage collector, so a bound method there would
    keep the optimizer and its flat buffers alive for good."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    for _, p in ordered:
        p.register_post_accumulate_grad_hook(hook)
