"""The block-scan selection (``horovod_sparse.torch_core.selection``) against ``torch.where`` over
``|x|``: same indices, ascending, for any slice, block length (power of two or not, partial last
block), threshold (reached or, ``strict``, exceeded; ties included) and candidates that filter to
exactly the same set; the scan's moments against NumPy's mean and deviation. The exact top-k
built on it is tested in ``tests/torch_core/test_top_k.py``."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from horovod_sparse.methods.micro.candidates import Candidates
from horovod_sparse.torch import backend
from horovod_sparse.common.thresholds import SCAN_CHUNK
from horovod_sparse.torch_core.selection import (accelerator_paths, count_reaching, host_pass, pick_capped,
                                                 pick_with_magnitudes, scan, select)


def naive(x: torch.Tensor, start: int, end: int, threshold: float, strict: bool = False) -> torch.Tensor:
    magnitudes = x[start:end].abs()
    return torch.nonzero(magnitudes > threshold if strict else magnitudes >= threshold).squeeze(1) + start


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 3000), block=st.sampled_from([1, 3, 32, 48, 64, 100, 512]),
       cut=st.tuples(st.floats(0, 1), st.floats(0, 1)), quantile=st.floats(0, 1), seed=st.integers(0, 2**31),
       ties=st.booleans(), strict=st.booleans())
def test_pick_is_exactly_the_threshold_set(numel, block, cut, quantile, seed, ties, strict):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    if ties:  # the threshold is then one of few magnitudes, held by many coordinates
        x = x.mul(2).round()
    start, end = sorted(int(c * numel) for c in cut)
    if start == end:
        end = min(numel, start + 1)
        start = end - 1
    threshold = float(torch.quantile(x[start:end].abs(), quantile))
    indices, magnitudes = pick_with_magnitudes(scan(x, start, end, block), threshold, strict)
    expected = naive(x, start, end, threshold, strict)
    assert torch.equal(indices, expected)
    assert torch.equal(magnitudes, x[expected].abs())


@pytest.mark.parametrize("block", [64, 100])
@pytest.mark.parametrize("strict", [False, True])
def test_a_host_pass_of_many_slabs_counts_and_picks_the_threshold_set(block, strict):
    """A threshold that most blocks' maxima reach is read :data:`SCAN_CHUNK` elements of blocks
    at a time (three slabs and a partial last block here; ties included): its count and its
    pick are the threshold set's, the pick after a count at the same threshold too (such a pass
    keeps its count, not its slabs: the pick reads them again), and so is a count at a lower
    threshold and the pick at the higher one after it."""
    numel = 3 * SCAN_CHUNK + 77
    x = torch.randn(numel, generator=torch.Generator().manual_seed(block)).mul(4).round()  # few magnitudes
    start, end = 5, numel - 3
    scanned = scan(x, start, end, block)
    high, low = 2.0, 1.0
    for counted, picked in ((high, high), (low, high)):
        expected = naive(x, start, end, counted, strict)
        assert host_pass(scanned, counted, torch.gt if strict else torch.ge).count() == expected.numel()
        expected = naive(x, start, end, picked, strict)
        indices, magnitudes = pick_with_magnitudes(scanned, picked, strict)
        assert expected.numel() > SCAN_CHUNK and torch.equal(indices, expected)
        assert torch.equal(magnitudes, x[expected].abs())


@pytest.mark.parametrize("counted_first", [False, True])
def test_a_capped_host_pick_of_many_slabs_is_the_cut_threshold_set(counted_first):
    """A capped pick on the host reads a pass's slabs only until its capacity is found: its
    indices are the threshold set's lowest ``capacity``, and what it sends and leaves over are
    counted over the whole set, with the threshold counted before (the count kept with the pass)
    or not; capacities within the first slab, past it, of all but a few and past the whole set."""
    numel = 3 * SCAN_CHUNK + 77
    x = torch.randn(numel, generator=torch.Generator().manual_seed(11)).mul(4).round()
    start, end, threshold = 5, numel - 3, 2.0
    expected = naive(x, start, end, threshold)
    for capacity in (1000, SCAN_CHUNK, expected.numel() - 5, expected.numel(), expected.numel() + 5):
        scanned = scan(x, start, end, 64)
        if counted_first:
            assert count_reaching(scanned, threshold) == expected.numel()
        capped = pick_capped(scanned, threshold, capacity)
        sent = min(capacity, expected.numel())
        assert torch.equal(capped.idx, expected[:capacity]) and not capped.padded
        assert (capped.sent, capped.overflow) == (sent, expected.numel() - sent)


@settings(max_examples=30, deadline=None)
@given(numel=st.integers(64, 5000), budget=st.integers(1, 50), factor=st.floats(0.5, 3.0), seed=st.integers(0, 2**31))
def test_candidates_select_what_pick_selects(numel, budget, factor, seed):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    scanned = scan(x, 0, numel, 32)
    candidates = Candidates.collect(backend, scanned, budget)
    threshold = candidates.bar * factor
    for filterable in ([True, False] if threshold >= candidates.bar else [False]):
        assert torch.equal(candidates.select(threshold, filterable), naive(x, 0, numel, threshold))
    assert torch.equal(select(x, threshold, 32), naive(x, 0, numel, threshold))


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 300_000), block=st.sampled_from([1, 3, 32, 64, 512]), shift=st.floats(-3, 3),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]), seed=st.integers(0, 2**31))
def test_scan_moments_give_the_mean_and_deviation(numel, block, shift, dtype, seed):
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) + shift).to(dtype)
    start = numel // 3
    mean, std = scan(x, start, numel, block, moments=True).mean_std()
    exact = x[start:].double().numpy()
    tolerance = 1e-12 if dtype == torch.float64 else 1e-4  # single-precision chunk sums, |mean| <= 3 std
    assert mean == pytest.approx(exact.mean(), rel=tolerance, abs=tolerance)
    assert std == pytest.approx(exact.std(ddof=1) if exact.size > 1 else 0.0, rel=tolerance, abs=tolerance)


def test_the_accelerators_pick_after_a_count_is_at_its_own_threshold():
    """On the accelerators' paths a pick at the threshold just counted takes that count's mask
    and count (the same objects, no second pass: Gaussian-k's final pick), and a pick at another
    threshold, even one of equal value, compares the slice again: each pick is the threshold set
    of its own threshold, cut to the capacity and counted, whatever was counted before."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(3))
    capacity = 500
    with accelerator_paths():
        scanned = scan(x, 1000, 4000, 64)
        low, high = torch.tensor(0.5), torch.tensor(1.5)
        for counted, picked in ((low, low), (low, high), (high, low), (high, torch.tensor(1.5))):
            found = count_reaching(scanned, counted)
            capped = pick_capped(scanned, picked, capacity)
            expected = naive(x, 1000, 4000, float(picked))
            assert int(found) == naive(x, 1000, 4000, float(counted)).numel()
            sent = min(capacity, expected.numel())
            assert torch.equal(capped.idx[:sent], expected[:sent]) and bool((capped.idx[sent:] == -1).all())
            assert (int(capped.sent), int(capped.overflow)) == (sent, expected.numel() - sent)
            assert (scanned.last_reached[0][2] is found) == (picked is counted)  # kept, or replaced
