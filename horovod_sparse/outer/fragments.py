"""Streamed fragments (Streaming DiLoCo, Douillard et al. 2025): the parameters cut into ``F``
fragments, each ending its round at its own inner step of the cycle, so that one fragment's
exchange is on the wire at a time (peak traffic divided by ``F``).

A fragment is a run of consecutive groups (the model's parameter order); fragment ``f`` ends its
round whenever the position in the cycle of ``every`` inner steps reaches
``((f + 1) * every // F) % every``: with ``F = 1`` after every ``every``-th inner step, as
unfragmented rounds do.
"""
from __future__ import annotations

from typing import List, Sequence


def cut(numels: Sequence[int], count: int) -> List[List[int]]:
    """``count`` runs of consecutive indices of ``numels`` (the groups' sizes), each at least one
    group and about ``1 / count`` of the elements (greedily, whole groups): run ``f`` ends before
    the first group whose middle lies past ``(f + 1) / count`` of all the elements (or where the
    runs after it would otherwise get no group). Raises ``ValueError`` when there are fewer groups than ``count``."""
    if count > len(numels):
        raise ValueError(f"fragments={count} needs at least that many trainable parameters (a fragment is "
                         f"a run of whole parameters); the model has {len(numels)}: give fragments <= {len(numels)}")
    total, runs, start, running = sum(numels), [], 0, 0
    for index, numel in enumerate(numels[:-1]):
        running += numel
        f = len(runs)
        if f == count - 1:
            break
        middle_of_next_past = (2 * running + numels[index + 1]) * count > 2 * (f + 1) * total
        if middle_of_next_past or len(numels) - (index + 1) == count - (f + 1):
            runs.append(list(range(start, index + 1)))
            start = index + 1
    runs.append(list(range(start, len(numels))))
    return runs


def offsets(every: int, count: int) -> List[int]:
    """The position in the cycle of ``every`` inner steps (0 to ``every - 1``, 0 being the cycle's
    end) at which each of ``count`` fragments ends its round: ``((f + 1) * every // count) % every``,
    distinct when ``every >= count``."""
    return [((f + 1) * every // count) % every for f in range(count)]
