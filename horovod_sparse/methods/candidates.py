"""The histogram controller's candidates (MiCRO, ExDyna), written once for every backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from horovod_sparse.common.controllers import candidate_bar
from horovod_sparse.methods.backend import Backend, Tensor


@dataclass(frozen=True)
class Candidates:
    """Every coordinate of a scanned slice at or above ``bar``, the ``budget``-th largest block
    maximum (:func:`horovod_sparse.common.controllers.candidate_bar`): ``indices`` into the
    buffer (ascending) and their ``magnitudes``. The histogram controller counts them before the
    threshold is known; afterwards any threshold at or above the bar is a filter of them."""

    B: Backend
    scanned: Any
    bar: float
    indices: Tensor
    magnitudes: Tensor

    @classmethod
    def collect(cls, B: Backend, scanned: Any, budget: int) -> "Candidates":
        """The candidates of ``scanned`` (a backend's ``scan``) above its ``budget``-th largest
        block maximum."""
        bar = candidate_bar(scanned.maxima_numpy(), budget)
        return cls(B, scanned, bar, *B.pick_with_magnitudes(scanned, bar))

    def magnitudes_numpy(self) -> np.ndarray:
        """The magnitudes as a float32 NumPy array (for histograms)."""
        return self.B.to_numpy(self.magnitudes).astype(np.float32)

    def select(self, threshold: float) -> Tensor:
        """Exactly ``B.pick(scanned, threshold)``: a filter of the candidates when ``threshold``
        is at or above the bar, a new pick otherwise."""
        if threshold >= self.bar:
            return self.B.mask(self.indices, self.B.at_least(self.magnitudes, threshold))
        return self.B.pick(self.scanned, threshold)
