"""Options validation, the registry and grouping: framework-free, one process."""
import math
import random

import pytest

import horovod_sparse.methods  # noqa: F401  (fills the registry)
from horovod_sparse.common import registry
from horovod_sparse.common.grouping import Buckets, ParamInfo, form_groups, split_evenly
from horovod_sparse.common.options import target_count
from horovod_sparse.common.capacity import capacity_count


@pytest.mark.parametrize("density", [0, -0.1, 1.5, math.nan, math.inf])
def test_density_out_of_range_is_refused(density):
    with pytest.raises(ValueError, match=r"density must be .*\(0, 1\]"):
        registry.make_options("topk", density=density)


@pytest.mark.parametrize("density", ["0.1", None, True, [0.1]])
def test_density_of_wrong_type_is_refused(density):
    with pytest.raises(TypeError, match="density must be a real number"):
        registry.make_options("topk", density=density)


@pytest.mark.parametrize("option,value,error", [
    ("min_numel", -1, ValueError), ("min_numel", 1.5, TypeError), ("warmup_steps", "3", TypeError),
    ("fp16_values", "yes", TypeError), ("fp16_values", 1, TypeError)])
def test_other_bad_options_name_the_option(option, value, error):
    with pytest.raises(error, match=option):
        registry.make_options("topk", **{option: value})


@pytest.mark.parametrize("method", ["threshold", "dgc", "gaussiank", "micro", "exdyna"])
@pytest.mark.parametrize("capacity,error", [(0, ValueError), (-1.0, ValueError), (math.nan, ValueError),
                                            ("2", TypeError), (True, TypeError)])
def test_a_bad_capacity_is_refused_naming_it(method, capacity, error):
    with pytest.raises(error, match="capacity"):
        registry.make_options(method, capacity=capacity)


