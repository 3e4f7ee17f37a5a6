"""Density schedules and the step-dependent target count; framework-free, one process."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

import horovod_sparse.methods  # noqa: F401  (fills the registry)
from horovod_sparse.common import registry
from horovod_sparse.common.schedule import ExponentialWarmup, PiecewiseDensity, parse_schedule


def test_off_unless_asked_for():
    options = registry.make_options("topk", density=0.01)
    assert options.density_schedule is None
    assert [options.count(1000, step) for step in (0, 1, 10 ** 6)] == [10, 10, 10]
    assert options.count(1000) == 10
    assert registry.make_options("topk", density=0.01, density_schedule="constant").count(1000, 5) == 10


def test_piecewise_is_the_reference_gtopk_schedule():
    """0.004 during the first epoch (here 500 steps), then the configured 0.001."""
    name, spec = registry.parse_spec("gtopk:density=0.001,density_schedule=piecewise:0.004@500")
    options = registry.make_options(name, **spec)
    assert [options.density_at(s) for s in (0, 499, 500, 10 ** 6)] == [0.004, 0.004, 0.001, 0.001]
    assert options.count(100_000, 0) == 400 and options.count(100_000, 500) == 100
    assert options.count(100_000) == 100  # no step: the constant density
    assert options.as_dict()["density_schedule"] == "piecewise:0.004@500"


def test_piecewise_with_several_stages():
    schedule = parse_schedule("piecewise:0.1@10;0.01@20")
    assert schedule == PiecewiseDensity(((0.1, 10), (0.01, 20)))
    assert [schedule.density(s, 0.001) for s in (0, 9, 10, 19, 20)] == [0.1, 0.1, 0.01, 0.01, 0.001]


def test_exponential_warmup_is_dgc():
    """DGC: 75%, 93.75%, 98.4375%, 99.6% sparsity, then the final 99.9%, one stage per epoch."""
    options = registry.make_options("topk", density=0.001, density_schedule="exp_warmup:100")
    assert [options.density_at(100 * stage) for stage in range(6)] == [0.25, 0.0625, 0.015625, 0.00390625,
                                                                       0.001, 0.001]
    assert options.density_at(99) == 0.25
    assert parse_schedule("exp_warmup:3;0.5") == ExponentialWarmup(3, 0.5)


@given(st.integers(1, 50), st.floats(0.01, 0.99), st.floats(1e-4, 1.0), st.integers(0, 10 ** 4))
def test_warmup_never_goes_below_the_final_density_and_never_rises(stage_steps, factor, final, step):
    schedule = ExponentialWarmup(stage_steps, factor)
    assert final <= schedule.density(step, final) <= 1.0
    assert schedule.density(step + 1, final) <= schedule.density(step, final)


@pytest.mark.parametrize("text,error,match", [
    ("linear:5", ValueError, "is not a density schedule; accepted forms"),
    ("piecewise", ValueError, "is not a density schedule"),
    ("piecewise:0.004", ValueError, "must be DENSITY@STEP"),
    ("piecewise:1.5@10", ValueError, r"DENSITY must be a number in \(0, 1\], got '1.5'"),
    ("piecewise:0.1@0", ValueError, "STEP must be an integer >= 1"),
    ("piecewise:0.1@20;0.01@10", ValueError, "the steps must increase"),
    ("exp_warmup:x", ValueError, r"S \(steps per stage\) must be an integer >= 1"),
    ("exp_warmup:10;1", ValueError, r"F \(the factor per stage\) must be in \(0, 1\)"),
    (0.004, TypeError, "density_schedule must be None or a string"),
])
def test_bad_schedules_name_the_option_and_the_accepted_forms(text, error, match):
    with pytest.raises(error, match=match):
        registry.make_options("topk", density_schedule=text)
