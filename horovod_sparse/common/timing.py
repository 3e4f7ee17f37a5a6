"""Wall-clock timing of phases (selection steps, waits), shared by every front end."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, ContextManager, Dict, Iterator


@contextmanager
def timed(add: Callable[[str, float], None], phase: str) -> Iterator[None]:
    """Call ``add(phase, seconds)`` with the wall time of the enclosed block, even if it raises."""
    start = time.perf_counter()
    try:
        yield
    finally:
        add(phase, time.perf_counter() - start)


class PhaseTimer:
    """Wall time of the phases of a selection, to put into a group's statistics."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}

    def __call__(self, phase: str) -> ContextManager[None]:
        """Accumulate the wall time of the enclosed block under ``phase``."""
        return timed(self._add, phase)

    def _add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.seconds.values())
