"""The outer steps' checkpoint: each rank's whole state (mid-round too) under a key of its own
(:mod:`horovod_sparse.distributed.rank_state`), for ``torch.save`` on every rank or
``torch.distributed.checkpoint``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from horovod_sparse.distributed.rank_state import rank_entry, state_of_this_rank
from horovod_sparse.outer.landing import Landed
from horovod_sparse.torch_core.buffers import FlatGroup
from horovod_sparse.torch_core.finiteness import StepFiniteness


class RoundCheckpoints:
    """``state_dict()`` and ``load_state_dict()`` of :class:`~horovod_sparse.outer.rounds.OuterSteps`
    (a base of it): they read and restore its model, inner and outer optimizers, anchor, groups,
    engine and model state, position, fragments, the exchange in flight and what landed of it,
    and its replicas' place in the job and layout in tiers."""

    def state_dict(self) -> Dict[str, bytes]:
        """This rank's state under a key of its own, ``{"rank<r>": bytes}``
        (:mod:`horovod_sparse.distributed.rank_state`): the model's state (mid-round each
        replica's own parameters), the inner and outer optimizers', the anchors, the round's
        position, the step counter, per group its residual and method state, and with ``overlap``
        the averages of the exchange in flight, which is ended first (collective then: every
        rank saves) and whose outer step stays for its boundary, and the tiers' node size (None:
        flat), which lays out the residuals and method states (in two tiers, per slice). ``torch.save`` it on every
        rank, or ``dcp.save({"outer": outer.state_dict()}, ...)``: that keeps every rank's."""
        return rank_entry(self._whole_state(), rank=self.replicas.job_rank, size=self.replicas.job_size)

    def _whole_state(self) -> Dict[str, Any]:
        """What :meth:`state_dict` keeps of this rank, for any job size: references to the live
        tensors, not copies (the exchange in flight ended first: collective then)."""
        self._land()
        return {"engine": self._state.record(self.groups, self.steps, per_rank=True),
                "landed": None if self._landed is None else self._landed.record(),
                "position": self.position, "every": self.every, "tiers": self.node_size_in_tiers(),
                "anchor": self.anchor.flat,
                "model": self.model.state_dict(), "inner": self.inner_optimizer.state_dict(),
                "outer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, bytes]) -> None:
        """Continue exactly from a :meth:`state_dict` this rank saved in a job of the same size
        and model (mid-round too, an overlapped exchange's outer step still to take). Collective:
        every rank loads (an exchange in flight here is ended and dropped), and the
        configuration is checked again. Raises ``ValueError`` naming the mismatch before anything is loaded when
        the state was saved by another job size, rank, model or ``every``, or in other tiers (two
        tiers of another node size, or flat, than these)."""
        saved = state_of_this_rank(state_dict, "the outer steps' state", rank=self.replicas.job_rank,
                                   size=self.replicas.job_size)
        if saved["every"] != self.every:
            raise ValueError(f"the outer steps' state was saved with every={saved['every']}, these take "
                             f"every={self.every}: build OuterSteps with the every= it was saved with")
        tiers, mine = saved.get("tiers"), self.node_size_in_tiers()
        if tiers != mine:
            raise ValueError(f"the outer steps' state was saved {_layout(tiers)}, these run {_layout(mine)}: in two "
                             f"tiers its residuals and method states are laid out by slice; build OuterSteps with "
                             f"{_arguments(tiers)} to resume it")
        problem = self._state.groups_mismatch({name: e["numel"] for name, e in saved["engine"]["groups"].items()},
                                              self.groups, decided=False)
        if problem:
            raise ValueError(problem)
        self._land()
        self._continue_from(saved)
        self._require_same_configuration()

    def _continue_from(self, saved: Dict[str, Any]) -> None:
        """Take this rank's :meth:`_whole_state` (of this model: unchecked), its tensors copied
        into the live ones or kept (the model's and optimizers' loading decides: give a copy
        when ``saved`` must stay as it is). Not collective: an exchange in flight, and what a
        failed one left half done (its flights, finiteness decisions, residuals), is dropped."""
        self._in_flight = None
        self._engine.flights = []
        self._finiteness = StepFiniteness(self._finiteness.checking)
        self.anchor.load(saved["anchor"])
        self.model.load_state_dict(saved["model"])
        self.inner_optimizer.load_state_dict(saved["inner"])
        self.outer_optimizer.load_state_dict(saved["outer"])
        for group in self.groups:
            group.residual = group.output = None
        self._state.states.clear()
        self._engine.restart_at(self._state.restore(saved["engine"], self.groups, no_regrouping))
        self.position = int(saved["position"])
        self._land_record(saved.get("landed"))

    def _land_record(self, record: Optional[Dict[str, Any]]) -> None:
        """Make :meth:`Landed.record` ``record`` (None: nothing) what landed, on the groups' devices."""
        devices = [[self.groups[i].params[0].device for i in indices] for indices in self.fragments]
        self._landed = Landed.from_record(record, devices)


def _layout(node_size: Optional[int]) -> str:
    return "flat" if node_size is None else f"in two tiers of {node_size} workers per node"


def _arguments(node_size: Optional[int]) -> str:
    return "hierarchical=False" if node_size is None else f"hierarchical=True, node_size={node_size}"


def no_regrouping(members: List[List[int]]) -> List[FlatGroup]:
    """The regrouping the engine's model state takes on a restore or an agreement: the outer
    steps' groups (one per parameter) never change, so it is never called."""
    raise AssertionError("the outer steps' groups never change")
