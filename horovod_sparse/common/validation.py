"""Argument checks that raise errors naming the option, the value and what is allowed."""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable


def _describe(value: Any) -> str:
    return f"{value!r} (type {type(value).__name__})"


def check_fraction(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float in (0, 1] (or [0, 1] with ``allow_zero``), else raise.

    Booleans, strings, None, NaN and infinities are refused with a message that states the
    allowed range, e.g. ``density=0.001``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number in {'[0, 1]' if allow_zero else '(0, 1]'}, "
                        f"got {_describe(value)}; for example {name}=0.001")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be a finite number in (0, 1], got {value}")
    low_ok = value >= 0.0 if allow_zero else value > 0.0
    if not (low_ok and value <= 1.0):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name} must be in {interval} (the fraction of gradient coordinates "
                         f"sent each step), got {value}; for example {name}=0.001")
    return value


def check_int(name: str, value: Any, *, minimum: int = 0) -> int:
    """Return ``value`` as an int >= ``minimum``, else raise (booleans and floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {_describe(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def check_positive_float(name: str, value: Any) -> float:
    """Return ``value`` as a finite float > 0, else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number, got {_describe(value)}")
    value = float(value)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool, else raise (no truthiness guessing: 'yes' is refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {_describe(value)}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise listing them."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {_describe(value)}")
    return value