@pytest.mark.parametrize("floor,error", [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_a_bad_capacity_floor_is_refused_naming_it(floor, error):
    with pytest.raises(error, match="capacity_floor"):
        registry.make_options("gaussiank", capacity_floor=floor)


def test_capacity_defaults_twice_k_except_for_the_hard_threshold():
    """DGC and Gaussian-k cap their payload at 2k, at least 1024 coordinates (at most the
    group); the hard threshold sends all it selects (None) unless told."""
    assert [registry.make_options(m).capacity for m in ("dgc", "gaussiank", "threshold")] == [2.0, 2.0, None]
    assert registry.make_options("threshold", capacity=3).capacity == 3.0
    options = registry.make_options("dgc", density=0.001)
    assert [capacity_count(options, k, numel) for k, numel in [(1, 1000), (1, 5000), (900, 10 ** 6)]] == [
        1000, 1024, 1800]
    assert capacity_count(registry.make_options("threshold"), 1, 5000) == 5000


def test_micro_and_exdyna_cap_a_rank_at_twice_its_share():
    """MiCRO and ExDyna cap what a rank sends at twice its share ``ceil(k / n)`` of the target,
    at least 1024 coordinates (at most the group)."""
    from horovod_sparse.methods.micro.options import share_capacity

    for method in ("micro", "exdyna"):
        options = registry.make_options(method, density=0.01)
        assert (options.capacity, options.capacity_floor) == (2.0, 1024)
        cases = [(10_000, 4, 10 ** 6), (10_001, 4, 10 ** 6), (100, 2, 10 ** 6), (100, 2, 500)]
        assert [share_capacity(options, k, n, numel) for k, n, numel in cases] == [5000, 5002, 1024, 500]
        assert share_capacity(registry.make_options(method, capacity=0.5, capacity_floor=1), 101, 2, 10 ** 6) == 26


def test_unknown_option_lists_the_known_ones():
    with pytest.raises(TypeError, match="options of 'topk' are: density, min_numel"):
        registry.make_options("topk", densty=0.1)


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown sparsification method 'tpok'; known methods: .*topk"):
        registry.make_options("tpok")


def test_options_record_their_method():
    options = registry.make_options("topk", density=0.25)
    assert options.as_dict() == {"method": "topk", "density": 0.25, "min_numel": 1024,
                                 "warmup_steps": 0, "fp16_values": False,
                                 "density_schedule": None}


@pytest.mark.parametrize("density,numel,expected", [(0.01, 1000, 10), (0.001, 10, 1), (1.0, 7, 7), (0.5, 3, 1)])
def test_target_count(density, numel, expected):
    assert target_count(density, numel) == expected


def _params(*sizes, kinds=None):
    kinds = kinds or ["f32"] * len(sizes)
    return [ParamInfo(f"p{i}", s, k) for i, (s, k) in enumerate(zip(sizes, kinds))]


def test_grouping_strategies():
    params = _params(5, 6, 7, 8, 9)
    assert form_groups(params, "tensor") == [[0], [1], [2], [3], [4]]
    assert form_groups(params, "model") == [[0, 1, 2, 3, 4]]
    assert form_groups(params, 2) == [[0, 1, 2], [3, 4]]
    assert form_groups(params, [[3, 1]]) == [[1, 3], [0], [2], [4]]
    assert form_groups(params, None, default="model") == [[0, 1, 2, 3, 4]]


def test_grouping_never_mixes_dtypes():
    params = _params(5, 6, 7, kinds=["f32", "f16", "f32"])
    assert form_groups(params, "model") == [[0], [1], [2]]


def test_kept_parameters_are_grouped_apart_after_the_others():
    """``kept`` (a front end's ``dense=``) leaves the strategy and explicit lists: the others are
    grouped as without them, the kept ones follow, one group per buffer kind."""
    params = _params(5, 6, 7, 8, 9, kinds=["f32", "f32", "f32", "f16", "f32"])
    assert form_groups(params, "model", kept=[1, 3, 4]) == [[0, 2], [1, 4], [3]]
    assert form_groups(params, "tensor", kept=[0]) == [[1], [2], [3], [4], [0]]
    assert form_groups(params, 2, kept=[0, 1]) == [[2], [3], [4], [0, 1]]
    assert form_groups(params, [[3, 1, 0]], kept=[1]) == [[0], [3], [2], [4], [1]]
    assert form_groups(params, "size:13", kept=[2]) == [[0, 1], [3], [4], [2]]  # runs [0, 1, 3], [4]
    assert form_groups(params, "model", kept=range(5)) == [[0, 1, 2, 4], [3]]


def test_buckets_are_filled_from_the_last_parameter_and_bounded_in_bytes():
    """Buckets: the last parameters first, each bucket at most the cap in bytes unless one
    parameter alone exceeds it, kinds never mixed, members in parameter order."""
    mib = 2 ** 20
    params = _params(mib // 4, mib, 3 * mib // 4, mib // 2)  # 1, 4, 3 and 2 MiB of float32
    assert form_groups(params, "buckets:5") == [[2, 3], [0, 1]]
    assert form_groups(params, "buckets:4") == [[3], [2], [1], [0]]
    assert form_groups(params, Buckets(10 * mib)) == [[0, 1, 2, 3]]
    assert form_groups(params, "buckets") == [[0, 1, 2, 3]]  # 25 MiB, DDP's cap
    halves = [ParamInfo(f"h{i}", mib // 2, "f16", 2) for i in range(3)]  # 1 MiB each at 2 bytes
    assert form_groups(halves, "buckets:2") == [[1, 2], [0]]
    assert form_groups(_params(5, 6, 7, kinds=["f32", "f16", "f32"]), "buckets") == [[0], [1], [2]]
    assert form_groups(params, None, default="buckets:5", kept=[3]) == [[2], [0, 1], [3]]


@pytest.mark.parametrize("seed", range(20))
def test_buckets_are_the_greedy_cut_from_the_end(seed):
    """Against the definition, on random sizes: read last parameter first, the buckets cover
    every parameter once in that order, none is over the cap unless it holds one parameter, and
    none could have taken the parameter that opens the next one (greedy: every cut is forced)."""
    rng = random.Random(seed)
    sizes = [rng.choice([1, 3, 8, 40, 100, 260]) for _ in range(rng.randint(1, 30))]
    cap = rng.choice([50, 100, 300])
    groups = form_groups(_params(*sizes), Buckets(cap))
    assert [i for g in groups for i in reversed(g)] == list(reversed(range(len(sizes))))
    for g, following in zip(groups, groups[1:] + [None]):
        total = sum(4 * sizes[i] for i in g)
        assert total <= cap or len(g) == 1, (g, total)
        if following is not None:
            assert total + 4 * sizes[following[-1]] > cap, (g, following)


def test_bucket_specs_are_checked():
    with pytest.raises(ValueError, match="'buckets:M' with M the cap of a bucket in MiB"):
        form_groups(_params(1, 2), "buckets:0")
    for text in ("buckets:-1", "buckets:nan", "buckets:inf", "buckets:x", "buckets25"):
        with pytest.raises(ValueError, match="'buckets:M' with M the cap of a bucket in MiB"):
            form_groups(_params(1, 2), text)
    assert Buckets.parse("buckets:0.5") == Buckets(2 ** 19) and Buckets.parse("buckets:0.002") == Buckets(2097)
    with pytest.raises(ValueError, match="bucket cap in bytes"):
        Buckets(0)
    assert str(Buckets()) == "buckets:25" and str(Buckets(10)) == "Buckets(cap_bytes=10)"


def test_grouping_refuses_bad_specs():
    with pytest.raises(ValueError, match="only appear once"):
        form_groups(_params(1, 2), [[0], [0]])
    with pytest.raises(ValueError, match="groups must be an int > 0"):
        form_groups(_params(1, 2), "layers")
    with pytest.raises(ValueError, match="groups must be an integer >= 1"):
        form_groups(_params(1, 2), 0)


def test_split_evenly_matches_horovod():
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([0, 1], 4) == [[0], [1]]
