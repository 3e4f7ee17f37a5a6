"""Density schedules: how the target density changes with the optimizer step, for every method.

A schedule is off unless asked for: the ``density`` option is then the density of every step.
A schedule is given as a short string (it travels through ``--compressor`` specs, configuration
files and statistics records, and contains no comma), and ``density`` stays the *final* density:

``"constant"`` (or None)
    ``density`` at every step.
``"piecewise:D1@S1;D2@S2;..."``
    ``D1`` for steps ``< S1``, ``D2`` for steps ``S1 <= step < S2``, ..., then ``density``.
    The gTop-k reference is ``density=0.001, density_schedule="piecewise:0.004@E"`` with ``E``
    the steps of one epoch.
``"exp_warmup:S"`` or ``"exp_warmup:S;F"``
    DGC's exponential warm-up: ``max(density, F ** (step // S + 1))`` with ``F = 0.25`` unless
    given, i.e. densities 0.25, 0.0625, 0.0156, 0.0039, ... for ``S`` steps each until
    ``density`` is reached (DGC: one epoch per stage, final 0.001).

Steps count optimizer steps from 0, dense warm-up steps included, identically on every rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

FORMS = ('"constant"', '"piecewise:D1@S1;D2@S2;..."', '"exp_warmup:S"', '"exp_warmup:S;F"')


class DensitySchedule:
    """A density as a function of the step. Subclasses are immutable and pure."""

    def density(self, step: int, final: float) -> float:
        """The density at optimizer step ``step`` when the configured density is ``final``."""
        raise NotImplementedError


@dataclass(frozen=True)
class ConstantDensity(DensitySchedule):
    """``final`` at every step (the default)."""

    def density(self, step: int, final: float) -> float:
        return final


@dataclass(frozen=True)
class PiecewiseDensity(DensitySchedule):
    """``stages[i] = (density, until)``: ``density`` for the steps before ``until`` (and from the
    previous stage's ``until`` on); ``final`` from the last ``until`` on. ``until`` increases."""

    stages: Tuple[Tuple[float, int], ...]

    def density(self, step: int, final: float) -> float:
        for density, until in self.stages:
            if step < until:
                return density
        return final


@dataclass(frozen=True)
class ExponentialWarmup(DensitySchedule):
    """DGC's warm-up: ``max(final, factor ** (step // stage_steps + 1))``."""

    stage_steps: int
    factor: float = 0.25

    def density(self, step: int, final: float) -> float:
        return max(final, self.factor ** (step // self.stage_steps + 1))


def parse_schedule(text: Optional[str], name: str = "density_schedule") -> DensitySchedule:
    """Parse a schedule string (see the module docstring); errors name ``name``, the value and
    the accepted forms."""
    if text is None or text == "constant":
        return ConstantDensity()
    if not isinstance(text, str):
        raise TypeError(f"{name} must be None or a string of the form {', '.join(FORMS)}; "
                        f"got {text!r} (type {type(text).__name__})")
    kind, colon, body = text.partition(":")
    try:
        if colon and kind == "piecewise":
            return _parse_piecewise(body)
        if colon and kind == "exp_warmup":
            return _parse_warmup(body)
    except ValueError as err:
        raise ValueError(f"{name}={text!r}: {err}; accepted forms: {', '.join(FORMS)}") from None
    raise ValueError(f"{name}={text!r} is not a density schedule; accepted forms: {', '.join(FORMS)}, "
                     f'e.g. {name}="piecewise:0.004@500"')


def _parse_step(text: str, what: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {text!r}")
    return int(text)


def _parse_fraction(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{what} must be a number in (0, 1], got {text!r}")
    return value


def _parse_piecewise(body: str) -> PiecewiseDensity:
    stages = []
    for item in body.split(";"):
        density, at, until = item.partition("@")
        if not at:
            raise ValueError(f"stage {item!r} must be DENSITY@STEP, e.g. 0.004@500")
        stages.append((_parse_fraction(density, "DENSITY"), _parse_step(until, "STEP")))
    untils = [until for _, until in stages]
    if untils != sorted(set(untils)):
        raise ValueError(f"the steps must increase, got {untils}")
    return PiecewiseDensity(tuple(stages))


def _parse_warmup(body: str) -> ExponentialWarmup:
    steps, semicolon, factor = body.partition(";")
    stage_steps = _parse_step(steps, "S (steps per stage)")
    if not semicolon:
        return ExponentialWarmup(stage_steps)
    value = _parse_fraction(factor, "F (the factor per stage)")
    if value == 1.0:
        raise ValueError("F (the factor per stage) must be in (0, 1), got 1")
    return ExponentialWarmup(stage_steps, value)
