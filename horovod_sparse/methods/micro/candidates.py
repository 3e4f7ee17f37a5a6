"""The histogram controller's candidates (MiCRO, ExDyna), written once for every backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from horovod_sparse.methods.micro.controllers import HistogramWindow
from horovod_sparse.methods.backend import Backend, Tensor


@dataclass(frozen=True)
class Candidates:
    """Every coordinate of a scanned slice at or above ``bar``, the ``budget``-th largest block
    maximum (the backend's ``candidate_bar``: a float, or a 0-dim tensor left on an
    accelerator): ``indices`` into the buffer (ascending) and their ``magnitudes``. The
    histogram controller counts them before the threshold is known; afterwards any threshold at
    or above the bar is a filter of them."""

    B: Backend
    scanned: Any
    bar: Any
    indices: Tensor
    magnitudes: Tensor

    @classmethod
    def collect(cls, B: Backend, scanned: Any, budget: int) -> "Candidates":
        """The candidates of ``scanned`` (a backend's ``scan``) above its ``budget``-th largest
        block maximum."""
        bar = B.candidate_bar(scanned, budget)
        return cls(B, scanned, bar, *B.pick_with_magnitudes(scanned, bar))

    def local_histogram(self, window: HistogramWindow, rank: int, parts: int) -> Tensor:
        """:func:`~horovod_sparse.methods.micro.controllers.local_histogram` of the magnitudes and bar,
        as the backend computes it (on the candidates' device)."""
        return self.B.local_histogram(window, self.magnitudes, self.bar, rank, parts)

    def select(self, threshold: float, filterable: bool) -> Tensor:
        """Exactly ``B.pick(scanned, threshold)``: a filter of the candidates when the caller
        knows ``threshold`` is at or above the bar (``filterable``), a new pick otherwise."""
        if filterable:
            return self.B.mask(self.indices, self.B.at_least(self.magnitudes, threshold))
        return self.B.pick(self.scanned, threshold)
