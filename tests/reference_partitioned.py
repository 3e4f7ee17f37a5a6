"""Slow single-process references of MiCRO and ExDyna, fed every rank's gradients.

They run the whole exchange with explicit loops over ranks in float32: partition tables and
ownership, selection by a plain comparison over the owned partition, the union, the sum over
ranks at the union, the residuals zeroed at the union on every rank. The published controller
and both balancers are written out here from their descriptions; the histogram controller's
arithmetic comes from ``horovod_sparse.common`` (unit tested there), fed with block maxima and
candidates computed here by brute force.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np

from horovod_sparse.common.controllers import (HistogramController, ThresholdState, histogram_threshold,
                                               scan_block_size)
from tests.streams import raw_gradient

SMALLEST = float(np.nextafter(np.float32(0), np.float32(1)))


def stream_gradient(config: dict, step: int, rank: int, shape: Sequence[int], index: int) -> np.ndarray:
    """The gradients of the partitioned tests: ``tests.streams`` with the ranks listed in
    ``zero_ranks`` producing zeros (they never select anything), from ``zero_after`` on every
    rank producing zeros, and with ``burst = [step, parameter, factor]`` one parameter's
    gradient scaled at one step."""
    gradient = raw_gradient(config["seed"], step, rank, shape, index)
    silent = rank in config.get("zero_ranks", ()) or step >= config.get("zero_after", math.inf)
    burst_step, burst_index, factor = config.get("burst", (-1, -1, 1.0))
    return (0.0 if silent else factor if (step, index) == (burst_step, burst_index) else 1.0) * gradient


def group_stream(config: dict, size: int, members: Sequence[int]) -> List[List[np.ndarray]]:
    """``grads[t][r]``: rank r's flat gradient of a group (parameters ``members``) at step t."""
    return [[np.concatenate([stream_gradient(config, t, r, config["shapes"][i], i).reshape(-1) for i in members])
             for r in range(size)] for t in range(config["steps"])]


@dataclass
class Record:
    """What the reference decided at one step (the worker reports the same in its statistics)."""

    threshold: float
    bounds: List[int]
    counts: List[int]


