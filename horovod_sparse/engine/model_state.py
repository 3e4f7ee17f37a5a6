"""What every front end keeps of one model between steps, written once for all of them.

The PyTorch optimizer holds one :class:`ModelState`; the TensorFlow exchanger one per variable
list. Beside the residuals (kept in each framework's ``FlatGroup``), it holds each group's
method state (:class:`~horovod_sparse.engine.method_states.MethodStates`) and the MergeComp
scheduler; it writes and reads the checkpoint record (step counter, MergeComp's grouping, the method's own
state, per group the residual and method state), checks a record's groups against the model's,
agrees the shared state from one rank (in two tiers, each slice's state within its cross set),
builds the configuration every rank must share, and closes a step (the method's measurements,
MergeComp's decay and regrouping).

A group is either framework's ``FlatGroup``: ``index``, ``name``, ``numel``, ``residual`` (None
before its first sparse step) and ``load_residual(saved)``, where ``saved`` is the backend's
checkpoint form of a tensor (``Backend.saved``: a tensor for PyTorch, a NumPy array for
TensorFlow). The step counter's storage is the front end's (a Python int in PyTorch, an int64
variable in TensorFlow, read inside traced steps); its value travels in the record.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from horovod_sparse.common.consensus import require_same_configuration, state_of_rank
from horovod_sparse.common.grouping import StepTimeline
from horovod_sparse.common.mergecomp_scheduler import MergeCompScheduler
from horovod_sparse.common.tiers import Tiers
from horovod_sparse.engine.method_states import MethodStates
from horovod_sparse.methods.backend import Backend
from horovod_sparse.methods.base import Sparsifier

#: A record of :meth:`ModelState.record`: plain containers and checkpoint-form tensors.
Record = Dict[str, Any]


class Group(Protocol):
    """What this module reads of a framework's ``FlatGroup``."""

    index: int
    name: str
    numel: int
    residual: Any

    def load_residual(self, saved: Any) -> None: ...

    def decay_residual(self, factor: float) -> None: ...


#: Switches the model to new groups (lists of positions in the parameter order), carrying the
#: residuals over, and returns the new groups.
Regroup = Callable[[List[List[int]]], Sequence[Group]]


