"""A stalled exchange becomes an error, not a silent wait.

Inside one group's exchange every rank of a process set issues the same collectives in the same
order; a rank that takes a round the others do not take (or skips one) leaves them all waiting
for a collective that never comes. Horovod's stall inspector only warns about that (after
``HOROVOD_STALL_CHECK_TIME_SECONDS``, 60 by default), and the job waits for ever.

The PyTorch front ends wait for their collectives with a deadline once a group's exchange is under
way on a process set: after the first collective of the group's step on that set has completed
(every rank of the set had joined the exchange then), a later one that takes longer than Horovod's
stall-check time raises :class:`ExchangeStalled` on every rank left waiting, naming the group, the
step, the collective and the set's ranks. The first collective of a group's step waits without a
deadline: that is where a rank that is merely late arrives (an evaluation or a checkpoint on one
rank between steps), which Horovod, too, only warns about.

``HOROVOD_STALL_CHECK_TIME_SECONDS`` sets the time, ``HOROVOD_STALL_CHECK_DISABLE=1`` turns the
check off (both Horovod's own variables, honoured by every PyTorch front end, the DDP hook and
FSDP2 included). Where Horovod runs its collectives on Gloo, the time is at most half of Gloo's
own timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``, 30 s by default): a Gloo operation that waits
longer aborts every rank from Horovod's background thread (``gloo::IoException``, SIGABRT), where
no Python error can be raised, so the stall check has to speak first.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

#: Horovod's variables: the stall-check time in seconds, and the switch that disables the check.
TIME_ENV = "HOROVOD_STALL_CHECK_TIME_SECONDS"
DISABLE_ENV = "HOROVOD_STALL_CHECK_DISABLE"
#: Horovod's default stall-check time.
DEFAULT_SECONDS = 60.0
#: Horovod's variable for Gloo's timeout of one operation, in seconds, and its default.
GLOO_TIMEOUT_ENV = "HOROVOD_GLOO_TIMEOUT_SECONDS"
GLOO_DEFAULT_SECONDS = 30.0


def stall_seconds(gloo: bool = False) -> Optional[float]:
    """Seconds a collective inside an exchange may take before the exchange counts as stalled
    (Horovod's stall-check time; with ``gloo``, where Horovod runs on Gloo, at most half of Gloo's
    timeout: the module docstring), or None when the check is disabled."""
    seconds = _check_time()
    if seconds is None or not gloo:
        return seconds
    text = os.environ.get(GLOO_TIMEOUT_ENV, "").strip()
    try:
        gloo_seconds = float(text) if text else GLOO_DEFAULT_SECONDS
    except ValueError:
        raise ValueError(f"{GLOO_TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    if gloo_seconds <= 0:
        raise ValueError(f"{GLOO_TIMEOUT_ENV}={text!r} must be positive: Gloo's timeout of one operation")
    return min(seconds, gloo_seconds / 2)


def _check_time() -> Optional[float]:
    """Horovod's stall-check time in seconds, None when the check is disabled."""
    if os.environ.get(DISABLE_ENV, "0").strip().lower() in ("1", "true"):
        return None
    text = os.environ.get(TIME_ENV, "").strip()
    if not text:
        return DEFAULT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{TIME_ENV}={text!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{TIME_ENV}={text!r} must be positive (set {DISABLE_ENV}=1 to turn the check off)")
    return seconds


class ExchangeStalled(RuntimeError):
    """A collective inside a group's exchange did not complete within the stall-check time: a rank
    of its process set issued another collective, or none (see the module docstring). The step
    is abandoned half way; the job should stop and resume from a checkpoint."""

    def __init__(self, group: str, step: Optional[int], rank: int, ranks: Sequence[int], collective: str,
                 seconds: float) -> None:
        self.group, self.step, self.rank, self.ranks, self.collective = group, step, rank, list(ranks), collective
        super().__init__(
            f"the exchange of group {group!r} stalled at step {step}: rank {rank} waited {seconds:g} s for the "
            f"collective {collective!r} among ranks {list(ranks)}, after every one of them had joined the group's "
            "exchange, so some rank of them issued another collective or none: the ranks disagree on which "
            "collective comes next (a round taken by some ranks only), or one of them stopped. The step is "
            f"abandoned; resume from a checkpoint. ({TIME_ENV} sets the time, {DISABLE_ENV}=1 turns the check off.)")
