"""Threshold controllers of MiCRO/ExDyna: the published rule step by step, and the histogram
controller's pieces (windows, candidate bars, the threshold read off a summed histogram)."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from horovod_sparse.common.thresholds import SMALLEST_THRESHOLD, as_float32, scan_block_size
from horovod_sparse.methods.micro.controllers import (CANDIDATE_MARGIN, HistogramController, HistogramWindow,
                                                      PaperController, ThresholdState, candidate_bar, candidate_budget,
                                                      histogram_threshold, local_histogram, make_controller,
                                                      paper_factor, reaches_bar, threshold_from_histogram)

ratios = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@st.composite
def magnitude_arrays(draw, max_size=300):
    """Non-negative float32 arrays: log-normal of any spread, with zeros and exact ties mixed in."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    size = draw(st.integers(0, max_size))
    values = np.exp(draw(st.floats(-20, 20)) + draw(st.floats(0, 6)) * rng.standard_normal(size))
    values[rng.random(size) < draw(st.floats(0, 0.5))] = 0.0
    ties = rng.random(size) < draw(st.floats(0, 0.3))
    if ties.any():
        values[ties] = values[ties][0]
    return values.astype(np.float32)


@pytest.mark.parametrize("ratio,published,intended", [
    (2.0, 1.005, 1.005), (1.1000001, 1.005, 1.005), (1.1, 1.00125, 1.00125), (1.0001, 1.00125, 1.00125),
    (1.0, 1.00125, 0.9987), (0.95, 1.00125, 0.9987), (0.90900001, 1.00125, 0.9987), (0.909, 0.995, 0.995),
    (0.0, 0.995, 0.995)])
def test_paper_factor_bands(ratio, published, intended):
    assert paper_factor(ratio) == published
    assert paper_factor(ratio, intended_band=True) == intended


@given(st.lists(ratios, min_size=1, max_size=3))
def test_paper_factor_bounded_and_monotone(values):
    for intended in (False, True):
        factors = [paper_factor(r, intended) for r in sorted(values)]
        assert all(0.995 <= f <= 1.005 for f in factors)
        assert factors == sorted(factors)


@given(k=st.integers(1, 10 ** 7), unions=st.lists(st.integers(0, 10 ** 7), max_size=40),
       intended=st.booleans())
def test_paper_controller_reproduces_the_published_rule_step_by_step(k, unions, intended):
    """Start at 1/(2 sqrt(k)), then x1.005 / x1.00125 / x0.995 by k_prev/k, compounded in double."""
    controller = make_controller("paper_intent" if intended else "paper")
    state = ThresholdState()
    expected = 1.0 / (2.0 * math.sqrt(k))
    assert controller.window(state) is None
    assert controller.next_threshold(state, k, None) == as_float32(expected)
    for union in unions:
        state.record([union])
        ratio = union / k
        if ratio > 1.1:
            expected *= 1.005
        elif ratio > 0.909:
            expected *= 1.00125 if (ratio > 1.0 or not intended) else 0.9987
        else:
            expected *= 0.995
        assert controller.next_threshold(state, k, None) == as_float32(expected)
        assert state.threshold == expected


def test_as_float32_rounds_and_never_reaches_zero():
    assert as_float32(0.1) == float(np.float32(0.1))
    assert as_float32(0.0) == SMALLEST_THRESHOLD > 0
    assert as_float32(1e-60) == SMALLEST_THRESHOLD


@pytest.mark.parametrize("density,block", [(0.001, 64), (0.01, 32), (0.5, 32), (0.0001, 512), (1e-7, 512)])
def test_scan_block_size(density, block):
    assert scan_block_size(density) == block


def test_fine_window_is_dense_next_to_the_centre_and_spans_four_octaves():
    window = HistogramWindow.around(0.05)
    edges = window.edges()
    assert np.all(np.diff(edges) > 0) and edges[0] > 0 and np.isfinite(edges[-1])
    centre = int(np.searchsorted(edges, np.float32(0.05)))
    assert edges[centre] == np.float32(0.05)
    step = edges[centre + 1] / edges[centre] - 1  # 2**12 bit patterns: 1/4096 to 1/2048 of an octave
    assert (2 ** (1 / 2048) - 1) / 2 < step < 2 ** (1 / 2048) - 1
    assert edges[-1] / 0.05 > 16 and 0.05 / edges[0] > 16
    assert len(window) < 250  # about 1 KB of int32 counts


