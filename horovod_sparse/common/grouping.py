"""How parameters are grouped into flat buffers: per tensor, whole model, N groups, explicit lists.

Grouping is an axis of its own, independent of what is selected: every sparsifier works on
whatever groups this module forms. Groups are contiguous runs of the parameter order, which is
the same on every rank, and never mix dtypes or devices (a flat buffer has one of each).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Union

from horovod_sparse.common.validation import check_int

#: Named strategies accepted by ``groups=`` besides an int or explicit lists.
STRATEGIES = ("tensor", "model")


@dataclass(frozen=True)
class ParamInfo:
    """What grouping needs to know of a parameter: its name, size and buffer kind
    (dtype and device, as a string; parameters of different kinds never share a group)."""

    name: str
    numel: int
    kind: str


GroupSpec = Union[None, int, str, Sequence[Sequence[int]]]


def split_evenly(items: Sequence[int], parts: int) -> List[List[int]]:
    """Split ``items`` into ``parts`` contiguous runs whose lengths differ by at most one, the
    longer first (Horovod's ``split_list`` semantics); empty runs are dropped."""
    size, extra = divmod(len(items), parts)
    runs = [list(items[i * size + min(i, extra):(i + 1) * size + min(i + 1, extra)]) for i in range(parts)]
    return [r for r in runs if r]


def split_by_kind(indices: Sequence[int], params: Sequence[ParamInfo]) -> List[List[int]]:
    """Split a run of parameter indices wherever the buffer kind changes."""
    runs: List[List[int]] = []
    for i in indices:
        if runs and params[runs[-1][-1]].kind == params[i].kind:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def form_groups(params: Sequence[ParamInfo], spec: GroupSpec, default: str = "tensor") -> List[List[int]]:
    """Partition parameter indices ``0..len(params)-1`` into groups.

    Args:
        params: parameters in the order gradients are flattened (identical on every rank).
        spec: ``None`` (use ``default``), ``"tensor"`` (one group per parameter), ``"model"``
            (one group per buffer kind), an int ``N > 0`` (Horovod's ``groups=N``: N contiguous
            groups of nearly equal parameter count), or explicit lists of indices (parameters in
            no list form a group each, as in Horovod).
        default: the strategy used for ``None``; each method names its natural one.

    Returns:
        Groups as lists of indices in parameter order; each group has one buffer kind.
    """
    order = list(range(len(params)))
    if spec is None:
        spec = default
    if isinstance(spec, str):
        if spec not in STRATEGIES:
            raise ValueError(f"groups must be an int > 0, lists of parameters, or one of "
                             f"{', '.join(map(repr, STRATEGIES))}; got {spec!r}")
        runs = [[i] for i in order] if spec == "tensor" else [order]
    elif isinstance(spec, int) and not isinstance(spec, bool):
        runs = split_evenly(order, check_int("groups", spec, minimum=1))
    elif isinstance(spec, (list, tuple)):
        runs = _explicit_groups(spec, len(params))
    else:
        raise TypeError(f"groups must be None, an int, a strategy name or lists of parameters, "
                        f"got {type(spec).__name__}")
    return [g for run in runs for g in split_by_kind(run, params)]


def _explicit_groups(lists: Sequence[Sequence[int]], count: int) -> List[List[int]]:
    seen: set = set()
    groups: List[List[int]] = []
    for members in lists:
        group = []
        for i in members:
            if i in seen:
                raise ValueError("a parameter can only appear once in groups")
            seen.add(i)
            group.append(i)
        if group:
            groups.append(sorted(group))
    groups.extend([i] for i in range(count) if i not in seen)
    return groups
