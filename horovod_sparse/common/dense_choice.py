"""Parameters kept dense: the ``dense=`` argument of every front end.

Some parameters are better exchanged whole whatever the method: embeddings whose rows are
touched by few samples, normalisation layers, biases, the last layer. ``dense=`` names them, as
exact names, shell-style patterns (:mod:`fnmatch`: ``"*.bias"``, ``"embed*"``) or a predicate
on the name; the front end puts them in groups of their own that take its dense allreduce at
every step, and its statistics mark those groups ``kept_dense``.

The choice is checked where the front end first knows the names: a name or pattern that
matches no parameter is an error naming the closest names (a typo must not silently compress
the layer it meant to protect), and every rank must choose the same parameters (part of the
configuration every rank compares before the first exchange).
"""
from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Callable, FrozenSet, List, Sequence, Union

#: What ``dense=`` accepts: None (nothing kept dense), a name or pattern, a sequence of names and
#: patterns, or a predicate on a parameter's name.
DenseSpec = Union[None, str, Sequence[str], Callable[[str], bool]]


def chosen_dense(spec: DenseSpec, names: Sequence[str], what: str = "parameter") -> FrozenSet[str]:
    """The names among ``names`` that ``spec`` keeps dense.

    Args:
        spec: the ``dense=`` argument.
        names: every name the front end exchanges (``what`` names their kind in errors:
            ``"parameter"``, ``"variable"``, ``"FSDP unit"``).

    Raises:
        ValueError: a name or pattern matches nothing (the message lists the closest names), or
            a predicate chooses nothing.
        TypeError: ``spec`` is none of the accepted kinds.
    """
    if spec is None:
        return frozenset()
    if callable(spec):
        chosen = frozenset(name for name in names if spec(name))
        if not chosen:
            raise ValueError(f"dense={_describe(spec)} chose no {what}: it returned False for all {len(names)} "
                             f"(first: {', '.join(map(repr, names[:3]))})")
        return chosen
    patterns = [spec] if isinstance(spec, str) else list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError("dense= takes a name or pattern, a list of them, or a predicate on the name; got "
                        f"{spec!r}")
    chosen_names: List[str] = []
    for pattern in patterns:
        matched = fnmatch.filter(names, pattern)
        if not matched:
            near = _near_misses(pattern, names)
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            raise ValueError(f"dense={pattern!r} matches no {what} of the {len(names)} exchanged{hint} "
                             f"(names are matched whole, with fnmatch patterns such as '*.bias')")
        chosen_names.extend(matched)
    return frozenset(chosen_names)


def _near_misses(pattern: str, names: Sequence[str], count: int = 3) -> List[str]:
    """The names closest to ``pattern`` (its text without wildcards against each name, its
    start and its dotted parts: ``"nrom.*"`` finds ``"norm.weight"``)."""
    literal = re.sub(r"[*?\[\]]", "", pattern)

    def closeness(name: str) -> float:
        pieces = [name, name[:len(literal)], *re.split(r"[./:]", name)]
        return max(difflib.SequenceMatcher(None, literal, piece).ratio() for piece in pieces)

    scored = sorted(((closeness(name), name) for name in names), key=lambda pair: -pair[0])
    return [name for score, name in scored[:count] if score >= 0.6]


def _describe(spec: DenseSpec) -> str:
    if callable(spec):
        return f"<predicate {getattr(spec, '__qualname__', type(spec).__name__)}>"
    return repr(spec)