@pytest.mark.parametrize("centre", [1e-44, 3e38, 1.0])
def test_windows_stay_positive_and_finite_at_the_ends_of_the_range(centre):
    for window in (HistogramWindow.around(centre), HistogramWindow.everything()):
        edges = window.edges()
        assert np.all(np.diff(edges) > 0) and edges[0] > 0 and np.all(np.isfinite(edges))


@given(magnitude_arrays(), st.sampled_from([1e-3, 1.0, 7.5]))
def test_histogram_counts_by_edges(values, centre):
    window = HistogramWindow.around(centre)
    counts = window.histogram(values)
    edges = window.edges()
    values = np.array(values, dtype=np.float64)
    expected = [np.sum(values < edges[0])]
    expected += [np.sum((values >= lo) & (values < hi)) for lo, hi in zip(edges[:-1], edges[1:])]
    expected += [np.sum(values >= edges[-1])]
    np.testing.assert_array_equal(counts, expected)


def _global_histogram(window, parts_values, budgets, block):
    """Sum of local_histogram over ranks whose magnitudes are ``parts_values``; also the bars."""
    total, bars = 0, []
    for rank, values in enumerate(parts_values):
        padded = np.concatenate([values, np.zeros(-len(values) % block, dtype=np.float32)])
        maxima = padded.reshape(-1, block).max(1) if padded.size else padded
        bar = candidate_bar(maxima, budgets[rank])
        bars.append(bar)
        total = total + local_histogram(window, values[values >= bar], bar, rank, len(parts_values)).astype(np.int64)
    return total, bars


@settings(max_examples=60)
@given(st.lists(magnitude_arrays(), min_size=1, max_size=4), st.integers(1, 60), st.sampled_from([1, 4, 32]),
       st.booleans())
def test_threshold_read_off_the_summed_histogram(parts, k, block, fine):
    """At the threshold the global tail crosses k between the two surrounding edges (or stops,
    short of k, at the highest rank's bar), and the threshold is at or above every rank's bar
    (so filtering the candidates is exact), unless the answer fell outside the window."""
    everything = np.concatenate(parts)
    positive = everything[everything > 0]
    window = HistogramWindow.around(float(np.median(positive)) if positive.size else 1.0) if fine \
        else HistogramWindow.everything()
    budgets = [candidate_budget(k, len(parts), [], rank) for rank in range(len(parts))]
    histogram, bars = _global_histogram(window, parts, budgets, block)
    threshold, outside, short, _ = threshold_from_histogram(window, histogram, k)
    count = int(np.sum(everything >= threshold))
    edges = window.edges()
    if outside:
        assert threshold in (float(edges[0]), float(edges[-1]))
        return
    assert threshold >= max(bars)
    below = edges[edges <= threshold].max()
    above = edges[edges > threshold].min() if np.any(edges > threshold) else np.inf
    crossed = np.sum(everything >= above) < k <= np.sum(everything >= below)
    stopped = count < k and threshold == below  # at the highest rank's bar
    assert (crossed and not short) or (stopped and short)


@given(magnitude_arrays(), st.integers(1, 40), st.integers(1, 40))
def test_threshold_is_non_increasing_in_the_target(values, k1, k2):
    window = HistogramWindow.around(1.0)
    histogram = local_histogram(window, values, SMALLEST_THRESHOLD, 0, 1)
    low, high = sorted((k1, k2))
    assert threshold_from_histogram(window, histogram, low).threshold >= \
        threshold_from_histogram(window, histogram, high).threshold


