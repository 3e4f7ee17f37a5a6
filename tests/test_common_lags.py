"""LAGS-SGD's framework-free parts: the density rule, the t_comp meter, the alpha-beta cost
model, fixed-size merging and the backward timeline. One process, no Horovod."""
import functools

import pytest

import horovod_sparse.common.methods  # noqa: F401
from horovod_sparse.common import registry
from horovod_sparse.common.cost_model import AlphaBeta, calibrate, calibration_sizes, exposed_time, fit_allgather
from horovod_sparse.common.grouping import MergeBySize, ParamInfo, ReadyTimeline, form_groups, merge_by_size
from horovod_sparse.common.lags import BackwardTimeMeter, lags_density


# -- the density rule ---------------------------------------------------------------------------
@pytest.mark.parametrize("t_comp,numel,expected", [
    # budget = t_comp - alpha*log2(4) = t_comp - 2 ms; denominator 2(n-1) beta' m = 2*3*4e-9*m
    (3e-3, 1_000_000, 1e-3 / 2.4e-2),      # 0.041666...: inside [floor, cap]
    (2.5e-3, 1_000_000, 0.5e-3 / 2.4e-2),  # 0.020833...
    (4e-3, 2_000_000, 2e-3 / 4.8e-2),      # 0.041666...
    (2e-3, 1_000_000, 0.001),              # no time left after the latency: the floor
    (1e-3, 1_000_000, 0.001),              # less than the latency: the floor
    (2.0001e-3, 1_000_000, 0.001),         # 0.0000041...: below the floor
    (1.0, 1_000_000, 0.1),                 # plenty of time: the cap
])
def test_lags_density_against_hand_computed_values(t_comp, numel, expected):
    model = AlphaBeta(alpha=1e-3, beta=1e-9, workers=4)
    assert lags_density(t_comp, model, numel, floor=0.001, cap=0.1) == pytest.approx(expected, rel=1e-12)


def test_lags_density_matches_the_paper_form():
    """rho = (t - alpha log2 n) / (2 (n-1) beta' m) with beta' = 4 beta per float32 element."""
    model = AlphaBeta(alpha=20e-6, beta=0.8e-9, workers=8)
    t_comp, m = 1.5e-3, 300_000
    paper = (t_comp - 20e-6 * 3) / (2 * 7 * (4 * 0.8e-9) * m)
    assert lags_density(t_comp, model, m, floor=1e-4, cap=1.0) == pytest.approx(paper, rel=1e-12)


def test_lags_density_edge_cases():
    assert lags_density(1e-3, AlphaBeta(1e-3, 1e-9, 1), 1000, floor=0.01, cap=0.2) == 0.2  # one worker
    assert lags_density(1e-3, AlphaBeta(0.0, 0.0, 4), 1000, floor=0.01, cap=0.2) == 0.2   # free network
    assert lags_density(0.0, AlphaBeta(0.0, 0.0, 4), 1000, floor=0.01, cap=0.2) == 0.01   # no time at all
    assert lags_density(1.0, AlphaBeta(1e-6, 1e-9, 4), 1000, floor=0.3, cap=0.2) == 0.3   # cap below floor


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
    assert model.broadcast(1000) == pytest.approx(2 * (10e-6 + 1e-9 * 1000))
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
