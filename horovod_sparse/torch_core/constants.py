"""Tensors the exchanges would otherwise make at every call with the same values, made once per
value, dtype and device: a Python scalar passed to a tensor operation becomes a tensor at every
call (an operation each; on a GPU a copy from the host), and so does an ``arange`` of a fixed
length (one more operation each). The tensors returned are shared: never change them in place.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Tuple

import numpy as np
import torch

#: The longest ``arange`` kept (elements): shorter ones are a few per group and small (bit
#: positions, chunk starts, a chunk's positions); longer ones would keep memory of a buffer's size.
KEPT_RANGE = 2 ** 16

_MADE: Dict[Tuple[Any, ...], torch.Tensor] = {}


def made_once(key: Tuple[Any, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, made at the first call with ``key`` (hashable: what decides the values, dtype
    and device) and returned again at every later one."""
    if key not in _MADE:
        _MADE[key] = make()
    return _MADE[key]


def constant(value: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(value)`` in ``dtype`` on ``device``, made once: 0-dim for a number, 1-D
    for a tuple of them."""
    return made_once(("value", repr(value), dtype, device),  # not the value: -0.0 == 0.0
                     lambda: torch.tensor(value, dtype=dtype, device=device))


def kept(key: Tuple[Any, ...], length: int, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()`` of ``length`` elements: made once per ``key`` (:func:`made_once`) when it holds
    at most :data:`KEPT_RANGE` of them, else made at each call."""
    return make() if length > KEPT_RANGE else made_once(key, make)


def steps(start: int, end: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.arange(start, end, step)`` in ``dtype`` on ``device`` (:func:`kept`)."""
    return kept(("steps", start, end, step, dtype, device), len(range(start, end, step)),
                functools.partial(torch.arange, start, end, step, dtype=dtype, device=device))


def held(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A module's NumPy constant ``array`` (never changed, never freed: it is known by its
    ``id``) in ``dtype`` on ``device``, copied there once: a table of a few hundred values,
    which :func:`constant` would key by its ``repr`` at every call."""
    return made_once(("array", id(array), dtype, device), lambda: torch.as_tensor(array, dtype=dtype).to(device))