def test_threshold_is_exact_when_values_are_spread_over_fine_bins():
    rng = np.random.default_rng(0)
    values = np.abs(rng.standard_normal(100_000)).astype(np.float32)
    k = 100
    window = HistogramWindow.around(float(np.sort(values)[-k]) * 1.01)
    histogram = local_histogram(window, values, SMALLEST_THRESHOLD, 0, 1)
    threshold, outside, short, _ = threshold_from_histogram(window, histogram, k)
    assert not outside and not short and abs(int(np.sum(values >= threshold)) - k) <= 2


def test_threshold_outside_the_window_is_clamped_and_flagged():
    window = HistogramWindow.around(1.0)
    edges = window.edges()
    far_above = local_histogram(window, np.full(10, 1e6, dtype=np.float32), SMALLEST_THRESHOLD, 0, 1)
    assert threshold_from_histogram(window, far_above, 5)[:3] == (float(edges[-1]), True, False)
    far_below = local_histogram(window, np.full(10, 1e-9, dtype=np.float32), SMALLEST_THRESHOLD, 0, 1)
    assert threshold_from_histogram(window, far_below, 5)[:3] == (float(edges[0]), True, False)


def test_threshold_never_goes_below_the_highest_bar_and_says_so():
    """A rank whose bar is high reports nothing below it: the threshold stops at its bar's edge,
    short of k, instead of guessing; counted from a wide budget, the answer is found."""
    window = HistogramWindow.around(1.0)
    values = np.linspace(0.5, 2.0, 100).astype(np.float32)
    low = local_histogram(window, values, SMALLEST_THRESHOLD, 0, 2)
    high = local_histogram(window, values[values >= 1.5], 1.5, 1, 2)
    threshold, outside, short, _ = threshold_from_histogram(window, low + high, 150)
    assert threshold >= 1.5 and short and not outside
    wide = local_histogram(window, values, SMALLEST_THRESHOLD, 1, 2)
    threshold, outside, short, _ = threshold_from_histogram(window, low + wide, 150)
    assert not short and not outside and np.sum(values >= threshold) * 2 == pytest.approx(150, abs=4)


class _AllCandidates:
    """Every value is a candidate (the bar is the smallest positive float32)."""

    def __init__(self, values: np.ndarray) -> None:
        self.bar, self.values = SMALLEST_THRESHOLD, values

    def local_histogram(self, window, rank, parts) -> np.ndarray:
        return local_histogram(window, self.values, self.bar, rank, parts)


def _run_rounds(state, values, k):
    """One rank's ``histogram_threshold`` conversation; the tags and the result."""
    plan = histogram_threshold(HistogramController(), state, k, 1, 0, 0, lambda budget: _AllCandidates(values))
    round_, tags = next(plan), []
    while True:
        tags.append(round_.tag)
        try:
            round_ = plan.send(round_.local)
        except StopIteration as finished:
            return tags, finished.value


def test_a_pile_up_in_a_coarse_bin_is_counted_again_in_a_fine_window():
    """Error feedback piles residuals up just below an earlier threshold. Half an octave from the
    last threshold the window's bins are wide; when one of them holds most of the answer, the
    controller counts the same candidates again in a fine window around its first reading and
    lands within 1% of k (the first reading alone is off by more than 5%)."""
    rng = np.random.default_rng(1)
    tail = np.abs(rng.standard_normal(200_000)).astype(np.float32) * 0.1
    pile = rng.uniform(0.70, 0.72, 900).astype(np.float32)  # 0.5 octave below the last threshold
    values, k = np.concatenate([tail, pile]), 500
    state = ThresholdState(threshold=1.0, steps=5, last_union=k, last_counts=[k])
    first = threshold_from_histogram(HistogramController().window(state),
                                     local_histogram(HistogramController().window(state), values,
                                                     SMALLEST_THRESHOLD, 0, 1), k)
    assert first.coarse and abs(np.sum(values >= first.threshold) / k - 1) > 0.05
    tags, (threshold, _, rounds, filterable) = _run_rounds(state, values, k)
    assert filterable  # every value is a candidate: the threshold is above the smallest bar
    assert tags == rounds == ["histogram", "histogram.fine"]
    assert abs(np.sum(values >= threshold) / k - 1) <= 0.01
    assert state.threshold == threshold and not state.coarse


