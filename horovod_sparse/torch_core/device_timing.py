"""Times on a CUDA device as the device runs the work, not as the host launches it.

On a GPU the host queues kernels and moves on, so ``perf_counter`` around a block measures its
launches and charges the work to whichever later block waits for the device. Here both the
phases of a group's statistics (:func:`cuda_timed`) and the ready times of the backward pass
(:func:`ready_timeline`, which LAGS's ``t_comp`` and MergeComp's search read) are CUDA events on
the device's current stream, read once the step is finished: no host synchronisation before.
Off CUDA both are the host's wall clock.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from horovod_sparse.common.grouping import ReadyTimeline
from horovod_sparse.common.stats import GroupStats


def _event(device: torch.device) -> torch.cuda.Event:
    """A timing event recorded now on ``device``'s current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


@contextmanager
def cuda_timed(stats: GroupStats, phase: str, device: torch.device) -> Iterator[None]:
    """Time the enclosed block as ``device``'s current stream runs it, between two CUDA events
    (the kernels it launched, not their launch); :meth:`GroupStats.settle` reads them when the
    step is finished."""
    start = _event(device)
    try:
        yield
    finally:
        end = _event(device)

        def seconds() -> float:
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        stats.add_pending_time(phase, seconds)


def ready_timeline(device: torch.device) -> ReadyTimeline:
    """A :class:`ReadyTimeline` for gradients on ``device``: CUDA events on CUDA (seconds since
    an event recorded now, read when the step ends), the host's clock elsewhere."""
    if device.type != "cuda":
        return ReadyTimeline()
    origin = _event(device)

    def seconds(stamp: torch.cuda.Event) -> float:
        stamp.synchronize()
        return origin.elapsed_time(stamp) / 1e3

    return ReadyTimeline(lambda: _event(device), seconds)
