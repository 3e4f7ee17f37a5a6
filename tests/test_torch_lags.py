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
SLEEP = 0.03
CONFIGS = [
    # The reference's setting: rule off, every group at the global density.
    {"name": "uniform", "method": "lags", "options": {"density": 0.01, "adaptive": False}},
    # The rule on (default); a backward slow enough (30 ms per gradient) that early groups
    # have time to send more than the floor.
    {"name": "adaptive", "method": "lags", "backward_sleep": SLEEP,
     "options": {"density": 0.01, "max_density": 0.2, "measure_steps": 2, "group_size": 3000}},
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
                                              lambda x, step: topk_indices(x, counts[step]))
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
        for name, group in group_stats(obs, 0, step).items():
            assert group["target"] == int(0.01 * group["numel"])
            assert group["extra"]["rho"] == 0.01 and group["extra"]["alpha"] is None


def test_adaptive_densities_follow_the_rule_from_the_measured_model(run):
    obs = Observed(run, "adaptive", SIZE)
    density, cap, measure = 0.01, 0.2, 2
    adapted = set()
    for step in range(8):
        per_rank = [group_stats(obs, r, step) for r in range(SIZE)]
        for name, group in per_rank[0].items():
            extra = group["extra"]
            assert all(other[name]["extra"] == extra and other[name]["target"] == group["target"]
                       for other in per_rank[1:]), f"ranks disagree on {name} at step {step}"
            if step == 0:  # the model is calibrated at the end of step 0
                assert extra["alpha"] is None and extra["rho"] == density
                continue
            alpha, beta, t_comp = extra["alpha"], extra["beta"], extra["t_comp"]
            assert alpha >= 0 and beta > 0
            if step <= 1 + measure - 1:  # t_comp is measured over steps 1..measure (step 0 skipped)
                assert t_comp is None and extra["rho"] == density
                continue
            # rho = (t - alpha log2 n) / (2 (n-1) beta' m), beta' = 4 beta per element; clipped
            rho = (t_comp - alpha * math.log2(SIZE)) / (2 * (SIZE - 1) * 4 * beta * group["numel"])
            assert extra["rho"] == pytest.approx(min(cap, max(density, rho)), rel=1e-9)
            assert group["target"] == max(1, int(extra["rho"] * group["numel"]))
            if extra["rho"] > density:
                adapted.add(name)
    launch_order = obs.meta[0]["launch_order"][-1]
    t_comp = {name: group_stats(obs, 0, 7)[name]["extra"]["t_comp"] for name in launch_order}
    # Each gradient takes SLEEP seconds: the first group launched has the most backward left.
    assert t_comp[launch_order[0]] >= SLEEP * 0.8 and t_comp[launch_order[-1]] == 0.0
    assert launch_order[0] in adapted and launch_order[-1] not in adapted
