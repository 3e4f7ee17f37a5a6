"""LAGS-SGD's framework-free parts: the density rule, the t_comp meter, the alpha-beta cost
model, fixed-size merging and the backward timeline. One process, no Horovod."""
import functools

import numpy as np
import pytest

import horovod_sparse.methods  # noqa: F401  (fills the registry)
from horovod_sparse.common import registry
from horovod_sparse.common.cost_model import AlphaBeta, calibrate, calibration_sizes, exposed_time, fit_allgather
from horovod_sparse.common.grouping import MergeBySize, ParamInfo, ReadyTimeline, form_groups, merge_by_size
from horovod_sparse.common.cost_model import LocalCost
from horovod_sparse.methods.lags.rule import BackwardTimeMeter, LagsGroup, lags_counts
from tests.support import reference_lags


# -- the density rule ---------------------------------------------------------------------------
FREE = {"select_element": 0.0, "select_pair": 0.0, "apply_pair": 0.0}


def rule(groups, model, local, floor=0.001, cap=0.1, slack=0.0):
    return lags_counts([LagsGroup(f"g{i}", m, t) for i, (m, t) in enumerate(groups)], model, LocalCost(**local),
                       floor, cap, slack)


@pytest.mark.parametrize("t_comp,numel,expected", [
    # no local cost, one group: the paper's rho m = (t - alpha log2 4) / (2 (n-1) 4 beta) = (t - 2 ms) / 24 ns
    (3e-3, 1_000_000, 41_666),             # rho 0.041666...: inside [floor, cap]
    (2.5e-3, 1_000_000, 20_833),           # 0.020833...
    (4e-3, 2_000_000, 83_333),             # same rho, twice the elements
    (2e-3, 1_000_000, 1_000),              # no time left after the latency: the floor
    (1e-3, 1_000_000, 1_000),              # less than the latency: the floor
    (2.0001e-3, 1_000_000, 1_000),         # 0.0000041...: below the floor
    (1.0, 1_000_000, 100_000),             # plenty of time: the cap
])
def test_a_lone_group_without_local_cost_gets_the_papers_density(t_comp, numel, expected):
    assert rule([(numel, t_comp)], AlphaBeta(alpha=1e-3, beta=1e-9, workers=4), FREE) == [expected]


def test_the_paper_form():
    """rho = (t - alpha log2 n) / (2 (n-1) beta' m) with beta' = 4 beta per float32 element."""
    t_comp, m = 1.5e-3, 300_000
    paper = (t_comp - 20e-6 * 3) / (2 * 7 * (4 * 0.8e-9) * m)
    assert rule([(m, t_comp)], AlphaBeta(alpha=20e-6, beta=0.8e-9, workers=8), FREE, floor=1e-4,
                cap=1.0) == [int(paper * m)]


def test_groups_queue_on_one_link():
    """Two groups that would each fill the time left after them on their own: the first one's
    allgather delays the second's, so the second gets only what is left after the first."""
    model = AlphaBeta(alpha=0.0, beta=1e-9, workers=2)   # 8 ns per pair
    t_first, t_second = 4.00004e-4, 2.00004e-4          # 50,000.5 and 25,000.5 pairs' time
    alone = [rule([(10**6, t)], model, FREE) for t in (t_first, t_second)]
    assert alone == [[50_000], [25_000]]                 # each its own budget: the old rule's answer
    # together: the first's allgather delays the second's, whose 1,000 floor pairs (8 us) must
    # still end with backward: the first yields their time and the second stays at the floor
    assert rule([(10**6, t_first), (10**6, t_second)], model, FREE) == [49_000, 1_000]


def test_local_cost_is_paid_for_within_the_slack():
    """With the wire free, what limits the density is the selection and scatter-add time: the
    extra pairs' cost, 0.2 us each (selection 0.1 us, two received pairs applied 0.05 us each),
    fits within slack times the span from launch to the end of the step at the floor: t_comp
    0.2000001 s plus the floor pairs' scatter-add, 2,000 * 0.05 us = 0.1 ms."""
    model = AlphaBeta(alpha=0.0, beta=0.0, workers=2)
    local = {"select_element": 1e-9, "select_pair": 1e-7, "apply_pair": 5e-8}
    counts = [rule([(10**6, 0.2000001)], model, local, slack=slack)[0] for slack in (0.0, 0.01, 0.02, 1.0)]
    assert counts == [1_000, 1_000 + 10_005, 1_000 + 20_010, 100_000]   # the last one: the cap


