"""Slow single-process references of MiCRO and ExDyna, fed every rank's gradients.

They run the whole exchange with explicit loops over ranks in float32: partition tables and
ownership, selection by a plain comparison over the owned partition, the union, the sum over
ranks at the union, the residuals zeroed at the union on every rank; a rank whose partition
selects more than its capacity (``capacity`` times its share ``ceil(k / n)``, at least
``capacity_floor``) sends its lowest indices only and keeps the rest. Everything that decides the
selection is written out here from its description (ALGORITHMS.md and the docstrings of
``horovod_sparse.methods.micro.controllers``), nothing is imported from the package: the published
controller, both balancers, and the histogram controller, whose global counts are taken by brute
force over every rank's candidates (no histogram is binned or summed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np

from tests.support.streams import raw_gradient

SMALLEST = float(np.nextafter(np.float32(0), np.float32(1)))
#: Float32 bit patterns per octave, and the pattern of +inf (the first non-finite one).
OCTAVE_BITS = 1 << 23
INF_BITS = 0x7F800000


def stream_gradient(config: dict, step: int, rank: int, shape: Sequence[int], index: int) -> np.ndarray:
    """The gradients of the partitioned tests: ``tests.support.streams`` with the ranks listed in
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
    overflows: List[int]


def _f32(value: float) -> float:
    """``value`` rounded to float32, at least the smallest positive float32."""
    return max(float(np.float32(value)), SMALLEST)


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


def _paper_threshold(previous: float, sparse_steps: int, k: int, k_prev: int, intended: bool) -> float:
    """ALGORITHMS.md, MiCRO step 3, in double precision (the caller rounds to float32)."""
    if sparse_steps == 0:
        return 1.0 / (2.0 * math.sqrt(k))
    ratio = k_prev / k
    if ratio > 1.1:
        return previous * 1.005
    if ratio > 0.909:
        return previous * (1.00125 if (ratio > 1.0 or not intended) else 0.9987)
    return previous * 0.995


def _scan_block(density: float) -> int:
    """The selection scan's block length: the power of two nearest (in log2) to 1/(16 density),
    within [32, 512]."""
    return int(min(512, max(32, 2 ** round(math.log2(1.0 / (16.0 * density))))))


def _from_bits(bits: np.ndarray) -> np.ndarray:
    """Float32 values of bit patterns, as float64."""
    return np.asarray(bits, dtype=np.int64).astype(np.int32).view(np.float32).astype(np.float64)


def _everything_edges() -> np.ndarray:
    """The first step's window: every positive finite float32 whose bit pattern is a multiple of
    2**21 (4 edges per octave)."""
    return _from_bits(np.arange(1 << 21, INF_BITS, 1 << 21))