def test_spread_values_take_one_round():
    rng = np.random.default_rng(2)
    values = np.abs(rng.standard_normal(100_000)).astype(np.float32)
    k = 100
    state = ThresholdState(threshold=float(np.sort(values)[-k]), steps=5, last_union=k, last_counts=[k])
    tags, (threshold, _, rounds, filterable) = _run_rounds(state, values, k)
    assert filterable  # every value is a candidate: the threshold is above the smallest bar
    assert tags == rounds == ["histogram"] and abs(int(np.sum(values >= threshold)) - k) <= 2


def test_candidate_bar_and_budget():
    maxima = np.array([5, 1, 4, 2, 3], dtype=np.float32)
    assert candidate_bar(maxima, 2) == 4.0
    assert candidate_bar(maxima, 5) == SMALLEST_THRESHOLD
    assert candidate_bar(np.zeros(10, dtype=np.float32), 3) == SMALLEST_THRESHOLD
    assert candidate_budget(100, 4, [], 0) == math.ceil(CANDIDATE_MARGIN * 50)
    assert candidate_budget(100, 4, [10, 40, 20, 30], 1) == math.ceil(CANDIDATE_MARGIN * 40)
    assert candidate_budget(100, 4, [10, 40, 20, 30], 2) == math.ceil(CANDIDATE_MARGIN * 25)
    assert candidate_budget(100, 4, [0, 1, 0, 0], 1) == math.ceil(CANDIDATE_MARGIN * 25)
    assert candidate_budget(100, 4, [0, 1, 0, 0], 1, wide=True) == math.ceil(CANDIDATE_MARGIN * 100)


def test_histogram_controller_windows():
    controller, state = HistogramController(), ThresholdState()
    assert len(controller.window(state)) == len(HistogramWindow.everything())
    values = np.linspace(0.1, 10.0, 1000).astype(np.float32)
    histogram = local_histogram(controller.window(state), values, SMALLEST_THRESHOLD, 0, 1)
    threshold = controller.next_threshold(state, 100, histogram)
    state.record([100])
    fine = controller.window(state)
    assert np.float32(threshold) in fine.edges().astype(np.float32)
    assert len(fine) < 250
    state.clamped = True
    assert len(controller.window(state)) == len(HistogramWindow.everything())
    with pytest.raises(ValueError, match="needs the global histogram"):
        controller.next_threshold(state, 100, None)


def test_unknown_controller_is_refused():
    with pytest.raises(ValueError, match="controller must be one of 'histogram', 'paper', 'paper_intent'"):
        make_controller("pi")
    assert isinstance(make_controller("paper"), PaperController)


def test_a_threshold_below_the_bar_is_not_filtered_from_the_candidates():
    """After a jump of the gradient's scale the fine window around the last threshold lies
    entirely below the candidates' bar (the 20 largest of 10,000 values): the controller answers
    the window's top edge, below the bar, and says the candidates may not be filtered at it
    (``filterable`` False: coordinates between it and the bar are not among them); read off the
    marks alone, it agrees with comparing the threshold with the bar."""
    values = np.abs(np.random.default_rng(3).standard_normal(10_000)).astype(np.float32) * 1e6
    bar = float(np.sort(values)[-20])

    class _Above:
        def local_histogram(self, window, rank, parts):
            return local_histogram(window, values[values >= bar], bar, rank, parts)

    state = ThresholdState(threshold=1e-3, steps=5, last_union=20, last_counts=[20])
    plan = histogram_threshold(HistogramController(), state, 20, 1, 0, 0, lambda budget: _Above())
    round_ = next(plan)
    with pytest.raises(StopIteration) as finished:
        plan.send(round_.local)
    threshold, _, _, filterable = finished.value.value
    assert threshold < bar and not filterable
    window = HistogramController().window(ThresholdState(threshold=1e-3, steps=5))
    summed = local_histogram(window, values[values >= bar], bar, 0, 1)
    for candidate in (float(window.edges()[-1]), bar, bar * 2):
        assert reaches_bar(window, summed, 0, candidate) == (candidate >= bar and summed[-1] < len(window))
