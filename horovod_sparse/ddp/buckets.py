"""DDP's buckets as horovod_sparse groups, stable across DDP's bucket rebuilds and checkpoints.

A group is identified by its *members*: the numbers of its parameters, each parameter numbered
by its position in the first bucket layout this process sees (DDP's first iteration puts every
parameter in one bucket, in an order the same model reproduces in any process). A bucket whose
members are a known group's, in the same order, is exchanged as that group (its buffer the
bucket's own); a bucket that is exactly a run of a loaded checkpoint's groups (the first
iteration after loading it, before DDP rebuilds its buckets) is exchanged as those groups, so
the method sees the grouping it was saved with; any other bucket (DDP's rebuild after its first,
dense step: other members, or the same in another order) becomes a new group, in bucket order,
that takes its parameters' residuals from the groups they were in (nothing is lost) and starts
its method state afresh. The parameters kept dense (``dense=``) of a bucket
are a group of their own, beside the group of its other parameters: DDP's buckets mix them.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from horovod_sparse.engine.model_state import ModelState, Record
from horovod_sparse.torch_core.buffers import FlatGroup, carry_residuals

#: A group's identity: the numbers of its parameters, in bucket order.
Members = Tuple[int, ...]


class BucketGroups:
    """The groups of one DDP model, found from its buckets.

    Args:
        model: the front end's :class:`ModelState` (method state per group index).
    """

    def __init__(self, model: ModelState) -> None:
        self.model = model
        self._numbers: Dict[torch.Tensor, int] = {}
        self._groups: Dict[Members, FlatGroup] = {}
        #: Bucket index -> its parameters, the groups it was exchanged as and their members
        #: (the fast path).
        self._buckets: Dict[int, Tuple[List[torch.Tensor], List[FlatGroup], List[Members]]] = {}
        self._used: Set[Members] = set()
        self._next_index = 0
        #: What a loaded checkpoint holds and no bucket has taken yet: residual pieces by
        #: parameter number, method states and the groups it was saved with, by members.
        self._saved_pieces: Dict[int, torch.Tensor] = {}
        self._saved_states: Dict[Members, Tuple[int, Any]] = {}
        self._saved_groups: Set[Members] = set()
        #: The parameters kept dense (``dense=``, set by the hook's state when it knows the model).
        self.kept_dense: Set[torch.Tensor] = set()

    @property
    def groups(self) -> List[FlatGroup]:
        """The groups, in order of their first parameter."""
        return [self._groups[key] for key in sorted(self._groups)]

    def of_bucket(self, index: int, params: List[torch.Tensor]) -> List[FlatGroup]:
        """The groups bucket ``index`` (its ``params``, in bucket order) is exchanged as (see
        :func:`split` and :func:`join`)."""
        known = self._buckets.get(index)
        if known is not None and len(known[0]) == len(params) and all(a is b for a, b in zip(known[0], params)):
            _, known_groups, known_keys = known
            if all(self._groups.get(key) is g for key, g in zip(known_keys, known_groups)):
                self._used.update(known_keys)
                return known_groups
        for p in params:
            self._numbers.setdefault(p, len(self._numbers))
        members = tuple(self._numbers[p] for p in params)
        by_number = dict(zip(members, params))
        keys = self._cover(members, by_number) or self._split_kept_dense(members, by_number)
        groups = [self._group(key, [by_number[n] for n in key]) for key in keys]
        self._buckets[index] = (list(params), groups, keys)
        self._used.update(keys)
        return groups

    def end_step(self) -> None:
        """Forget the groups no bucket used this step (DDP rebuilt its buckets: their residuals
        went to the new groups)."""
        for key in [key for key in self._groups if key not in self._used]:
            self.model.states.pop(self._groups.pop(key).index, None)
        self._used.clear()

    @staticmethod
    def _members(group: FlatGroup) -> Members:
        return tuple(int(name) for name in group.names)

    def _cover(self, members: Members, by_number: Dict[int, torch.Tensor]) -> Optional[List[Members]]:
        """The saved groups (a loaded checkpoint's, not yet taken) whose members together are
        exactly ``members``, in the order the bucket reaches them; None if there are no such
        groups, or if one of them mixes parameters kept dense with others (a checkpoint saved
        with another ``dense=``). Live groups cover nothing: a bucket that is not exactly one of
        them (DDP rebuilt its buckets: other members, or the same in another order) becomes a
        group of its own, in bucket order, so that its buffer is the bucket's, no parameter
        copied in or out (:func:`split`)."""
        owner = {n: key for key in self._saved_groups for n in key}
        keys = list(dict.fromkeys(owner.get(n) for n in members))
        if None in keys or sum(len(key) for key in keys) != len(members):
            return None
        if any(len({by_number[n] in self.kept_dense for n in key}) > 1 for key in keys):
            return None
        return keys

    def _split_kept_dense(self, members: Members, by_number: Dict[int, torch.Tensor]) -> List[Members]:
        """A new bucket's groups: its parameters, those kept dense apart (each in bucket order)."""
        kept = tuple(n for n in members if by_number[n] in self.kept_dense)
        others = tuple(n for n in members if by_number[n] not in self.kept_dense)
        return [key for key in (others, kept) if key]

    def _group(self, key: Members, params: Sequence[torch.Tensor]) -> FlatGroup:
        """The group of ``key``: the live one, or a new one with its parameters' residuals (from
        the live groups and the checkpoint) and the checkpoint's method state for ``key``."""
        group = self._groups.get(key)
        if group is not None:
            return group
        group = FlatGroup(self._next_index, [str(n) for n in key], list(params), name=f"params{key[0]}-{key[-1]}",
                          kept_dense=params[0] in self.kept_dense)
        self._next_index += 1
        carry_residuals(list(self._groups.values()), [group])
        if any(n in self._saved_pieces for n in key):
            if group.residual is None:
                group.load_residual(torch.zeros(group.numel, dtype=group.dtype, device=params[0].device))
            assert group.residual is not None
            for n, chunk in zip(key, group.residual.split(group.numels)):
                saved = self._saved_pieces.pop(n, None)
                if saved is not None:
                    if saved.numel() != chunk.numel():
                        raise ValueError(f"checkpoint does not match the model: its parameter {n} has "
                                         f"{saved.numel()} elements, the model's {chunk.numel()}; load the "
                                         "state saved with this model and DDP configuration")
                    chunk.copy_(saved.reshape(-1))
        if key in self._saved_states:
            self.model.states[group.index] = self._saved_states.pop(key)
        self._saved_groups.discard(key)
        self._groups[key] = group
        return group

    # -- checkpoints ------------------------------------------------------------------------------
    def record(self, steps: int) -> Record:
        """:meth:`ModelState.record` of the groups, with each group's members and their sizes
        (``members``: group name -> ``[[number, elements], ...]``)."""
        groups = self.groups
        record = self.model.record(groups, steps, per_rank=True)
        record["members"] = {g.name: [[n, p.numel()] for n, p in zip(self._members(g), g.params)] for g in groups}
        return record

    def load(self, record: Record) -> None:
        """Replace the groups' residuals and method states with ``record``'s, taken as buckets
        come (the live groups are dropped)."""
        self._saved_pieces, self._saved_states, self._saved_groups = {}, {}, set()
        for name, entry in record["groups"].items():
            members = record["members"][name]
            key = tuple(int(n) for n, _ in members)
            self._saved_groups.add(key)
            if entry.get("residual") is not None:
                chunks = entry["residual"].reshape(-1).split([int(numel) for _, numel in members])
                self._saved_pieces.update((n, chunk.clone()) for n, chunk in zip(key, chunks))
            if entry.get("state") is not None:
                self._saved_states[key] = self.model.states.from_record(entry["state"], entry["numel"])
        self._groups.clear()
        self._buckets.clear()
        self.model.states.clear()


def _is_bucket(groups: Sequence[FlatGroup], params: Sequence[torch.Tensor]) -> bool:
    """Whether ``groups`` is one group with exactly the bucket's ``params``, in bucket order."""
    return len(groups) == 1 and len(groups[0].params) == len(params) and all(
        a is b for a, b in zip(groups[0].params, params))


def _offsets(params: Sequence[torch.Tensor]) -> Dict[torch.Tensor, Tuple[int, int]]:
    starts = [0, *itertools.accumulate(p.numel() for p in params)]
    return {p: (start, start + p.numel()) for p, start in zip(params, starts)}


def split(buffer: torch.Tensor, params: Sequence[torch.Tensor], groups: Sequence[FlatGroup]) -> List[torch.Tensor]:
    """Each group's flat gradient from the bucket's flat ``buffer`` (of ``params``, in bucket
    order): the buffer itself for a group that is the bucket, else a copy in the group's order."""
    if _is_bucket(groups, params):
        return [buffer]
    at = _offsets(params)
    return [torch.cat([buffer[at[p][0]:at[p][1]] for p in group.params]) for group in groups]


def join(updates: Sequence[torch.Tensor], params: Sequence[torch.Tensor], groups: Sequence[FlatGroup]) -> torch.Tensor:
    """The bucket's aggregated flat gradient from each group's (the inverse of :func:`split`)."""
    if _is_bucket(groups, params):
        return updates[0]
    at = _offsets(params)
    result = updates[0].new_empty(sum(p.numel() for p in params))
    for group, update in zip(groups, updates):
        for p, chunk in zip(group.params, update.split(group.numels)):
            result[at[p][0]:at[p][1]] = chunk
    return result
