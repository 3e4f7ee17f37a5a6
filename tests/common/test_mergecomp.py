"""The MergeComp search and its scheduler, framework-free: driven by synthetic step-time
functions in one process."""
import math

import numpy as np
import pytest

from horovod_sparse.common.grouping import StepTimeline
from horovod_sparse.common.mergecomp import (MergeCompOptions, MergeCompResult, SplitSearch, Trial,
                                             coarse_candidates, runs_of, threshold_splits)
from horovod_sparse.common.mergecomp_scheduler import MergeCompScheduler


def run_search(sizes, cost, **options):
    search = SplitSearch(sizes, MergeCompOptions(**options))
    while search.candidate is not None:
        search.record(cost(search.candidate))
    return search


def overhead_and_overlap(sizes, per_group=1e-3, per_element=1e-7):
    """A step-time model with the MergeComp trade-off: each group costs a fixed overhead (kernel
    launches, a collective round), and the last group's communication cannot overlap anything."""
    def cost(splits):
        last = runs_of(list(range(len(sizes))), splits)[-1]
        return per_group * (len(splits) + 1) + per_element * sum(sizes[i] for i in last)
    return cost


def test_runs_and_threshold_splits():
    assert runs_of([4, 2, 0, 1, 3], (1, 3)) == [[4], [2, 0], [1, 3]]
    assert runs_of([0, 1], ()) == [[0, 1]]
    assert threshold_splits([5, 5, 5, 5, 5], 10) == (2, 4)
    assert threshold_splits([5, 5], 1) == (1,)


def test_coarse_candidates_span_whole_model_to_per_tensor():
    sizes = [100] * 8
    candidates = coarse_candidates(sizes, ratio=2.0)
    assert candidates[0] == () and candidates[-1] == tuple(range(1, 8))
    assert [len(c) + 1 for c in candidates] == [1, 2, 4, 8]
    assert len(set(candidates)) == len(candidates)


def test_search_measures_both_endpoints_first_and_returns_the_fastest_measured():
    sizes = [16] * 40 + [4096] * 10 + [65536] * 3
    search = run_search(sizes, overhead_and_overlap(sizes), ratio=4.0, patience=2, refine_budget=4)
    first, second = search.trials[0].splits, search.trials[1].splits
    assert first == tuple(range(1, len(sizes))) and second == ()
    assert search.best == min(search.trials, key=lambda t: t.seconds)
    assert search.best.seconds < search.trials[0].seconds and search.best.seconds < search.trials[1].seconds
    assert 1 < len(search.best.splits) + 1 < len(sizes)


def test_per_tensor_slow_by_construction_is_not_chosen():
    sizes = [8] * 60 + [2000]
    cost = overhead_and_overlap(sizes, per_group=5e-3, per_element=1e-9)
    search = run_search(sizes, cost)
    per_tensor = cost(tuple(range(1, len(sizes))))
    assert search.best.seconds <= per_tensor / 10
    assert search.best.splits != tuple(range(1, len(sizes)))


def test_refinement_moves_split_points_towards_a_better_grouping_within_budget():
    sizes = [100] * 20
    target = (4, 10, 17)

    def cost(splits):
        if len(splits) != len(target):
            return 10.0 + len(splits)
        return 1.0 + 0.1 * sum(abs(s - t) for s, t in zip(splits, target))

    coarse_only = run_search(sizes, cost, ratio=4.0, refine_budget=0)
    assert coarse_only.best.splits == (5, 10, 15)
    refined = run_search(sizes, cost, ratio=4.0, refine_budget=6)
    assert cost(refined.best.splits) < cost((5, 10, 15))
    assert len(refined.trials) <= len(coarse_only.trials) + 6


def test_identical_timings_give_identical_choices():
    """Every rank runs the search on the same agreed timings: the choices must match exactly."""
    sizes = [3, 700, 12, 12, 5000, 40, 40, 40, 9000, 1]
    noisy = {}

    def cost(splits):  # deterministic "noise" per candidate, as if measured and agreed
        return noisy.setdefault(splits, 1.0 + (hash(splits) % 1000) / 1000)

    a, b = run_search(sizes, cost), run_search(sizes, cost)
    assert a.trials == b.trials and a.best == b.best


def test_patience_stops_the_coarse_scan():
    sizes = [1] * 64
    calls = []

    def cost(splits):
        calls.append(splits)
        return 1.0 if len(splits) == 63 else 2.0 + len(splits)  # per tensor best, others worse

    run_search(sizes, cost, ratio=2.0, patience=2, refine_budget=0, confirm=0)
    assert len(calls) == 4  # per tensor, whole model, then two misses


