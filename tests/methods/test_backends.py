"""The selections the two frameworks used to make differently, now one method's code on two
backends: each run on PyTorch's and TensorFlow's backend on the inputs where the old halves
differed (many tied magnitudes, Gaussian-k's corrections, the hard threshold's scan), against a
plain NumPy reference written here; and the histogram controller's candidates, one class on both
backends. One process, no Horovod."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf
import torch

from benchmarks.costs.exchange_cost import DispatchedOps
from horovod_sparse.methods.gtopk.butterfly import SparseSet
from horovod_sparse.common.thresholds import as_float32
from horovod_sparse.common.threshold_baselines import gaussian_threshold
from horovod_sparse.methods.backend import PAD
from horovod_sparse.methods.gaussiank import gaussiank_select
from horovod_sparse.methods.micro.candidates import Candidates
from horovod_sparse.methods.gtopk.exchange import merge
from horovod_sparse.tensorflow import backend as tf_backend
from horovod_sparse.torch import backend as torch_backend
from horovod_sparse.torch_core.selection import accelerator_paths
from horovod_sparse.torch_core.tensor_backend import counts_at_each
from tests.support.reference_gtopk import merge_sets

BACKENDS = {"torch": (torch_backend, torch.from_numpy), "tensorflow": (tf_backend, tf.constant)}
#: The framework's backends and whether PyTorch's run on its accelerators' paths (on the CPU).
PATHS = [("torch", False), ("torch", True), ("tensorflow", False)]


def tied(numel: int, seed: int) -> np.ndarray:
    """Few distinct magnitudes of both signs: most coordinates tie with many others."""
    return np.random.default_rng(seed).integers(-3, 4, size=numel).astype(np.float32) / 4


def reference_gaussiank(x: np.ndarray, k: int, density: float):
    """Gaussian-k from its definition: mean and unbiased deviation in float64, ``|x| >= t``,
    then the corrections, each re-selecting from the whole buffer."""
    threshold = gaussian_threshold(float(x.mean(dtype=np.float64)), float(x.std(dtype=np.float64, ddof=1)), density)
    selected = np.flatnonzero(np.abs(x) >= as_float32(threshold))
    for _ in range(3):
        if 3 * len(selected) < 2 * k:
            threshold *= 0.5
        elif 3 * len(selected) > 4 * k:
            threshold *= 1.5
        else:
            break
        selected = np.flatnonzero(np.abs(x) >= as_float32(threshold))
    return selected, as_float32(threshold)


@pytest.mark.parametrize("framework,accelerated", PATHS)
@pytest.mark.parametrize("kind,seed", [("normal", 0), ("normal", 1), ("tied", 2), ("tied", 3)])
@pytest.mark.parametrize("capacity", [50_000, 700, 400])
def test_gaussiank_selects_as_its_definition_on_both_backends(framework, accelerated, kind, seed, capacity):
    """Tied inputs make the count jump across the correction bounds, so the corrections run; on
    the accelerators' paths the corrections are decided on the device. A capacity below the
    count sends the lowest indices (padded on the accelerators' paths) and counts the rest."""
    B, tensor = BACKENDS[framework]
    x = tied(50_000, seed) if kind == "tied" else np.random.default_rng(seed).standard_normal(50_000).astype(np.float32)
    k, density = 500, 0.01
    with accelerator_paths() if accelerated else contextlib.nullcontext():
        capped, threshold = gaussiank_select(B, tensor(x), k, density, capacity)
    expected, expected_threshold = reference_gaussiank(x, k, density)
    idx = B.to_numpy(capped.idx)
    assert capped.padded == accelerated and len(idx) == (capacity if accelerated else min(capacity, len(expected)))
    np.testing.assert_array_equal(idx[:len(expected)], expected[:capacity])
    assert (idx[len(expected):] == PAD).all()
    assert (int(capped.sent), int(capped.overflow)) == (min(capacity, len(expected)), max(0, len(expected) - capacity))
    assert float(threshold) == pytest.approx(expected_threshold, rel=1e-5)


@pytest.mark.parametrize("low,high", [(2 * 500 / 3, 4 * 500 / 3), (2.0, 4.0), (2 ** 53 / 3, 2 ** 54 / 3),
                                      (2.0 ** 54, 2.0 ** 55)])
def test_gaussiank_band_on_the_device_is_the_hosts_at_its_bounds(low, high):
    """The factor of a correction decided on the device (an int64 count left there) is the
    host's for every count around both bounds: fractional bounds, whole ones (a count equal to a
    bound is in the band), and bounds past float32's integers and past float64's (where a count
    cast to float64 would round onto the bound)."""
    for bound in (low, high):
        for count in range(int(bound) - 2, int(bound) + 3):
            expected = torch_backend.band(count, low, high, 0.5, 1.5)
            on_device = torch_backend.band(torch.tensor(count), low, high, 0.5, 1.5)
            assert on_device.dtype == torch.float64 and float(on_device) == expected, (low, high, count)


@pytest.mark.parametrize("count", [5, torch.tensor(5)])
def test_a_band_whose_bounds_are_out_of_order_is_refused(count):
    """On the device the count's place among the band's bounds picks the factor: bounds out of
    order would place it nowhere meaningful, so they are refused by name, on the host too."""
    with pytest.raises(ValueError, match="low .* must not exceed high"):
        torch_backend.band(count, 10.0, 2.0, 0.5, 1.5)


@pytest.mark.parametrize("framework", BACKENDS)
@pytest.mark.parametrize("threshold", [0.25, 0.5, 0.75, 1.0])
def test_the_hard_threshold_scan_selects_every_coordinate_at_or_above_it(framework, threshold):
    """Thresholds exactly at the tied magnitudes (``>=``, not ``>``), with a partial last block."""
    B, tensor = BACKENDS[framework]
    x = tied(40_003, 4)
    idx = B.select(tensor(x), threshold, 1024)
    np.testing.assert_array_equal(B.to_numpy(idx), np.flatnonzero(np.abs(x) >= threshold))


@pytest.mark.parametrize("framework,accelerated", PATHS)
@pytest.mark.parametrize("seed", range(4))
def test_gtopk_merge_breaks_magnitude_ties_to_the_lower_index_on_both_backends(framework, accelerated, seed):
    """Two sets of tied values sharing some indices (among them -0.0 and index 0): the sum, then
    the k largest, ties to the lower index, as the reference merge, bitwise; and which of the
    first set's indices the merge kept (``isin``). PyTorch's accelerators' paths (a coalesce
    padded to a fixed size, a binary-search ``isin``) too."""

    B, tensor = BACKENDS[framework]
    rng = np.random.default_rng(seed)
    k = 40
    sets = []
    for _ in range(2):
        indices = np.sort(np.concatenate([[0], rng.choice(np.arange(1, 120), k - 1, replace=False)])).astype(np.int64)
        values = rng.integers(-2, 3, size=k).astype(np.float32)
        values[values == 0] = np.where(rng.random(int((values == 0).sum())) < 0.5, -0.0, 0.0)
        sets.append((indices, values))
    with accelerator_paths() if accelerated else contextlib.nullcontext():
        a, b = (SparseSet(tensor(i), tensor(v)) for i, v in sets)
        merged = merge(B, a, b, k)
        kept = B.to_numpy(B.isin(a.idx, merged.idx))
    expected = merge_sets(*[{int(i): (v, frozenset()) for i, v in zip(*s)} for s in sets], k)
    np.testing.assert_array_equal(B.to_numpy(merged.idx), sorted(expected))
    np.testing.assert_array_equal(B.to_numpy(merged.val).view(np.int32),
                                  np.array([expected[i][0] for i in sorted(expected)], dtype=np.float32).view(np.int32))
    np.testing.assert_array_equal(kept, np.isin(sets[0][0], sorted(expected)))


@pytest.mark.parametrize("framework,dtype", [("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"),
                                             ("tensorflow", "float32"), ("tensorflow", "float16")])
@pytest.mark.parametrize("budget", [1, 7, 40])
def test_candidates_filter_to_exactly_the_pick_on_both_backends(framework, dtype, budget):
    """The histogram controller's candidates (MiCRO, ExDyna) of a slice with a partial last
    block and many tied magnitudes: every coordinate at or above the bar, with its magnitude
    (float32 on the host, bfloat16 included), and for thresholds below, at and above the bar
    and at the tied magnitudes exactly the slice's ``|x| >= threshold``, as a pick selects."""
    B, tensor = BACKENDS[framework]
    x = tied(20_011, 6) * np.random.default_rng(7).choice([1.0, 0.5, 0.125], 20_011).astype(np.float32)
    start, end = 301, 19_950
    if framework == "torch":
        buffer = torch.from_numpy(x).to(getattr(torch, dtype))
        magnitudes = buffer.abs().float().numpy()
    else:
        buffer = tf.cast(tf.constant(x), dtype)
        magnitudes = np.abs(buffer.numpy()).astype(np.float32)
    scanned = B.scan(buffer, start, end, 64)
    candidates = Candidates.collect(B, scanned, budget)
    positions = np.arange(start, end)
    expected = positions[magnitudes[start:end] >= candidates.bar]
    np.testing.assert_array_equal(B.to_numpy(candidates.indices), expected)
    np.testing.assert_array_equal(B.to_numpy(candidates.magnitudes).astype(np.float32), magnitudes[expected])
    for threshold in (candidates.bar / 2, candidates.bar, candidates.bar * 1.5, 0.375, 0.75):
        for filterable in ([True, False] if threshold >= candidates.bar else [False]):
            selected = B.to_numpy(candidates.select(threshold, filterable))
            np.testing.assert_array_equal(selected, positions[magnitudes[start:end] >= threshold],
                                          err_msg=f"{threshold} {filterable}")
            np.testing.assert_array_equal(selected, B.to_numpy(B.pick(scanned, threshold)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("budget", [1, 40, 150, 10_000])
def test_the_accelerators_bar_and_histogram_equal_the_hosts(dtype, budget):
    """PyTorch's accelerator paths (bars and histograms computed on the device, read by no one)
    give bitwise the host's NumPy results: the candidates' two bars in either order (from one
    ``topk`` of the 307 blocks' maxima when both budgets are below that, else a bar each; the
    budget of 150 and its triple straddle it), the local histograms of the
    coordinates at or above two bars in the first step's window and in a fine one around a
    threshold, built on the device (every rank's mark), DGC's threshold and its lowered ones.
    Run on CPU tensors through ``accelerator_paths``."""
    from horovod_sparse.methods.micro.controllers import HistogramWindow

    B = torch_backend
    x = tied(20_011, 3) * np.random.default_rng(8).standard_normal(20_011).astype(np.float32)
    buffer = torch.from_numpy(x).to(getattr(torch, dtype))
    scanned = B.scan(buffer, 301, 19_950, 64)
    host_bars = [B.candidate_bar(scanned, budget), B.candidate_bar(scanned, 3 * budget)]
    hosts = [Candidates.collect(B, scanned, b) for b in (budget, 3 * budget)]
    with accelerator_paths():
        device_bars = B.candidate_bars(scanned, (budget, 3 * budget))
        backwards = B.candidate_bars(scanned, (3 * budget, budget))
    assert all(isinstance(bar, float) for bar in host_bars) and device_bars.levels.tolist() == host_bars
    assert backwards.levels.tolist() == host_bars[::-1]
    fine_centre = torch.tensor([0.3], dtype=torch.float32)
    for window in (HistogramWindow.everything(), HistogramWindow.around(0.3)):
        for rank, parts in ((0, 1), (2, 4)):
            expected = torch.cat([host.local_histogram(window, rank, parts) for host in hosts])
            with accelerator_paths():
                edges = (B.fine_edges(fine_centre.view(torch.int32)) if len(window) != len(HistogramWindow.everything())
                         else B.window_edges(window, scanned))
                computed = B.histograms_above(edges, scanned, device_bars, rank, parts)
            assert torch.equal(edges, torch.from_numpy(window.edges32()))
            assert computed.dtype == expected.dtype == torch.int32 and torch.equal(computed, expected)
            assert int(expected[len(window) + 1 + rank]) == window.edge_at_or_above(host_bars[0])
    with accelerator_paths():
        threshold = B.kth_magnitude(buffer[::7], 30)
        lowered = B.lowered_thresholds(threshold, 0.8, 10)
    assert isinstance(threshold, torch.Tensor) and float(threshold) == B.kth_magnitude(buffer[::7], 30)
    assert lowered.dtype == torch.float32
    assert lowered.tolist() == B.lowered_thresholds(B.kth_magnitude(buffer[::7], 30), 0.8, 10)


def _converse(plans, convert):
    """Run every simulated rank's histogram rounds in lockstep, each round's local histograms
    summed as the allreduce would (``convert``: to what the plans read back); the rounds' tags and
    every plan's result."""
    rounds, tags = [next(plan) for plan in plans], []
    while True:
        tags.append(rounds[0].tag)
        assert all(round_.tag == tags[-1] for round_ in rounds)
        summed = convert(torch.stack([round_.local for round_ in rounds]).sum(0).to(torch.int32))
        answers = []
        for plan in plans:
            try:
                answers.append(plan.send(summed))
            except StopIteration as finished:
                answers.append(finished)
        if isinstance(answers[0], StopIteration):
            return tags, [answer.value for answer in answers]
        rounds = answers


def _rounds_on_both_paths(x, k, parts, state):
    """The histogram controller's threshold for ``parts`` simulated ranks (rank ``r`` owning the
    ``r``-th equal partition of ``x``), through the host's rounds and through the accelerators'
    fixed rounds (on the CPU); asserts they agree bitwise (threshold, the state's flags, the
    rounds named) and returns the host's rounds."""
    import copy

    from horovod_sparse.methods.micro.controllers import HistogramController, histogram_threshold
    from horovod_sparse.methods.micro.device_rounds import RoundFlags, device_histogram_threshold, rounds_taken
    from horovod_sparse.methods.micro.partitions import equal_bounds

    B, bounds = torch_backend, equal_bounds(x.size, parts)
    scans = [B.scan(torch.from_numpy(x), bounds[p], bounds[p + 1], 32) for p in range(parts)]
    states = [copy.deepcopy(state) for _ in range(parts)]
    tags, host = _converse([histogram_threshold(HistogramController(), states[r], k, parts, r, r,
                                                lambda budget, s=scans[r]: Candidates.collect(B, s, budget))
                            for r in range(parts)], lambda summed: summed.numpy())
    with accelerator_paths():
        _, device = _converse([device_histogram_threshold(B, HistogramController(), state, k, parts, r, r, scans[r])
                               for r in range(parts)], lambda summed: summed)
    for rank, ((reading, flags), on_host, settled) in enumerate(zip(device, host, states)):
        assert float(reading.threshold) == on_host.threshold == settled.threshold, rank
        assert [bool(f) for f in reading[1:]] == [settled.clamped, settled.short, settled.coarse], rank
        assert rounds_taken(RoundFlags(*(bool(f) for f in flags))) == on_host.tags == tags, rank
    return tuple(tags)


def test_the_accelerators_two_bars_come_from_one_topk():
    """Where both budgets are below the number of blocks, the two bars and what reaches them take
    five dispatched operations once their constants are made (one ``topk`` of the block maxima, a
    strided view of both places, a clamp, the comparison), six when the wide budget is the
    smaller (a ``flip``); a ``kthvalue`` and a clamp a bar took seven. Their values: above."""
    buffer = torch.from_numpy(np.random.default_rng(4).standard_normal(20_011).astype(np.float32))
    with accelerator_paths():
        scanned = torch_backend.scan(buffer, 301, 19_950, 64)  # 307 blocks
        for budgets, most in (((40, 120), 5), ((120, 40), 6)):
            first = torch_backend.candidate_bars(scanned, budgets)
            with DispatchedOps() as ops:
                again = torch_backend.candidate_bars(scanned, budgets)
            assert ops.count <= most and torch.equal(first.levels, again.levels), (budgets, ops.count)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dgc_one_pass_counts_are_a_pass_per_threshold_and_the_hosts(dtype):
    """DGC's counts on an accelerator (``counts_at``: each magnitude's place among the lowered
    thresholds, a histogram of the places) are those of a pass per threshold (``counts_at_each``,
    the plain twin, bitwise) and of the host's ``count_reaching`` at each threshold: on magnitudes
    equal to a threshold, zeros, and thresholds clamped to the smallest (all equal)."""
    B = torch_backend
    values = np.concatenate([tied(10_007, 5), np.random.default_rng(9).standard_normal(10_004).astype(np.float32)])
    buffer = torch.from_numpy(values).to(getattr(torch, dtype))
    scanned = B.scan(buffer, 0, buffer.numel(), 64)
    for first in (0.75, 0.5, float(buffer.abs().max()), 1e-45):
        with accelerator_paths():
            thresholds = B.lowered_thresholds(torch.tensor(first), 0.8, 10)
            counts = B.counts_at(scanned, thresholds)
        assert torch.equal(counts, counts_at_each(scanned.magnitudes, thresholds))
        assert counts.tolist() == [B.count_reaching(scanned, t) for t in thresholds.tolist()], first


@pytest.mark.parametrize("k", [400, 10_485_764, 10_485_766])
def test_dgc_first_settled_on_the_device_is_the_hosts_at_its_bounds(k):
    """DGC's choice among its counted thresholds on the device (float32 counts, as ``counts_at``
    makes them below 2**24 magnitudes) is the host's for counts around both bounds, ``0.8 k`` and
    ``1.3 k``: also where a fractional bound lies within half a unit of a count past 2**23, so
    that float32 would round it onto the count (k = 10,485,764: 0.8 k = 8,388,611.2)."""
    low, high = 0.8 * k, 1.3 * k
    thresholds = [1.0, 0.75, 0.5]
    for bound in (low, high):
        for count in range(int(bound) - 2, int(bound) + 3):
            for counts in ([count, count + 3, count + 6], [count - 6, count, count + 6]):
                expected = torch_backend.first_settled(thresholds, counts, low, high, 2)
                on_device = torch.tensor(counts, dtype=torch.float32)
                chosen, cut = torch_backend.first_settled(torch.tensor(thresholds), on_device, low, high, 2)
                assert (float(chosen), bool(cut)) == expected, (k, counts)


def test_dgc_first_settled_on_the_device_is_the_hosts_for_every_rising_sequence():
    """Every non-decreasing sequence of counts (as ``counts_at`` makes them) from values on both
    sides of both bounds (k = 10: 0.8 k = 8, 1.3 k = 13), for 0 to 3 checks: the device's choice
    is the host's, also where none of the checked counts settles and the unchecked last one
    exceeds ``1.3 k`` (never cut) and where nothing is checked."""
    import itertools

    low, high, values = 8.0, 13.0, (7, 8, 13, 14)
    for checks in range(4):
        thresholds = [0.8 ** i for i in range(checks + 1)]
        for counts in itertools.combinations_with_replacement(values, checks + 1):
            expected = torch_backend.first_settled(thresholds, list(counts), low, high, checks)
            chosen, cut = torch_backend.first_settled(torch.tensor(thresholds, dtype=torch.float32),
                                                      torch.tensor(counts, dtype=torch.float32), low, high, checks)
            assert (float(chosen), bool(cut)) == (float(np.float32(expected[0])), expected[1]), (checks, counts)


def test_dgc_one_pass_counts_stay_exact_beyond_the_integers_of_float32():
    """Above 2**24 magnitudes at one threshold the counts are still exact (float64 counting)."""
    ones = torch.ones(2 ** 24 + 3)
    with accelerator_paths():
        scanned = torch_backend.scan(ones, 0, ones.numel(), 1024)
        counts = torch_backend.counts_at(scanned, torch_backend.lowered_thresholds(torch.tensor(1.0), 0.8, 2))
    assert counts.tolist() == [2 ** 24 + 3] * 3


def test_the_accelerators_histogram_rounds_settle_on_the_hosts_threshold():
    """The accelerators' histogram rounds (always two allreduces, every reading made on the
    device and the host's choice among them made there too) settle on bitwise the threshold, the
    flags and the named rounds the host's conditional rounds do, in every order the host takes
    them: one round; a fine one after a coarse reading; a wide one after a reading short of k (a
    partition holding most of the large values), alone or followed by a fine one; and a wide one
    after a fine reading that stopped short (the first step's window, a bar just below one of its
    edges and a pile just above it), for 1 to 3 ranks."""
    from horovod_sparse.methods.micro.controllers import ThresholdState

    seen = set()
    for seed in range(24):
        rng = np.random.default_rng(seed)
        parts, numel, k = 2 + seed % 2, 9000, int(rng.integers(20, 300))
        x = (rng.standard_normal(numel) * 0.1).astype(np.float32)
        pile, level = int(rng.integers(k // 2, 3 * k)), rng.uniform(0.2, 0.9)
        x[rng.choice(numel // parts, pile, replace=False)] = rng.uniform(level, level * 1.02, pile)
        x[:numel // parts] *= rng.uniform(1, 8)
        state = ThresholdState(threshold=rng.uniform(0.3, 3) * level, steps=5, last_union=k,
                               last_counts=[k // parts] * parts)
        seen.add(_rounds_on_both_paths(x, k, parts, state))
    spread = np.abs(np.random.default_rng(2).standard_normal(100_000)).astype(np.float32)
    seen.add(_rounds_on_both_paths(spread, 100, 2, ThresholdState(threshold=float(np.sort(spread)[-100]), steps=5,
                                                                  last_union=100, last_counts=[50, 50])))
    x = np.random.default_rng(0).uniform(0, 1e-3, 32_000).astype(np.float32)
    blocks = np.random.default_rng(1).permutation(1000)
    x[blocks[:150] * 32 + 5], x[blocks[150:300] * 32 + 7] = np.float32(1.00001), np.float32(0.9999)
    seen.add(_rounds_on_both_paths(x, 100, 1, ThresholdState()))
    assert seen == {("histogram",), ("histogram", "histogram.fine"), ("histogram", "histogram.wide"),
                    ("histogram", "histogram.wide", "histogram.fine"),
                    ("histogram", "histogram.fine", "histogram.wide")}


def test_the_accelerators_reading_of_a_histogram_is_the_hosts():
    """``read_histograms`` on the device reads bitwise what ``threshold_from_histogram`` reads
    off the same summed histograms (threshold, outside, short, coarse), whichever way it ends:
    above the window, at the first or a later rank's bar, interpolated in a bin; and a fine
    window built on the device from a threshold left there is ``HistogramWindow.around``'s,
    at the ends of the float32 range too."""
    from horovod_sparse.methods.micro.controllers import HistogramWindow, threshold_from_histogram

    B, rng, endings = torch_backend, np.random.default_rng(5), set()
    for window in (HistogramWindow.everything(), HistogramWindow.around(0.01)):
        edges = torch.from_numpy(window.edges32())
        for trial in range(150):  # the first: no bar in the window and fewer than the target in it;
            # the second: a bar above the window
            counts = rng.integers(0, 40, len(window) + 1) * (rng.random(len(window) + 1) < 0.05)
            marks = rng.integers(0, len(window) + 1, 3) * (rng.random(3) < 0.7) * (trial > 0)
            marks[0] = len(window) if trial == 1 else marks[0]
            summed = np.concatenate([counts, marks]).astype(np.int32)
            target = int(rng.integers(1, max(2, counts.sum() + 5))) if trial else int(counts.sum()) + 1
            expected = threshold_from_histogram(window, summed, target)
            with accelerator_paths():
                read = B.unpack_reading(B.read_histograms(edges, torch.from_numpy(summed), target, 1).view(-1))
            assert (float(read.threshold), bool(read.outside), bool(read.short), bool(read.coarse)) == expected
            ending = "first edge" if expected.outside and expected.threshold == float(edges[0]) else expected[1:]
            endings.add(ending if trial else "first edge")
    assert endings >= {"first edge", (True, False, False), (False, True, False), (False, False, True),
                       (False, False, False)}
    for centre in (1e-44, 3e-38, 0.3, 3e38):
        with accelerator_paths():
            edges = B.fine_edges(torch.tensor([centre, 0, 0, 0], dtype=torch.float32).view(torch.int32))
        assert torch.equal(edges, torch.from_numpy(HistogramWindow.around(centre).edges32()))


def test_the_figures_left_on_a_device_are_read_in_order_and_exactly():
    """``read_scalars`` (one host read per device, the tensors gathered by dtype) gives every
    tensor's value in the order given, whatever the dtypes interleaved: ints for integer and
    bool tensors, floats for floating ones, exactly (float32 thresholds, float64, int64 counts
    up to 2**53), and lists for 1-D tensors; compared with each tensor's own ``tolist()``."""
    from horovod_sparse.torch_core.device_figures import read_scalars

    scalars = [torch.tensor(3), torch.tensor(True), torch.tensor(0.1, dtype=torch.float32), torch.tensor([7, 2**53]),
               torch.tensor(False), torch.tensor(1 / 3, dtype=torch.float64), torch.tensor([0.5, -1e-30]),
               torch.tensor(-4), torch.tensor([], dtype=torch.int64), torch.tensor(2.5, dtype=torch.bfloat16)]
    read = read_scalars(scalars)
    assert read == [t.tolist() if t.dim() else t.item() for t in scalars]
    assert [type(v) for v in read] == [int, int, float, list, int, float, list, int, list, float]
