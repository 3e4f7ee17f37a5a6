"""The NaN/Inf policy both front ends share: what a non-finite gradient on any rank does.

Each rank checks its own gradients before they can reach a residual, and the ranks agree (one
tiny collective) whether any of them saw a non-finite value. If one did, the step is abandoned
on every rank: no parameter update anywhere, so replicas stay identical, and residuals never
take a NaN. The policy then decides how the caller hears of it: ``"raise"`` (the default with a
sparsifier) raises ``FloatingPointError`` on every rank, ``"skip"`` warns and carries on; ``None``
(the default with Horovod's dense compressors) checks nothing, as Horovod itself does.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

from horovod_sparse.common.validation import check_choice

POLICIES = ("raise", "skip")


def resolve_nonfinite(nonfinite: Optional[str], sparse: bool, scaled: bool = False) -> Optional[str]:
    """The policy a wrapper runs with: ``"default"`` is ``"raise"`` with a sparsifier and None
    (no check) with a dense compression; anything else must be one of :data:`POLICIES` or None.
    A sparsifier under a loss scaler (``scaled``) refuses None: the scaler's overflow steps
    would put their Inf into the error-feedback residuals."""
    if nonfinite == "default":
        return "raise" if sparse else None
    if nonfinite is not None:
        check_choice("nonfinite", nonfinite, POLICIES)
    elif sparse and scaled:
        raise ValueError("nonfinite=None with loss_scaler: a loss scaler's overflow steps would put Inf into the "
                         "error-feedback residuals for good; keep the default ('raise': the scaler skips such "
                         "steps) or pass nonfinite='skip'")
    return nonfinite


def apply_nonfinite_policy(policy: str, bad_ranks: Sequence[int], step: int, groups: Sequence[str]) -> None:
    """Tell the caller that ``step`` was abandoned on every rank because ``bad_ranks`` saw a
    non-finite gradient (``groups``: this rank's affected groups): raise ``FloatingPointError``
    (``"raise"``) or warn with a ``RuntimeWarning`` (``"skip"``)."""
    message = (f"non-finite (NaN/Inf) gradient on rank(s) {list(bad_ranks)} at step {step}; "
               f"this rank's affected groups: {', '.join(groups) or '(on other ranks)'}. The step was "
               "abandoned on every rank: no update, replicas unchanged, finite gradients kept in the "
               "residuals.")
    if policy == "raise":
        raise FloatingPointError(message + " With mixed precision, let the loss scaler skip such steps: pass "
                                 "loss_scaler=<your GradScaler> (PyTorch) or <your LossScaleOptimizer> "
                                 "(TensorFlow's DistributedGradientTape; a Keras LossScaleOptimizer around the "
                                 "wrapper is found by itself). Otherwise lower the learning rate, or pass "
                                 "nonfinite='skip' to skip such steps with a warning.")
    warnings.warn(message, RuntimeWarning, stacklevel=2)