def test_confirmation_chooses_the_finalist_with_the_best_mean():
    """Lucky single measurements do not decide: the finalists are timed again and the choice is
    the finalist with the lowest mean, even if a candidate left out was once measured faster."""
    sizes = [10] * 8
    seen = {}
    first_then = {(): (0.5, 2.0), (4,): (0.9, 1.5)}  # lucky first timings, then the truth

    def cost(splits):
        seen[splits] = seen.get(splits, 0) + 1
        if splits in first_then:
            return first_then[splits][min(seen[splits], 2) - 1]
        return 1.1 if len(splits) == 3 else 3.0

    unconfirmed = run_search(sizes, cost, ratio=2.0, refine_budget=0, confirm=0)
    assert unconfirmed.best.splits == ()
    seen.clear()
    confirmed = run_search(sizes, cost, ratio=2.0, refine_budget=0, confirm=2)
    assert [t.splits for t in confirmed.trials[-2:]] == [(), (4,)]
    assert confirmed.best == Trial((4,), 1.2)  # mean of 0.9 and 1.5; beats () at 1.25, not (2, 4, 6) at 1.1


def test_single_gradient_needs_no_search():
    search = SplitSearch([123], MergeCompOptions())
    assert search.finished and search.best.splits == ()


def test_record_validation():
    search = SplitSearch([1, 2, 3], MergeCompOptions(refine_budget=0))
    with pytest.raises(ValueError, match="finite"):
        search.record(math.nan)
    while search.candidate is not None:
        search.record(1.0)
    with pytest.raises(RuntimeError, match="finished"):
        search.record(1.0)


def test_options():
    assert MergeCompOptions.from_spec("mergecomp") == MergeCompOptions()
    custom = MergeCompOptions(warmup_steps=1, timed_steps=3)
    assert MergeCompOptions.from_spec(custom) is custom and custom.steps_per_candidate == 4
    assert MergeCompOptions.from_spec("tensor") is None and MergeCompOptions.from_spec(2) is None
    with pytest.raises(ValueError, match="ratio must be > 1"):
        MergeCompOptions(ratio=1.0)
    with pytest.raises(ValueError, match="timed_steps"):
        MergeCompOptions(timed_steps=0)
    with pytest.raises(ValueError, match="residual_decay"):
        MergeCompOptions(residual_decay=1.5)


def test_result_record_round_trip():
    result = MergeCompResult(order=["c", "a", "b"], sizes=[3, 1, 2], splits=(1,), seconds=0.5,
                             trials=[Trial((1, 2), 0.9), Trial((1,), 0.5)], search_steps=9, search_seconds=6.0)
    assert result.groups == [["c"], ["a", "b"]]
    assert result.search_overhead_seconds == pytest.approx(1.5)
    record = result.as_dict()
    assert record["groups"] == [["c"], ["a", "b"]] and record["splits"] == [1]
    assert MergeCompResult.from_dict(record) == result


class OneRank:
    """A one-rank backend and process set for the scheduler: a gather returns this rank's rows."""

    @staticmethod
    def allgather_array(array: np.ndarray, process_set: object, name: str) -> np.ndarray:
        return array

    @staticmethod
    def rank() -> int:
        return 0


def test_scheduler_announces_a_grouping_only_when_it_changes():
    """Every candidate the search times runs faster than the ones before, so the search ends on
    the candidate it timed last, which is its choice. The scheduler announces each candidate once
    (the front end switches groups and restarts the method's state then) and not the choice
    again, which is already in use: a stateful method (MiCRO's thresholds) carries on."""
    sizes = [300, 5, 5, 5, 5, 5, 5, 5]
    scheduler = MergeCompScheduler(MergeCompOptions(warmup_steps=0, timed_steps=1, refine_budget=2, confirm=1),
                                   [f"p{i}" for i in range(len(sizes))], sizes, OneRank, OneRank)
    ready = list(reversed(range(len(sizes))))
    announced = [scheduler.after_step(StepTimeline(param_order=ready))]
    seconds = 1.0
    while scheduler.result is None:
        seconds /= 2
        announced.append(scheduler.after_step(StepTimeline(step_seconds=seconds)))
    trials = scheduler.result.trials
    assert len(trials) > 3 and scheduler.result.splits == trials[-1].splits
    assert announced == [runs_of(ready, trial.splits) for trial in trials] + [None]