def test_edge_cases():
    assert rule([(1000, 1e-3)], AlphaBeta(1e-3, 1e-9, 1), FREE, floor=0.01, cap=0.2) == [200]  # one worker
    assert rule([(1000, 1e-3)], AlphaBeta(0.0, 0.0, 4), FREE, floor=0.01, cap=0.2) == [200]    # free network
    assert rule([(1000, 0.0)], AlphaBeta(1e-6, 1e-9, 4), FREE, floor=0.01, cap=0.2) == [10]    # no time at all
    assert rule([(1000, 1.0)], AlphaBeta(1e-6, 1e-9, 4), FREE, floor=0.3, cap=0.2) == [300]    # cap below floor
    assert rule([], AlphaBeta(1e-6, 1e-9, 4), FREE) == []


@pytest.mark.parametrize("seed", range(40))
def test_rule_against_the_reference(seed):
    """Random groups, networks, local costs and slacks against tests/support/reference_lags.py."""
    rng = np.random.default_rng(seed)
    workers = int(rng.integers(2, 9))
    groups = [(int(rng.integers(50, 3000)), float(rng.uniform(0, 0.02))) for _ in range(int(rng.integers(1, 6)))]
    groups.sort(key=lambda g: -g[1])                     # launched earlier: more backward left
    alpha, beta = float(rng.uniform(0, 2e-4)), float(rng.uniform(1e-9, 1e-6))
    local = dict(zip(FREE, rng.uniform(0, [1e-8, 1e-6, 1e-6]) * rng.integers(0, 2)))
    floor, cap, slack = 0.01, float(rng.uniform(0.01, 0.3)), float(rng.choice([0, 0.02, 0.2]))
    model = AlphaBeta(alpha, beta, workers)
    expected = reference_lags.counts(groups, alpha, beta, workers, local, floor, cap, slack)
    assert rule(groups, model, local, floor, cap, slack) == expected
    lowest = [max(1, int(floor * m)) for m, _ in groups]
    at_floor = reference_lags.step_after_backward(groups, lowest, lowest, alpha, beta, workers, local)
    chosen = reference_lags.step_after_backward(groups, expected, lowest, alpha, beta, workers, local)
    assert chosen <= at_floor + slack * (groups[0][1] + at_floor)


def test_local_cost_fit():
    cost = LocalCost.fit(1000, (10, 1e-6 * 1000 + 1e-5 * 10), (200, 1e-6 * 1000 + 1e-5 * 200), (400, 2e-3))
    assert cost.select_element == pytest.approx(1e-6) and cost.select_pair == pytest.approx(1e-5)
    assert cost.apply_pair == pytest.approx(5e-6)
    assert LocalCost.fit(1000, (10, 2e-3), (200, 1e-3), (400, 2e-3)).select_pair == 0.0     # noise: clamped
    with pytest.raises(ValueError, match="two counts"):
        LocalCost.fit(1000, (10, 1e-3), (10, 2e-3), (400, 2e-3))
    with pytest.raises(ValueError, match="select_pair"):
        LocalCost(0.0, -1.0, 0.0)


def test_lags_options():
    options = registry.make_options("lags")
    assert (options.density, options.group_size, options.adaptive) == (0.001, 8192, True)
    with pytest.raises(ValueError, match="max_density"):
        registry.make_options("lags", max_density=0)
    with pytest.raises(ValueError, match="group_size"):
        registry.make_options("lags", group_size=0)
    with pytest.raises(TypeError, match="adaptive"):
        registry.make_options("lags", adaptive="on")
    with pytest.raises(ValueError, match="measure_steps"):
        registry.make_options("lags", measure_steps=0)
    assert options.slack == 0.02 and registry.make_options("lags", slack=0).slack == 0.0
    with pytest.raises(ValueError, match="slack"):
        registry.make_options("lags", slack=-0.1)


