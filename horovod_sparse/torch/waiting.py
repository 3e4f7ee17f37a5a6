"""Waiting for a Horovod collective without taking the core of the work it waits for.

``hvd.synchronize`` waits by spinning: it polls the handle and yields the thread in a loop
(``WaitAndClear`` in Horovod 0.28.1's ``horovod/torch/mpi_ops_v2.cc``), so a waiting rank keeps a
core busy. Where a host has cores to spare that costs nothing and notices a finished collective
soonest. Where it does not (CPU training, the main job, a laptop: about as many ranks as cores),
Horovod's background thread, which runs the collective, and the other ranks of the host need
that core: the spin slows the very exchange it waits for. There :func:`wait` polls and sleeps
between polls instead, the sleeps doubling from :data:`FIRST_SLEEP` to :data:`LONGEST_SLEEP`
(so it notices a finished collective at most that late; Horovod's own cycle, 1 ms by default, is
coarser), then collects the result with ``hvd.synchronize``, which returns at once and raises
the collective's error if it failed.

Which way (:func:`strategy`): ``HOROVOD_SPARSE_WAIT=spin`` or ``sleep``, or by default
(``auto``) spin when the cores this process may run on are at least :data:`CORES_PER_RANK` per
rank of the host (``hvd.local_size()``), else sleep. The cores are those of the process's CPU
affinity, fewer where a CPU quota of its control group allows less (a container limited to 2
CPUs on a large host: :func:`usable_cores`). Spinning on cores the host does not have starves
Horovod's background threads, most of all in a two-tier exchange, whose process sets each take
a negotiation per cycle: ``python -m benchmarks.emulated.two_tier_steps`` on 2 cores with 4 ranks under
``HOROVOD_SPARSE_WAIT=spin`` was aborted by Gloo's 30 s timeout (SIGABRT) in each of its runs.
``python -m benchmarks.costs.waiting`` measures both ways side by side.
"""
from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

import horovod.torch as hvd

#: Seconds of the first sleep between polls.
FIRST_SLEEP = 2e-5
#: Seconds of the longest sleep between polls: the most a finished collective waits to be seen.
LONGEST_SLEEP = 2.5e-4
#: Cores per rank of the host from which ``auto`` spins: the rank's own thread and Horovod's
#: background thread each keep one busy.
CORES_PER_RANK = 2
#: The environment variable that chooses, and its values.
SETTING = "HOROVOD_SPARSE_WAIT"
CHOICES = ("auto", "spin", "sleep")


def strategy(setting: str, cores: int, local_ranks: int) -> str:
    """``"spin"`` or ``"sleep"`` for the ``setting`` of :data:`SETTING` on a host where this
    process may run on ``cores`` cores beside ``local_ranks`` ranks (itself included)."""
    if setting not in CHOICES:
        raise ValueError(f"{SETTING}={setting!r} is not one of {', '.join(CHOICES)}: 'spin' waits as hvd.synchronize "
                         "does, 'sleep' polls and sleeps, 'auto' (the default) spins only where the host has "
                         f"{CORES_PER_RANK} cores per rank")
    if setting != "auto":
        return setting
    return "spin" if cores >= CORES_PER_RANK * local_ranks else "sleep"


def cpu_quota(cgroup_root: Path = Path("/sys/fs/cgroup")) -> Optional[float]:
    """The CPUs this process's control group may use, from its quota: cgroup v2's ``cpu.max``
    (``"max 100000"``: none) or v1's ``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (-1: none);
    None without a quota (or where neither file can be read)."""
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup_root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup_root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def usable_cores(affinity: int, quota: Optional[float]) -> int:
    """The cores a process may keep busy: its CPU ``affinity``'s, no more than a ``quota``
    allows (rounded up, at least 1)."""
    return affinity if quota is None else max(1, min(affinity, math.ceil(quota)))


@functools.lru_cache(maxsize=None)
def _strategy_here(setting: str, local_ranks: int) -> str:
    return strategy(setting, usable_cores(len(os.sched_getaffinity(0)), cpu_quota()), local_ranks)


def poll_until_done(handle: Any, sleep: bool, timeout: Optional[float] = None) -> None:
    """Return once the Horovod collective ``handle`` has finished, polling: with ``sleep`` between
    polls (doubling from :data:`FIRST_SLEEP` to :data:`LONGEST_SLEEP`), else yielding the core
    between polls with the interpreter's lock released, as ``hvd.synchronize``'s spin does.
    ``TimeoutError`` when ``timeout`` seconds (None: no limit) pass first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = FIRST_SLEEP
    while not hvd.poll(handle):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the Horovod collective did not complete within {timeout:g} s")
        if sleep:
            time.sleep(delay)
            delay = min(2.0 * delay, LONGEST_SLEEP)
        else:
            os.sched_yield()


def wait(handle: Any, timeout: Optional[float] = None) -> Any:
    """The result of the Horovod collective ``handle`` (an ``*_async`` call's), once finished,
    waited for the :func:`strategy`'s way; raises as ``hvd.synchronize`` does when it failed, and
    ``TimeoutError`` when it has not finished within ``timeout`` seconds (None: no limit)."""
    sleep = _strategy_here(os.environ.get(SETTING, "auto"), hvd.local_size()) == "sleep"
    if sleep or timeout is not None:
        poll_until_done(handle, sleep, timeout)
    return hvd.synchronize(handle)
