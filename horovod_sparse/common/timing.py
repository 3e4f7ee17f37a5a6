"""Wall-clock timing of the phases of a selection, shared by both frameworks."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, Iterator


class PhaseTimer:
    """Wall time of the phases of a selection, to put into a group's statistics."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - begin

    @property
    def total(self) -> float:
        return sum(self.seconds.values())
