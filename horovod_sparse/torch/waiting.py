"""Waiting for a Horovod collective without taking the core of the work it waits for.

``hvd.synchronize`` waits by spinning: it polls the handle and yields the thread in a loop
(``WaitAndClear`` in Horovod 0.28.1's ``horovod/torch/mpi_ops_v2.cc``), so a waiting rank keeps a
core busy. Horovod's background thread, which runs the collective, and the other ranks of the
host need that core whenever a host runs about as many ranks as it has cores (CPU training, the
main job, a laptop): the spin then slows the very exchange it waits for.
:func:`wait` polls and sleeps between polls instead, the sleeps doubling from
:data:`FIRST_SLEEP` to :data:`LONGEST_SLEEP`, so it notices a finished collective at most
:data:`LONGEST_SLEEP` late (Horovod's own cycle, 1 ms by default, is coarser), then collects the
result with ``hvd.synchronize``, which returns at once and raises the collective's error if it
failed. ``python -m benchmarks.waiting`` measures both ways side by side.
"""
from __future__ import annotations

import time
from typing import Any

import horovod.torch as hvd

#: Seconds of the first sleep between polls.
FIRST_SLEEP = 2e-5
#: Seconds of the longest sleep between polls: the most a finished collective waits to be seen.
LONGEST_SLEEP = 2.5e-4


def wait(handle: Any) -> Any:
    """The result of the Horovod collective ``handle`` (an ``*_async`` call's), once finished;
    raises as ``hvd.synchronize`` does when it failed."""
    delay = FIRST_SLEEP
    while not hvd.poll(handle):
        time.sleep(delay)
        delay = min(2.0 * delay, LONGEST_SLEEP)
    return hvd.synchronize(handle)
