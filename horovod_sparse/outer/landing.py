"""An outer exchange that has ended (landed) but whose outer step is not taken yet.

Overlapped rounds end a fragment's exchange at the fragment's next round boundary (or earlier,
when a checkpoint is saved); the outer step it carries is taken at that boundary. A
:class:`Landed` holds what that needs: the fragment, its average pseudo-gradients (None: the
exchange was abandoned on every rank) and how to report an abandonment, saved with the
checkpoint so that a resumed job takes the same step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from horovod_sparse.common.nonfinite import apply_nonfinite_policy
from horovod_sparse.engine.step import StepOutcome


@dataclass
class Landed:
    """Fragment ``fragment``'s ended exchange: ``updates`` (one average per group of the fragment,
    flat; None when it was abandoned), and the ``bad_ranks`` that saw a non-finite
    pseudo-gradient, this rank's ``nonfinite_groups`` and the engine's ``step`` of the exchange
    (for the ``nonfinite`` policy's report)."""

    fragment: int
    updates: Optional[List[torch.Tensor]]
    bad_ranks: List[int]
    nonfinite_groups: List[str]
    step: int

    @classmethod
    def of(cls, fragment: int, updates: List[torch.Tensor], outcome: StepOutcome) -> "Landed":
        """What :meth:`~horovod_sparse.engine.step.StepEngine.end` said of the exchange of
        ``fragment`` that delivered ``updates``."""
        return cls(fragment, None if outcome.bad_ranks else updates, list(outcome.bad_ranks),
                   list(outcome.nonfinite_groups), outcome.stats.step)

    def report(self, policy: Optional[str]) -> None:
        """An abandoned exchange reported under the ``nonfinite`` policy (``"raise"`` raises
        ``FloatingPointError``, ``"skip"`` warns); nothing for a delivered one."""
        if self.bad_ranks:
            assert policy is not None, "an exchange is abandoned only under a nonfinite policy"
            apply_nonfinite_policy(policy, self.bad_ranks, self.step, self.nonfinite_groups)

    def record(self) -> Dict[str, Any]:
        """A checkpoint's entry (tensors and plain values)."""
        return {"fragment": self.fragment, "updates": self.updates, "bad_ranks": self.bad_ranks,
                "nonfinite_groups": self.nonfinite_groups, "step": self.step}

    @classmethod
    def from_record(cls, record: Optional[Dict[str, Any]],
                    devices: List[List[torch.device]]) -> Optional["Landed"]:
        """The :meth:`record` of a checkpoint (None: nothing had landed unapplied), each update on
        the device of its group (``devices[f]``: fragment ``f``'s groups')."""
        if record is None:
            return None
        updates = record["updates"]
        if updates is not None:
            updates = [u.to(device) for u, device in zip(updates, devices[int(record["fragment"])])]
        return cls(int(record["fragment"]), updates, list(record["bad_ranks"]), list(record["nonfinite_groups"]),
                   int(record["step"]))