# -- the t_comp meter and the timeline ------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _step(timeline, clock, events, end):
    """events: (time, kind, what) with kind 'param' or 'group'."""
    for when, kind, what in events:
        clock.now = when
        timeline.param_ready(what) if kind == "param" else timeline.group_ready(what)
    clock.now = end
    return timeline.end_step()


def test_timeline_backward_left_and_order():
    clock = FakeClock()
    timeline = ReadyTimeline(clock)
    record = _step(timeline, clock, [(1.0, "param", 2), (1.0, "group", "a"), (3.0, "param", 0),
                                     (3.5, "param", 1), (3.5, "group", "b"), (4.0, "group", "late")], end=5.0)
    assert record.param_order == [2, 0, 1] and record.launch_order == ["a", "b", "late"]
    assert record.backward_left() == {"a": 2.5, "b": 0.0, "late": 0.0}
    assert record.step_seconds is None
    record = _step(timeline, clock, [(6.0, "param", 0), (6.0, "group", "a")], end=7.5)
    assert record.step_seconds == 2.5 and timeline.steps == 2 and timeline.last is record


def test_meter_skips_the_first_step_averages_and_restarts_on_regrouping():
    clock = FakeClock()
    timeline = ReadyTimeline(clock)
    meter = BackwardTimeMeter(steps=2, skip=1)

    def step(left_a, groups=("a", "b")):
        start = clock.now + 1
        events = [(start, "param", 0), (start, "group", groups[0]), (start + left_a, "param", 1),
                  (start + left_a, "group", groups[1])]
        return meter.add(_step(timeline, clock, events, end=start + left_a + 1))

    assert not step(100.0)   # skipped
    assert not step(2.0)
    assert step(4.0)         # complete now
    assert meter.means() == {"a": 3.0, "b": 0.0}
    assert not step(50.0)    # complete measurements stay
    assert meter.means() == {"a": 3.0, "b": 0.0}
    assert not step(1.0, groups=("c", "d"))  # new grouping: restart (this step is skipped)
    with pytest.raises(RuntimeError, match="not complete"):
        meter.means()
    assert not step(1.0, groups=("c", "d"))
    assert step(3.0, groups=("c", "d"))
    assert meter.means() == {"c": 2.0, "d": 0.0}


# -- the cost model ---------------------------------------------------------------------------------
def test_cost_model_predictions():
    model = AlphaBeta(alpha=10e-6, beta=1e-9, workers=4)
    assert model.allgather(1000) == pytest.approx(10e-6 * 2 + 3 * 1e-9 * 1000)
    assert model.allreduce(4000) == pytest.approx(2 * 10e-6 * 2 + 2 * 3 / 4 * 1e-9 * 4000)
    assert model.dense_allreduce(1000) == model.allreduce(4000)
    assert model.sparse_allgather(100) == model.allgather(800)
    assert model.alltoall(4000) == pytest.approx(3 * 10e-6 + 3 / 4 * 1e-9 * 4000)
    assert model.with_workers(16).allgather(1000) == pytest.approx(10e-6 * 4 + 15 * 1e-9 * 1000)
    assert AlphaBeta(1.0, 1.0, 1).allgather(10**6) == 0.0
    with pytest.raises(ValueError, match="beta"):
        AlphaBeta(1e-6, -1e-9, 2)


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_fit_recovers_alpha_and_beta(workers):
    truth = AlphaBeta(alpha=40e-6, beta=0.5e-9, workers=workers)
    samples = [(b, truth.allgather(b)) for b in calibration_sizes()]
    fitted = fit_allgather(samples, workers)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-9)
    assert fitted.beta == pytest.approx(truth.beta, rel=1e-9)
    noisy = [(b, t * f) for (b, t), f in zip(samples, [1.05, 0.97, 1.03, 0.96])]
    rough = fit_allgather(noisy, workers)
    assert rough.alpha == pytest.approx(truth.alpha, rel=0.25)
    assert rough.beta == pytest.approx(truth.beta, rel=0.1)


