"""LAGS-SGD through horovod_sparse.torch.DistributedOptimizer on a real 3-worker horovodrun job."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tests.checks import Observed, assert_conservation, assert_identical_replicas, raw_group_stream
from tests.launch import run_configs
from tests.reference import allgather_method, topk_indices
from tests.test_torch_grouping import group_names

SIZE = 3
#: Sizes 4096, 64, 4096, 100, 2500, 900: with group_size 8192 -> [0, 1, 2], [3, 4, 5].
SHAPES = [[64, 64], [64], [64, 64], [100], [50, 50], [30, 30]]
#: Given backward time per gradient on rank 0 (rank r: (1 + r) times as long), in seconds.
GRADIENT_SECONDS = 2.0 ** -5
DENSITY, CAP, MEASURE = 0.01, 0.2, 2
ADAPTIVE = {"density": DENSITY, "max_density": CAP, "measure_steps": MEASURE, "group_size": 3000}
#: A given alpha-beta model: a slow network, so that the groups launched early can send more than
#: the floor in the backward time left after them, and not all of them up to the cap.
MODEL = {"alpha": 2.0 ** -10, "beta": 2.0 ** -14}
CONFIGS = [
    # The reference's setting: rule off, every group at the global density.
    {"name": "uniform", "method": "lags", "options": {"density": 0.01, "adaptive": False}},
    # The rule on (default), fed given times: the backward time each gradient takes and the
    # alpha-beta model, so the densities it chooses are known in advance.
    {"name": "adaptive", "method": "lags", "backward_seconds": GRADIENT_SECONDS, "cost_model": MODEL,
     "options": ADAPTIVE},
    # The alpha-beta model calibrated on the job (allgathers timed at the end of step 0): the
    # densities follow the rule from whatever was measured.
    {"name": "calibrated", "method": "lags", "backward_seconds": GRADIENT_SECONDS, "options": ADAPTIVE},
]
for config in CONFIGS:
    config.update(steps=8, seed=4, shapes=SHAPES)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lags")
    run_configs("torch_exchange.py", SIZE, out, CONFIGS)
    return out


def group_stats(obs, rank, step):
    return {g["name"]: g for g in obs.stats(rank)[step]["groups"]}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["name"])
def test_lags_is_topk_per_group_at_the_reported_density(run, config):
    """Against the slow reference: error-feedback Top-k per group, with each step's k as reported."""
    obs = Observed(run, config["name"], SIZE)
    for g, (members, name) in enumerate(zip(obs.groups, group_names(obs))):
        counts = [group_stats(obs, 0, step)[name]["target"] for step in range(config["steps"])]
        updates, residuals = allgather_method(raw_group_stream(config, SIZE, members),
                                              lambda x, step, counts=counts: topk_indices(x, counts[step]))
        for step, expected in enumerate(updates):
            for rank in range(SIZE):
                np.testing.assert_allclose(obs.aggregated(rank, step, members), expected, rtol=1e-5,
                                           atol=1e-5 * np.abs(expected).max(), err_msg=f"{name} step {step}")
        for rank in range(SIZE):
            np.testing.assert_allclose(obs.residual(rank, g), residuals[rank], rtol=1e-5,
                                       atol=1e-5 * np.abs(residuals[rank]).max(), err_msg=f"{name} residual")
    assert_identical_replicas(obs)
    assert_conservation(obs, config)


def test_default_grouping_merges_up_to_8192_elements(run):
    assert Observed(run, "uniform", SIZE).groups == [[0, 1, 2], [3, 4, 5]]


def test_uniform_density_when_the_rule_is_off(run):
    obs = Observed(run, "uniform", SIZE)
    for step in range(8):
        for group in group_stats(obs, 0, step).values():
            assert group["target"] == int(0.01 * group["numel"])
            assert group["extra"]["rho"] == 0.01 and group["extra"]["alpha"] is None


