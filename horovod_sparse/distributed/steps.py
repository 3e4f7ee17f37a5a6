"""What both ``torch.distributed`` front ends (the DDP hook and FSDP2's replicas) keep from step
to step: the counter, the statistics and the timeline of the groups' readiness."""
from __future__ import annotations

from typing import IO, Optional

import torch

from horovod_sparse.common.grouping import ReadyTimeline
from horovod_sparse.engine.model_state import ModelState
from horovod_sparse.common.stats import StatsLog, StepStats, finish_step
from horovod_sparse.torch_core.device_timing import ready_timeline
from horovod_sparse.torch_core.tensor_backend import read_scalars


class StepBook:
    """The step bookkeeping of a hook-driven front end.

    Attributes:
        steps: synchronised steps so far.
        last_stats: the statistics of the last step (``abandoned`` after a non-finite gradient).
        timeline: when the groups became ready, step after step (read by LAGS's adaptive rule):
            the host's clock, or CUDA events once the first gradient is on a GPU.
    """

    def __init__(self, stats_log: Optional[IO[str]]) -> None:
        self._stats_log = StatsLog(stats_log) if stats_log is not None else None
        self.timeline = ReadyTimeline()
        self._timeline_placed = False
        self.steps = 0
        self.last_stats: Optional[StepStats] = None
        self._step_stats = StepStats(step=0)

    def _place_timeline(self, gradient: torch.Tensor) -> None:
        """Time the groups on ``gradient``'s device (known from the first gradient on)."""
        if not self._timeline_placed:
            self._timeline_placed = True
            if gradient.is_cuda:
                self.timeline = ready_timeline(gradient.device)

    def _close_step(self, model: ModelState) -> None:
        """Settle the step's statistics, hand its timeline to the method and count it."""
        model.end_step(self.timeline.end_step())
        self.last_stats = finish_step(self._step_stats, self._stats_log, read_scalars)
        self.steps += 1
        self._step_stats = StepStats(step=self.steps)

    def _restart_at(self, steps: int) -> None:
        """Continue counting from ``steps`` (a loaded checkpoint's)."""
        self.steps = steps
        self._step_stats = StepStats(step=steps)
