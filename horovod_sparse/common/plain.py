"""Method state as plain containers, so a checkpoint loads with ``torch.load(weights_only=True)``.

PyTorch 2.6+ loads checkpoints with ``weights_only=True`` by default, which refuses any class it
does not know, such as the dataclasses the methods keep their per-group state in (thresholds,
partition tables, schedules). :func:`to_plain` turns such a state into dicts, lists, numbers and
tensors; :func:`from_plain` puts the values back into a freshly built state of the same method,
which supplies the classes (``Sparsifier.new_state`` for the same group size and world size).
"""
from __future__ import annotations

import dataclasses
from typing import Any


def to_plain(state: Any) -> Any:
    """``state`` with every dataclass replaced by a dict of its fields and every tuple by a list
    (recursively); numbers, strings, None and tensors are kept as they are."""
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return {f.name: to_plain(getattr(state, f.name)) for f in dataclasses.fields(state)}
    if isinstance(state, (list, tuple)):
        return [to_plain(item) for item in state]
    if isinstance(state, dict):
        return {key: to_plain(value) for key, value in state.items()}
    return state


def from_plain(template: Any, plain: Any) -> Any:
    """The inverse of :func:`to_plain`: a state shaped like ``template`` (a freshly built state of
    the same method) holding the values of ``plain``.

    Dataclass fields and tuple items follow the template's types; lists and dicts take
    ``plain``'s length and keys, their items typed like the template's first item when it has
    one (the template's lists may be empty or shorter than the saved ones).
    """
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        return dataclasses.replace(template, **{
            f.name: from_plain(getattr(template, f.name), plain[f.name])
            for f in dataclasses.fields(template) if f.init and f.name in plain})
    if isinstance(template, tuple):
        return tuple(from_plain(t, p) for t, p in zip(template, plain))
    if isinstance(template, list):
        item = template[0] if template else None
        return [from_plain(item, p) for p in plain]
    if isinstance(template, dict):
        return {key: from_plain(template.get(key), value) for key, value in plain.items()}
    return plain
