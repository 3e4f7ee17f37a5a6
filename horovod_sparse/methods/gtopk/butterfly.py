"""gTop-k's framework-free part: the reduction schedule for any number of ranks (fold in,
recursive doubling, fold out) and the method's options.

With ``n`` ranks and ``p`` the largest power of two ``<= n``:

1. **fold-in** (only when ``n > p``): each *extra* rank ``e >= p`` sends its set to its *host*
   ``e - p``, which merges it into its own. Extra ranks then wait.
2. **rounds** ``0 .. log2(p) - 1``: in round ``j`` rank ``r < p`` exchanges its set with
   ``r XOR 2**j``, and both merge the two sets. Partners hold the same two sets, so they compute
   the same merge; after the last round every rank ``< p`` holds the result of all ``n`` inputs
   (recursive doubling: no rank idles, no final broadcast).
3. **fold-out** (only when ``n > p``): each host sends the result to its extra rank, which adopts
   it.

Compared with a binary tree to rank 0 plus a broadcast (the reference), this takes
``log2(p)`` exchange rounds instead of ``2 * log2(n)`` sequential steps, every rank merges in
every round, and any ``n`` works. Every rank sends ``k`` coordinates per round it takes part in.

The functions here are pure and framework-free: every rank computes the same schedule from ``n``
alone, so it needs no communication to agree on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Optional, Tuple, TypeVar

from horovod_sparse.common.options import SparsifierOptions
from horovod_sparse.common.validation import check_choice, check_int

FOLD_IN = "fold-in"
FOLD_OUT = "fold-out"


#: A tensor of either framework.
Tensor = TypeVar("Tensor")


@dataclass(frozen=True)
class SparseSet(Generic[Tensor]):
    """Coordinates of a flat buffer, held as tensors of either framework: distinct ``idx``
    (int64) in ascending order, and their values ``val``."""

    idx: Tensor
    val: Tensor

    def without_entries(self) -> "SparseSet[Tensor]":
        """An empty set of the same dtypes and device (what an idle rank sends)."""
        return SparseSet(self.idx[:0], self.val[:0])  # type: ignore[index]


@dataclass(frozen=True)
class Phase:
    """One communication phase of the schedule, seen by every rank.

    Attributes:
        name: ``"fold-in"``, ``"round0"``, ``"round1"``, ... or ``"fold-out"`` (also used to tag
            the phase's collectives).
        send_to: ``send_to[r]`` is the rank that ``r`` sends its set to, or None.
        receive_from: ``receive_from[r]`` is the rank whose set ``r`` receives, or None.
        adopt: True when a receiver replaces its set with the one it receives (fold-out);
            False when it merges the received set into its own.
    """

    name: str
    send_to: Tuple[Optional[int], ...]
    receive_from: Tuple[Optional[int], ...]
    adopt: bool = False

    @property
    def is_round(self) -> bool:
        """True for the recursive-doubling rounds (symmetric exchanges)."""
        return self.name not in (FOLD_IN, FOLD_OUT)


def largest_power_of_two(n: int) -> int:
    """The largest power of two ``<= n`` (``n >= 1``)."""
    n = check_int("n", n, minimum=1)
    return 1 << (n.bit_length() - 1)


def round_count(n: int) -> int:
    """Number of recursive-doubling rounds for ``n`` ranks: ``log2`` of the largest power of two
    ``<= n``."""
    return largest_power_of_two(n).bit_length() - 1


def fold_host(rank: int, n: int) -> Optional[int]:
    """The rank an extra rank folds into (``rank - p``), or None for ranks below ``p``."""
    p = largest_power_of_two(n)
    return rank - p if rank >= p else None


def butterfly_schedule(n: int) -> Tuple[Phase, ...]:
    """The phases of the reduction among ``n`` ranks, in order (empty for ``n = 1``).

    The fold phases exist only when ``n`` is not a power of two. In every phase the relation is
    consistent: ``receive_from[send_to[r]] == r`` for every sender ``r``; in a round
    ``send_to == receive_from`` and the pairing is an involution without fixed points.
    """
    p = largest_power_of_two(n)
    phases = []
    if n > p:
        to_host = tuple(fold_host(r, n) for r in range(n))
        from_extra = tuple(r + p if r + p < n else None for r in range(n))
        phases.append(Phase(FOLD_IN, send_to=to_host, receive_from=from_extra))
    for j in range(round_count(n)):
        partners = tuple(r ^ (1 << j) if r < p else None for r in range(n))
        phases.append(Phase(f"round{j}", send_to=partners, receive_from=partners))
    if n > p:
        phases.append(Phase(FOLD_OUT, send_to=phases[0].receive_from, receive_from=phases[0].send_to,
                            adopt=True))
    return tuple(phases)


@dataclass(frozen=True)
class GTopKOptions(SparsifierOptions):
    """Options of gTop-k (on top of :class:`SparsifierOptions`).

    Attributes:
        residual: which local coordinates leave the residual. ``"exact"`` (default): only those
            whose value is in the final global set, i.e. that survived every merge on the way
            (tracked through the rounds); nothing is lost. ``"paper"``: the reference's rule,
            every local top-k coordinate whose *index* is in the global set, even when its value
            was dropped by a merge on the way (that gradient mass is lost).
        recall_every: debug: every ``recall_every`` steps (0 = never) one extra dense allreduce
            of ``g + e`` measures the recall of the global set against the exact top-k of the
            sum over ranks; reported as ``extra["recall"]``, with ``extra["recall_mass"]`` the
            share of that top-k's magnitude the global set covers (the allreduce counts as
            ``meta``).
    """

    residual: str = "exact"
    recall_every: int = 0

    def _validate(self) -> None:
        check_choice("residual", self.residual, ("exact", "paper"))
        object.__setattr__(self, "recall_every", check_int("recall_every", self.recall_every))
        if self.fp16_values:
            raise ValueError("fp16_values=True is not supported by gtopk: partial sums are "
                             "re-rounded to float16 in every round and that rounding error belongs "
                             "to no rank's residual, so it would be lost; use fp16_values=False")