def lags_rho(t_comp, alpha, beta, numel):
    """The paper's rule, rho = (t - alpha log2 n) / (2 (n-1) beta' m) with beta' = 4 beta per
    element, clipped to [DENSITY, CAP]: the floor when no time is left after the latency, the
    cap on a free network."""
    budget = t_comp - alpha * math.log2(SIZE)
    if budget <= 0:
        return DENSITY
    if beta == 0:
        return CAP
    return min(CAP, max(DENSITY, budget / (2 * (SIZE - 1) * 4 * beta * numel)))


def given_t_comp(obs):
    """Each group's backward time left when it became ready: the gradients computed after its
    last one, GRADIENT_SECONDS * (1 + rank) each, averaged over the ranks."""
    launch_order = obs.meta[0]["launch_order"][-1]
    members = dict(zip(group_names(obs), obs.groups))
    later = {name: sum(len(members[other]) for other in launch_order[i + 1:]) for i, name in enumerate(launch_order)}
    mean_factor = sum(1 + r for r in range(SIZE)) / SIZE
    return {name: count * GRADIENT_SECONDS * mean_factor for name, count in later.items()}


@pytest.mark.parametrize("name", ["adaptive", "calibrated"])
def test_adaptive_densities_follow_the_rule(run, name):
    """Every rank reports the same model, t_comp and density for every group at every step; the
    density is the global one until the model and t_comp are known, then the rule's."""
    obs = Observed(run, name, SIZE)
    t_comp = given_t_comp(obs)
    for step in range(8):
        per_rank = [group_stats(obs, r, step) for r in range(SIZE)]
        for group, stats in per_rank[0].items():
            extra = stats["extra"]
            assert all(other[group]["extra"] == extra and other[group]["target"] == stats["target"]
                       for other in per_rank[1:]), f"ranks disagree on {group} at step {step}"
            if name == "adaptive":  # the given model, from the start
                assert (extra["alpha"], extra["beta"]) == (MODEL["alpha"], MODEL["beta"])
            elif step == 0:  # calibrated at the end of step 0
                assert extra["alpha"] is None and extra["rho"] == DENSITY
                continue
            else:
                assert extra["alpha"] >= 0 and extra["beta"] >= 0
            if step < 1 + MEASURE:  # t_comp is measured over steps 1..MEASURE (step 0 skipped)
                assert extra["t_comp"] is None and extra["rho"] == DENSITY
                continue
            assert extra["t_comp"] == pytest.approx(t_comp[group], rel=1e-12)
            assert extra["rho"] == pytest.approx(lags_rho(t_comp[group], extra["alpha"], extra["beta"],
                                                          stats["numel"]), rel=1e-9)
            assert stats["target"] == max(1, int(extra["rho"] * stats["numel"]))


def test_given_times_give_the_hand_computed_densities(run):
    """With 1/32 s of backward per gradient (1/16 s and 3/32 s on ranks 1 and 2) and the given
    model, the group launched first has 6 gradients' worth of time left on average, the second
    2, the last none: each gets its own density, in (floor, cap) for the first two."""
    obs = Observed(run, "adaptive", SIZE)
    assert obs.groups == [[0], [1, 2], [3, 4, 5]]
    assert obs.meta[0]["launch_order"][-1] == ["group2.p3", "group1.p1", "p0"]
    final = group_stats(obs, 0, 7)
    # rho = (t - 2^-10 log2 3) / (16 * 2^-14 * m) = 1024 (t - 2^-10 log2 3) / m
    latency = 2.0 ** -10 * math.log2(3)
    expected = {"group2.p3": 1024 * (6 / 32 - latency) / 3500, "group1.p1": 1024 * (2 / 32 - latency) / 4160,
                "p0": DENSITY}
    for group, rho in expected.items():
        assert final[group]["extra"]["rho"] == pytest.approx(rho, rel=1e-9), group
    assert DENSITY < expected["group1.p1"] < expected["group2.p3"] < CAP