def _fine_edges(centre: float) -> np.ndarray:
    """The window around the last threshold: edges 1/2048 octave apart next to it, each gap then
    1/16 of its distance from the centre, out to 4 octaves either side (in bit patterns)."""
    offsets = [0]
    while offsets[-1] < 4 * OCTAVE_BITS:
        offsets.append(offsets[-1] + max(OCTAVE_BITS // 2048, offsets[-1] // 16))
    middle = int(np.array([centre], dtype=np.float32).view(np.int32)[0])
    middle = min(max(middle, 1 + offsets[-1]), INF_BITS - 1 - offsets[-1])  # shifted to fit the range
    bits = sorted({middle + sign * o for o in offsets for sign in (-1, 1)})
    return _from_bits(np.array(bits))


@dataclass
class _Controller:
    """What the threshold controller carries between sparse steps."""

    threshold: float = 0.0
    steps: int = 0
    last_counts: List[int] = field(default_factory=list)
    clamped: bool = False


@dataclass
class _Rank:
    """One rank's candidates: every ``|x|`` of its partition at or above its ``bar``."""

    bar: float
    magnitudes: np.ndarray


def _candidates(part: np.ndarray, block: int, budget: int) -> _Rank:
    """The ``budget``-th largest block maximum is the rank's bar (the smallest float32 when there
    are no more blocks than ``budget``); its candidates are every magnitude at or above it."""
    magnitudes = np.abs(part)
    maxima = np.array([magnitudes[i:i + block].max() for i in range(0, part.size, block)], dtype=np.float32)
    bar = max(float(sorted(maxima, reverse=True)[budget - 1]), SMALLEST) if maxima.size > budget else SMALLEST
    return _Rank(bar, magnitudes[magnitudes >= np.float32(bar)])


def _budget(k: int, parts: int, last_counts: List[int], partition: int, wide: bool) -> int:
    """Blocks a rank reads: 1.5 times its partition's count at the last step, at least k/parts
    (2k/parts before any step); ``wide``: 1.5 k."""
    if wide:
        share = float(k)
    elif last_counts:
        share = max(k / parts, last_counts[partition])
    else:
        share = 2.0 * k / parts
    return max(1, math.ceil(1.5 * share))


def _read(edges: np.ndarray, ranks: List[_Rank], k: int) -> Tuple[float, bool, bool, bool]:
    """(threshold, outside, short, coarse) read off the global counts ``T(e)`` of candidates
    ``>= e`` at every edge (exact at the edges at or above every rank's bar)."""
    tails = np.array([sum(int(np.count_nonzero(r.magnitudes >= np.float32(e))) for r in ranks) for e in edges])
    lowest = max(int(np.count_nonzero(edges < r.bar)) for r in ranks)  # first edge above every bar
    if tails[-1] >= k or lowest >= edges.size:
        return _f32(edges[-1]), True, False, False
    if tails[lowest] < k:
        return _f32(edges[lowest]), lowest == 0, lowest > 0, False
    j = int(np.flatnonzero(tails >= k)[-1])
    above, beyond = float(tails[j]), float(tails[j + 1])
    fraction = math.log(above / k) / math.log(above / beyond) if beyond > 0 else (above - k) / above
    value = edges[j] * (edges[j + 1] / edges[j]) ** fraction
    return min(max(_f32(value), edges[j]), edges[j + 1]), False, False, above - beyond > 0.1 * k


def _histogram_threshold(parts: List[np.ndarray], partitions: List[int], state: _Controller, k: int,
                         block: int) -> float:
    """The histogram controller's threshold: read in the window (everything at the first step and
    after a reading outside its window, else fine around the last threshold); if that stopped
    short at a bar, every rank reads its wide budget and it is read again; if it was interpolated
    in a bin holding more than 10% of k, it is read again in a fine window around it."""
    n = len(parts)
    edges = _everything_edges() if state.steps == 0 or state.clamped else _fine_edges(state.threshold)
    ranks = [_candidates(part, block, _budget(k, n, state.last_counts, p, False)) for part, p in zip(parts, partitions)]
    widened = refined = False
    while True:
        threshold, state.clamped, short, coarse = _read(edges, ranks, k)
        if short and not widened:
            widened = True
            ranks = [_candidates(part, block, _budget(k, n, state.last_counts, p, True))
                     for part, p in zip(parts, partitions)]
        elif coarse and not refined:
            refined = True
            edges = _fine_edges(threshold)
        else:
            state.threshold = threshold
            return threshold


class PartitionedGroup:
    """One group's MiCRO (``method="micro"``) or ExDyna exchange, all ranks, step by step.

    Args:
        options: the method's options (density, controller, balancer, num_blocks).
    """

    def __init__(self, method: str, options: Dict, numel: int, ranks: int) -> None:
        if options.get("density_schedule") is not None:
            raise NotImplementedError("the partitioned reference takes a constant density")
        self.numel, self.ranks = numel, ranks
        self.density = options.get("density", 0.01)
        self.k = max(1, int(self.density * numel))
        capacity = options.get("capacity", 2.0)
        share = -(-self.k // ranks)
        self.capacity = numel if capacity is None else min(numel, max(options.get("capacity_floor", 1024),
                                                                       math.ceil(capacity * share)))
        self.controller = options.get("controller", "histogram")
        self.balancer = options.get("balancer", "prefix")
        self.table = _Blocks(numel, ranks, options.get("num_blocks", 1024)) if method == "exdyna" else None
        self.state = _Controller()

    def exchange(self, xs: List[np.ndarray], step: int) -> Tuple[np.ndarray, Record]:
        """Step ``step`` (the optimizer's step: it rotates the partitions) on the ranks' float32
        buffers ``xs = e + g``, zeroed in place where delivered; returns the update (float32)
        and the step's decisions."""
        n, numel, state = self.ranks, self.numel, self.state
        bounds = self.table.bounds() if self.table is not None else _equal_bounds(numel, n)
        partitions = [(step + r) % n for r in range(n)]
        parts = [x[bounds[p]:bounds[p + 1]] for x, p in zip(xs, partitions)]
        if self.controller == "histogram":
            threshold = _histogram_threshold(parts, partitions, state, self.k, _scan_block(self.density))
        else:
            state.threshold = _paper_threshold(state.threshold, state.steps, self.k, sum(state.last_counts),
                                               self.controller == "paper_intent")
            threshold = _f32(state.threshold)
        found = [bounds[p] + np.flatnonzero(np.abs(part) >= np.float32(threshold))
                 for part, p in zip(parts, partitions)]
        selected = [f[:self.capacity] for f in found]
        union = np.concatenate(selected).astype(np.int64)
        out = np.zeros(numel, dtype=np.float32)
        total = np.zeros(union.size, dtype=np.float32)
        for x in xs:
            total += x[union]
        out[union] = total * np.float32(1.0 / n)
        for x in xs:
            x[union] = 0.0
        counts = [int(s.size) for s in selected]
        by_partition = [0] * n
        for r in range(n):
            by_partition[partitions[r]] = counts[r]
        state.steps += 1
        state.last_counts = by_partition
        if self.table is not None:
            if self.balancer == "paper":
                self.table.pairwise(by_partition, sum(counts))
            else:
                self.table.prefix(by_partition)
        return out, Record(threshold, bounds, counts, [f.size - s.size for f, s in zip(found, selected)])


def partitioned_reference(grads: Sequence[Sequence[np.ndarray]], method: str, options: Dict
                          ) -> Tuple[List[np.ndarray], List[np.ndarray], List[Record]]:
    """MiCRO (``method="micro"``) or ExDyna for one group, all ranks, in float32, every step sparse.

    Args:
        grads: ``grads[t][r]`` is rank r's flat gradient at step t.
        options: the method's options (density, controller, balancer, num_blocks).

    Returns:
        (aggregated update per step, final residual per rank, per-step records).
    """
    n, numel = len(grads[0]), grads[0][0].size
    group = PartitionedGroup(method, options, numel, n)
    residuals = [np.zeros(numel, dtype=np.float32) for _ in range(n)]
    updates: List[np.ndarray] = []
    records: List[Record] = []
    for t, per_rank in enumerate(grads):
        residuals = [residuals[r] + per_rank[r].astype(np.float32) for r in range(n)]
        out, record = group.exchange(residuals, t)
        updates.append(out.astype(np.float64))
        records.append(record)
    return updates, [r.astype(np.float64) for r in residuals], records

