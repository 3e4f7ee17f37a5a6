"""A step the Horovod optimizer abandoned for a non-finite gradient on some rank.

``synchronize()`` makes every aggregate of the step NaN (:func:`nan_aggregates`), so that
whatever reads them before ``step()`` (a loss scaler's ``unscale_``, a gradient clipper) sees a
non-finite step, as after Horovod's allreduce of an overflow; ``step()`` then meets the step
(:meth:`AbandonedStep.skips_update`) and applies the ``nonfinite`` policy, unless a loss scaler
skipped the step.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, List, Optional, Sequence, Tuple

from horovod_sparse.common.nonfinite import apply_nonfinite_policy


def nan_aggregates(flights: Sequence[Any]) -> None:
    """Make the aggregate of every one of an abandoned step's ``flights`` NaN: a sparse group's
    output buffer, a dense group's gradients."""
    for flight in flights:
        if flight.sparse:
            flight.group.zeroed_output().fill_(math.nan)
        else:
            for p in flight.group.params:
                p.grad.fill_(math.nan)


class AbandonedStep:
    """The last step ``synchronize()`` abandoned, until ``step()`` meets it.

    Args:
        policy: the optimizer's ``nonfinite`` policy.
        scaled: whether the optimizer was given a loss scaler (``loss_scaler=``).
    """

    def __init__(self, policy: Optional[str], scaled: bool) -> None:
        self._policy = policy
        self._scaled = scaled
        #: ``(bad ranks, step, this rank's groups)`` of the abandoned step (None: there is none).
        self._pending: Optional[Tuple[List[int], int, List[str]]] = None
        #: Whether the warning of :meth:`warn_if_skipped` was given.
        self._warned = False

    def note(self, bad_ranks: List[int], step: int, groups: List[str]) -> None:
        """``step`` was abandoned because ``bad_ranks`` saw a non-finite gradient (in ``groups``
        on this rank)."""
        self._pending = (bad_ranks, step, groups)

    def forget(self) -> None:
        """Drop the abandoned step unmet (a checkpoint was loaded)."""
        self._pending = None

    def warn_if_skipped(self) -> None:
        """Called as the next step synchronizes: an abandoned step that ``step()`` never met was
        skipped by a loss scaler (one that found the NaN aggregate, as ``GradScaler.step`` does).
        Without ``loss_scaler=`` the residuals then hold gradients in the units of whatever scale
        each step had, so say once how to keep them in the loss's own units. Forgets the step."""
        if self._pending is not None and not self._scaled and not self._warned:
            self._warned = True
            warnings.warn("a step abandoned for a non-finite gradient was never applied: if a loss scaler "
                          "(torch.amp.GradScaler) skipped it, pass loss_scaler=scaler to DistributedOptimizer, "
                          "so that error feedback keeps its residuals in unscaled units when the scale changes",
                          RuntimeWarning, stacklevel=3)
        self._pending = None

    def skips_update(self, kernel_skips: bool) -> bool:
        """``step()`` meets the last step: whether it must skip the update, the step having been
        abandoned, after applying the policy (which raises ``FloatingPointError``, or warns).
        Unless ``kernel_skips``: a ``GradScaler`` stepping a fused optimizer calls ``step()`` on
        an overflow too, and the optimizer's kernel skips the update itself. Forgets the step."""
        abandoned, self._pending = self._pending, None
        if abandoned is None or kernel_skips:
            return False
        assert self._policy is not None
        apply_nonfinite_policy(self._policy, *abandoned)  # raises, or warns
        return True