def test_fit_clamps_negative_latency_and_handles_one_worker():
    fitted = fit_allgather([(1000, 1e-6), (2000, 2.2e-6), (4000, 4.6e-6)], 2)
    assert fitted.alpha == 0.0 and fitted.beta > 0
    assert fit_allgather([(1000, 1e-6), (2000, 2e-6)], 1) == AlphaBeta(0.0, 0.0, 1)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_allgather([(1000, 1e-6), (1000, 2e-6)], 2)


def test_calibrate_times_each_size_and_fits_the_agreed_medians():
    truth = AlphaBeta(alpha=30e-6, beta=2e-9, workers=4)
    calls = []

    def time_allgather(nbytes):
        calls.append(nbytes)
        return truth.allgather(nbytes) * (3.0 if len(calls) % 4 == 1 else 1.0)  # slow warm-ups

    agreed = []
    model, samples = calibrate(time_allgather, lambda v: agreed.append(v) or [2 * t for t in v], 4,
                               sizes=[1024, 8192, 65536], repeats=3)
    assert calls == [1024] * 4 + [8192] * 4 + [65536] * 4
    assert samples == [(b, 2 * truth.allgather(b)) for b in (1024, 8192, 65536)]
    assert model.alpha == pytest.approx(2 * truth.alpha) and model.beta == pytest.approx(2 * truth.beta)
    assert calibration_sizes(1024, 4096, 3) == [1024, 2048, 4096]


# -- fixed-size merging -------------------------------------------------------------------------------
def test_merge_by_size():
    assert merge_by_size([5, 5, 5, 5, 5], 10) == [[0, 1], [2, 3], [4]]
    assert merge_by_size([20, 1, 30, 2, 2], 10) == [[0], [1, 2], [3, 4]]
    assert merge_by_size([3, 3], 100) == [[0, 1]]
    assert merge_by_size([3, 3], 1) == [[0], [1]]


def test_size_strategy_in_form_groups():
    params = [ParamInfo(f"p{i}", s, "f32") for i, s in enumerate([4096, 64, 4096, 100, 9000, 10])]
    assert form_groups(params, "size:8192") == [[0, 1, 2], [3, 4], [5]]
    assert form_groups(params, MergeBySize(8192)) == form_groups(params, "size:8192")
    assert form_groups(params, None, default=MergeBySize(5000)) == [[0, 1, 2], [3, 4], [5]]
    # along another order (e.g. the order gradients become ready)
    assert form_groups(params, "size:8192", order=[5, 4, 3, 2, 1, 0]) == [[5, 4], [3, 2, 1, 0]]
    assert form_groups(params, "tensor", order=[1, 0, 2, 3, 4, 5])[:2] == [[1], [0]]
    kinds = [ParamInfo("a", 10, "f32"), ParamInfo("b", 10, "f16"), ParamInfo("c", 10, "f32")]
    assert form_groups(kinds, "size:100") == [[0], [1], [2]]
    with pytest.raises(ValueError, match="'size:N'"):
        form_groups(params, "size:lots")
    with pytest.raises(ValueError, match="size threshold"):
        form_groups(params, "size:0")
    with pytest.raises(ValueError, match="every parameter index exactly once"):
        form_groups(params, "tensor", order=[0, 1])
    assert str(MergeBySize(8192)) == "size:8192"


def test_exposed_time_of_serialised_exchanges():
    assert exposed_time([], 5.0) == 0.0
    unfused = functools.partial(exposed_time, fuse=False)
    assert unfused([(1.0, 0.5, 0.5), (2.5, 0.5, 0.5)], 5.0) == 0.0                # all hidden
    assert unfused([(1.0, 1.0, 2.0), (2.0, 1.0, 1.0)], 5.0) == pytest.approx(1.0)  # queued behind
    assert unfused([(4.0, 0.0, 0.5), (5.0, 1.0, 1.0)], 5.0) == pytest.approx(2.0)  # launched at the end
    # fused: what queued while the link was busy goes as one collective, one latency
    assert exposed_time([(1.0, 1.0, 2.0), (2.0, 1.0, 1.0), (3.5, 1.0, 1.0)], 5.0) == pytest.approx(2.0)
    assert unfused([(1.0, 1.0, 2.0), (2.0, 1.0, 1.0), (3.5, 1.0, 1.0)], 5.0) == pytest.approx(3.0)