class ModelState:
    """One model's sparsification state beside its residuals.

    Args:
        compression: a horovod_sparse sparsifier, or Horovod's dense compressor (then no group
            has method state and no method measures anything).
        backend: the framework's backend (checkpoint form of tensors, the bytes allgather).
        process_set: the Horovod process set of the front end.
        mergecomp: the scheduler choosing the groups (``groups="mergecomp"``), else None.
    """

    def __init__(self, compression: Any, backend: Backend, process_set: Any,
                 mergecomp: Optional[MergeCompScheduler]) -> None:
        self.compression = compression
        self.sparse = isinstance(compression, Sparsifier)
        self.B = backend
        self.process_set = process_set
        self.mergecomp = mergecomp
        #: Where the method runs when that is not ``process_set`` (a two-tier front end's cross
        #: set: its state is agreed and its measurements are taken there), else None; and the
        #: rank there that stands for a root rank of ``process_set`` (:meth:`use_tiers`).
        self.method_set: Any = None
        self.method_root: Optional[Callable[[int], int]] = None
        #: Each group's method state (the elements of this rank's slice in a two-tier exchange).
        self.states = MethodStates(compression, backend)

    def use_tiers(self, tiers: Tiers) -> None:
        """Run the method over ``tiers``' cross set from now on (a two-tier front end)."""
        self.method_set, self.method_root = tiers.cross_set, tiers.cross_root

    # -- checkpoints and agreement --------------------------------------------------------------
    def record(self, groups: Sequence[Group], steps: int, per_rank: bool) -> Record:
        """The step counter, MergeComp's grouping, the method's own state (LAGS's measurements)
        and, per group, its size and method state; with ``per_rank`` also what differs between
        ranks (residuals, and the state of methods whose state is per rank), else only what
        every rank holds alike. Plain containers (``torch.load(weights_only=True)`` reads them)."""
        per_rank_state = self.sparse and self.compression.per_rank_state
        records = {}
        for g in groups:
            entry: Dict[str, Any] = {"numel": g.numel}
            if per_rank:
                entry["residual"] = None if g.residual is None else self.B.saved(g.residual)
            if per_rank or not per_rank_state:
                entry["state"] = self.states.record(g.index)
            records[g.name] = entry
        return {"steps": steps, "groups": records,
                "method": self.compression.method_state(per_rank) if self.sparse else None,
                "mergecomp": None if self.mergecomp is None or self.mergecomp.result is None
                else self.mergecomp.result.as_dict()}

    def load_method(self, record: Record) -> None:
        """Take the method's own state (LAGS's measurements) from ``record`` (:meth:`record`'s
        ``method``), when it holds one."""
        if self.sparse and record.get("method") is not None:
            self.compression.load_method_state(record["method"])

    def restore(self, record: Record, groups: Sequence[Group], regroup: Regroup) -> int:
        """Take a :meth:`record` made here or on another rank: what it holds replaces this
        rank's, what it leaves out (residuals, per-rank state) stays. MergeComp's grouping is
        taken first; a record of other groups raises ``ValueError`` (:func:`groups_mismatch`)
        before anything is loaded. Returns the step counter."""
        if self.mergecomp is not None and record.get("mergecomp") is not None:
            groups = regroup(self.mergecomp.restore(record["mergecomp"]))
        problem = self.groups_mismatch({name: entry["numel"] for name, entry in record["groups"].items()},
                                       groups, decided=record.get("mergecomp") is not None)
        if problem:
            raise ValueError(problem)
        self.load_method(record)
        for group in groups:
            entry = record["groups"][group.name]
            if entry.get("residual") is not None:
                group.load_residual(entry["residual"])
            if "state" not in entry:
                continue
            if entry["state"] is None:
                self.states.pop(group.index, None)
            else:
                self.states[group.index] = self.states.from_record(entry["state"], group.numel)
        return int(record["steps"])

    def groups_mismatch(self, saved: Dict[str, int], groups: Sequence[Group], decided: bool) -> str:
        """What differs between a record's groups (name -> elements) and ``groups``, with the
        fix; empty when they match."""
        mine = {g.name: g.numel for g in groups}
        if saved == mine:
            return ""
        only_saved = {name: numel for name, numel in saved.items() if mine.get(name) != numel}
        only_mine = {name: numel for name, numel in mine.items() if saved.get(name) != numel}
        hint = ("; a MergeComp model must be saved after its search decided (.mergecomp.result set)"
                if self.mergecomp is not None and not decided else "")
        return (f"checkpoint does not match the model's groups (name: elements): the checkpoint has "
                f"{only_saved}, the model {only_mine} instead; build the optimizer (or tape) with the "
                f"model and groups= the checkpoint was saved with{hint}")

    def agree(self, root_rank: int, groups: Sequence[Group], steps: int, regroup: Regroup) -> int:
        """Every rank of the process set takes ``root_rank``'s shared :meth:`record` (step
        counter, MergeComp grouping, method state every rank holds alike); residuals and
        per-rank state stay each rank's own. With a ``method_set``, the groups' method states
        are agreed there instead, from the rank standing for ``root_rank`` (each cross set
        exchanges its own slices). Returns the step counter. Collective."""
        mine = self.record(groups, steps, per_rank=False) if self.process_set.rank() == root_rank else None
        if mine is not None and self.method_set is not None:
            mine["groups"] = {name: {"numel": entry["numel"]} for name, entry in mine["groups"].items()}
        shared = state_of_rank(root_rank, mine, self._allgather_bytes())
        if self.process_set.rank() != root_rank:
            steps = self.restore(shared, groups, regroup)
        if self.method_set is None:
            return steps
        assert self.method_root is not None
        method_root = self.method_root(root_rank)
        mine = self.record(groups, steps, per_rank=False) if self.method_set.rank() == method_root else None
        shared = state_of_rank(method_root, mine, functools.partial(self.B.allgather_bytes,
                                                                    process_set=self.method_set))
        return steps if self.method_set.rank() == method_root else self.restore(shared, groups, regroup)

    def require_same_configuration(self, settings: Dict[str, Any],
                                   groups: Sequence[Tuple[str, int, str, List[List[int]]]]) -> None:
        """Every rank raises the same ``ValueError`` naming what differs unless all have the
        same configuration: the compression (method and options, or the dense compressor's
        name), the front end's ``settings`` (op, ``nonfinite``, ...), each group's key, size,
        dtype and member shapes (same sizes are not enough: a sparse group is flat, so another
        shape of as many elements would mix up coordinates), and MergeComp's options. Collective."""
        compression = (self.compression.options.as_dict() if self.sparse
                       else getattr(self.compression, "__name__", type(self.compression).__name__))
        config = {"compression": compression, **settings,
                  "groups": {key: f"{numel} x {dtype}" for key, numel, dtype, _ in groups},
                  "shapes": {key: shapes for key, _, _, shapes in groups},
                  "mergecomp": None if self.mergecomp is None else repr(self.mergecomp.options)}
        require_same_configuration(config, self._allgather_bytes())

    def _allgather_bytes(self) -> Callable[[bytes, str], List[bytes]]:
        return functools.partial(self.B.allgather_bytes, process_set=self.process_set)

    # -- the end of a step ------------------------------------------------------------------------
    def end_step(self, timeline: StepTimeline, groups: Sequence[Group] = (),
                 regroup: Optional[Regroup] = None) -> None:
        """Close a step on every rank, after its collectives and outside the backward hooks:
        hand its ``timeline`` to the method (LAGS measures here) and to MergeComp, apply
        MergeComp's ``residual_decay`` to ``groups`` (``group.decay_residual``) and switch groups
        when MergeComp says so (``groups`` and ``regroup`` are needed with MergeComp only)."""
        if self.sparse:
            self.compression.on_step_end(self.process_set if self.method_set is None else self.method_set, timeline)
        if self.mergecomp is None:
            return
        assert regroup is not None, "MergeComp regroups through the front end"
        factor = self.mergecomp.options.residual_decay
        for group in groups if factor != 1.0 else []:
            if group.residual is not None:
                group.decay_residual(factor)
        members = self.mergecomp.after_step(timeline)
        if members is not None:
            regroup(members)
