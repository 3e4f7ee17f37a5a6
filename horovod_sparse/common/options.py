"""Validated options every sparsifier accepts.

Options are frozen dataclasses: they are checked once, at construction, and then describe the
method completely (``as_dict`` is what ranks compare to detect a configuration mismatch and what
statistics records carry). A method with extra options subclasses :class:`SparsifierOptions` and
validates its own fields in ``_validate``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional

from horovod_sparse.common.schedule import DensitySchedule, parse_schedule
from horovod_sparse.common.validation import check_bool, check_fraction, check_int


def target_count(density: float, numel: int) -> int:
    """The number of coordinates a density asks for: ``max(1, int(density * numel))``.

    At least one coordinate is always selected so that every rank issues non-empty collectives.
    """
    return max(1, int(density * numel))


@dataclass(frozen=True)
class SparsifierOptions:
    """Options shared by all sparsifiers.

    Attributes:
        density: fraction of the coordinates of each group sent per step, in (0, 1].
        min_numel: groups with fewer elements than this are allreduced dense (sparsifying a
            10-element bias saves nothing and costs a collective round).
        warmup_steps: the first ``warmup_steps`` optimizer steps are dense (error feedback is
            empty then, so no residual is lost).
        fp16_values: send selected values as float16 on the wire; the rounding error stays in
            the residual, so nothing is lost.
        density_schedule: how the density changes with the step (see
            :mod:`horovod_sparse.common.schedule`): None (off: ``density`` at every step),
            ``"piecewise:0.004@500"`` (0.004 for steps < 500, then ``density``), or
            ``"exp_warmup:200"`` (DGC's warm-up, 200 steps per stage, down to ``density``).
    """

    density: float = 0.01
    min_numel: int = 1024
    warmup_steps: int = 0
    fp16_values: bool = False
    density_schedule: Optional[str] = None

    #: Registry name of the method these options belong to; set by the registry.
    method: ClassVar[str] = ""

    def __post_init__(self) -> None:
        # Frozen dataclass: normalised values are written through object.__setattr__.
        object.__setattr__(self, "density", check_fraction("density", self.density))
        object.__setattr__(self, "min_numel", check_int("min_numel", self.min_numel))
        object.__setattr__(self, "warmup_steps", check_int("warmup_steps", self.warmup_steps))
        check_bool("fp16_values", self.fp16_values)
        # Parsed once; not a field, so as_dict() and equality keep the string.
        object.__setattr__(self, "_schedule", parse_schedule(self.density_schedule))
        self._validate()

    def _validate(self) -> None:
        """Hook for subclasses: check method-specific fields, raising ValueError/TypeError."""

    def as_dict(self) -> Dict[str, Any]:
        """All options plus the method name, JSON-serialisable."""
        return {"method": self.method, **dataclasses.asdict(self)}

    @property
    def schedule(self) -> DensitySchedule:
        """The parsed ``density_schedule``."""
        return self._schedule  # type: ignore[attr-defined]

    def density_at(self, step: Optional[int] = None) -> float:
        """The density at optimizer step ``step`` (``density`` when ``step`` is None or no
        schedule is set)."""
        return self.density if step is None else self.schedule.density(step, self.density)

    def count(self, numel: int, step: Optional[int] = None) -> int:
        """Target number of coordinates ``k`` for a group of ``numel`` elements at optimizer step
        ``step`` (the constant ``density`` when ``step`` is None)."""
        return target_count(self.density_at(step), numel)
