"""Tensors the exchanges would otherwise make at every call with the same values, made once per
value, dtype and device: a Python scalar passed to a tensor operation becomes a tensor at every
call (an operation each; on a GPU a copy from the host), and so does an ``arange`` of a fixed
length (one more operation each). The tensors returned are shared: never change them in place.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np
import torch

#: The longest ``arange`` kept (elements): shorter ones are a few per group and small (bit
#: positions, chunk starts, a chunk's positions); longer ones would keep memory of a buffer's size.
KEPT_RANGE = 2 ** 16

_MADE: Dict[Tuple[Any, ...], torch.Tensor] = {}


def constant(value: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(value)`` in ``dtype`` on ``device``, made once: 0-dim for a number, 1-D
    for a tuple of them."""
    key = ("value", repr(value), dtype, device)  # not the value: -0.0 == 0.0
    if key not in _MADE:
        _MADE[key] = torch.tensor(value, dtype=dtype, device=device)
    return _MADE[key]


def steps(start: int, end: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.arange(start, end, step)`` in ``dtype`` on ``device``, made once when it holds at
    most :data:`KEPT_RANGE` elements (else made at each call)."""
    if len(range(start, end, step)) > KEPT_RANGE:
        return torch.arange(start, end, step, dtype=dtype, device=device)
    key = ("steps", start, end, step, dtype, device)
    if key not in _MADE:
        _MADE[key] = torch.arange(start, end, step, dtype=dtype, device=device)
    return _MADE[key]


def held(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A module's NumPy constant ``array`` (never changed, never freed: it is known by its
    ``id``) in ``dtype`` on ``device``, copied there once: a table of a few hundred values,
    which :func:`constant` would key by its ``repr`` at every call."""
    key = ("array", id(array), dtype, device)
    if key not in _MADE:
        _MADE[key] = torch.as_tensor(array, dtype=dtype).to(device)
    return _MADE[key]