def _equal_bounds(numel: int, parts: int) -> List[int]:
    lengths = [numel // parts + (1 if p < numel % parts else 0) for p in range(parts)]
    return [int(b) for b in np.concatenate([[0], np.cumsum(lengths)])]


@dataclass
class _Blocks:
    """ExDyna's table as the paper sets it up: num_blk blocks of a multiple of 32 elements."""

    numel: int
    parts: int
    num_blocks: int
    size: int = 0
    blocks: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        a = self.numel // self.num_blocks
        self.size = a - a % 32 if a >= 32 else max(1, a)
        self.num_blocks = min(self.num_blocks, self.numel // self.size)
        q, r = divmod(self.num_blocks, self.parts)
        self.blocks = [q + 1 if p < r else q for p in range(self.parts)]

    def bounds(self) -> List[int]:
        positions = np.concatenate([[0], np.cumsum(self.blocks)]) * self.size
        return [int(b) for b in positions[:-1]] + [self.numel]

    def pairwise(self, by_partition: List[int], k_prev: int) -> None:
        """The published rule, as the authors' trainer runs it."""
        n = self.parts
        k_acc = int(k_prev / n)
        if k_acc == 0:
            return
        min_blk = self.num_blocks / (n * 4)
        den_acc = k_prev / self.numel
        temp = list(by_partition)
        for i in range(n - 1):
            det, det2 = float(temp[i]) / k_acc, float(temp[i + 1]) / k_acc
            k_move = int(self.size * den_acc)
            if det > 1.05 and det2 < 0.95238:
                if self.blocks[i] - 1 < min_blk:
                    continue
                self.blocks[i] -= 1
                self.blocks[i + 1] += 1
                temp[i] -= k_move
                temp[i + 1] += k_move
            if det < 0.95238 and det2 > 1.05:
                if self.blocks[i + 1] - 1 < min_blk:
                    continue
                self.blocks[i] += 1
                self.blocks[i + 1] -= 1
                temp[i] += k_move
                temp[i + 1] -= k_move

    def prefix(self, by_partition: List[int]) -> None:
        """The default rule: boundary j moves one block by the sign of what the partitions left of
        it selected beyond j shares, outside a band of 5% of a share."""
        n, total = self.parts, sum(by_partition)
        if total < n:
            return
        share, min_blk = total / n, self.num_blocks / (n * 4)
        for j in range(1, n):
            excess = sum(by_partition[:j]) - j * share
            if excess > 0.05 * share and self.blocks[j - 1] - 1 >= min_blk:
                self.blocks[j - 1] -= 1
                self.blocks[j] += 1
            elif excess < -0.05 * share and self.blocks[j] - 1 >= min_blk:
                self.blocks[j - 1] += 1
                self.blocks[j] -= 1


def _paper_threshold(previous: float, step: int, k: int, k_prev: int, intended: bool) -> float:
    if step == 0:
        return 1.0 / (2.0 * math.sqrt(k))
    ratio = k_prev / k
    if ratio > 1.1:
        return previous * 1.005
    if ratio > 0.909:
        return previous * (1.00125 if (ratio > 1.0 or not intended) else 0.9987)
    return previous * 0.995


def _block_maxima(values: np.ndarray, block: int) -> np.ndarray:
    return np.array([np.abs(values[i:i + block]).max() for i in range(0, values.size, block)], dtype=np.float32)


@dataclass
class _Candidates:
    """A rank's candidates, by brute force: every ``|x|`` of its partition at or above ``bar``,
    the ``budget``-th largest block maximum."""

    bar: float
    magnitudes: np.ndarray

    @classmethod
    def collect(cls, part: np.ndarray, block: int, budget: int) -> "_Candidates":
        maxima = _block_maxima(part, block)
        bar = max(float(np.sort(maxima)[::-1][budget - 1]), SMALLEST) if maxima.size > budget else SMALLEST
        return cls(bar, part[part >= np.float32(bar)])

    def magnitudes_numpy(self) -> np.ndarray:
        return self.magnitudes


def _histogram_threshold(xs: List[np.ndarray], owned: List[Tuple[int, int, int]], state: ThresholdState, k: int,
                         block: int) -> float:
    """Every rank's candidates counted into the controller's windows and summed, round by round
    (``histogram_threshold`` of each rank driven in lockstep, each on a copy of the state)."""
    controller = HistogramController()
    states = [ThresholdState(**vars(state)) for _ in xs]
    plans = [histogram_threshold(controller, rank_state, k, len(xs), partition, rank,
                                 lambda budget, part=np.abs(x[start:end]): _Candidates.collect(part, block, budget))
             for rank, (x, (partition, start, end), rank_state) in enumerate(zip(xs, owned, states))]
    rounds = [next(plan) for plan in plans]
    while True:
        assert len({r.tag for r in rounds}) == 1, "ranks disagree on the histogram round"
        total = sum(r.local.astype(np.int64) for r in rounds)
        try:
            rounds = [plan.send(total) for plan in plans]
        except StopIteration as finished:
            threshold = finished.value[0]
            break
    for plan in plans[1:]:  # the other ranks end on the same (global) histogram
        try:
            plan.send(total)
        except StopIteration as finished:
            assert finished.value[0] == threshold
    vars(state).update(vars(states[0]))
    return threshold


def partitioned_reference(grads: Sequence[Sequence[np.ndarray]], method: str, options: Dict
                          ) -> Tuple[List[np.ndarray], List[np.ndarray], List[Record]]:
    """MiCRO (``method="micro"``) or ExDyna for one group, all ranks, in float32.

    Args:
        grads: ``grads[t][r]`` is rank r's flat gradient at step t.
        options: the method's options (density, controller, balancer, num_blocks).

    Returns:
        (aggregated update per step, final residual per rank, per-step records).
    """
    n, numel = len(grads[0]), grads[0][0].size
    density = options.get("density", 0.01)
    k = max(1, int(density * numel))
    controller = options.get("controller", "histogram")
    balancer = options.get("balancer", "prefix")
    table = _Blocks(numel, n, options.get("num_blocks", 1024)) if method == "exdyna" else None
    block = scan_block_size(density)
    residuals = [np.zeros(numel, dtype=np.float32) for _ in range(n)]
    state = ThresholdState()
    updates, records = [], []
    for step, per_rank in enumerate(grads):
        xs = [residuals[r] + per_rank[r].astype(np.float32) for r in range(n)]
        bounds = table.bounds() if table is not None else _equal_bounds(numel, n)
        owned = [((step + r) % n, bounds[(step + r) % n], bounds[(step + r) % n + 1]) for r in range(n)]
        if controller == "histogram":
            threshold = _histogram_threshold(xs, owned, state, k, block)
        else:
            state.threshold = _paper_threshold(state.threshold, step, k, state.last_union, controller == "paper_intent")
            threshold = max(float(np.float32(state.threshold)), SMALLEST)
        selected = [start + np.flatnonzero(np.abs(x[start:end]) >= np.float32(threshold))
                    for x, (_, start, end) in zip(xs, owned)]
        union = np.concatenate(selected).astype(np.int64)
        out = np.zeros(numel, dtype=np.float32)
        total = np.zeros(union.size, dtype=np.float32)
        for x in xs:
            total += x[union]
        out[union] = total * np.float32(1.0 / n)
        for x in xs:
            x[union] = 0.0
        residuals = xs
        counts = [int(s.size) for s in selected]
        by_partition = [0] * n
        for r in range(n):
            by_partition[(step + r) % n] = counts[r]
        state.record(by_partition)
        if table is not None:
            if balancer == "paper":
                table.pairwise(by_partition, sum(counts))
            else:
                table.prefix(by_partition)
        updates.append(out.astype(np.float64))
        records.append(Record(threshold, bounds, counts))
    return updates, [r.astype(np.float64) for r in residuals], records
