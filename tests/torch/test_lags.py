"""LAGS-SGD through horovod_sparse.torch.DistributedOptimizer on a real 3-worker horovodrun job."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support import reference_lags
from tests.support.checks import Observed, assert_conservation, assert_identical_replicas, raw_group_stream
from tests.support.launch import run_configs
from tests.support.reference import allgather_method, topk_indices
from tests.torch.test_grouping import group_names

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
#: Given local costs (seconds per element scanned, per pair selected, per pair applied).
LOCAL_COST = {"select_element": 2.0 ** -24, "select_pair": 2.0 ** -16, "apply_pair": 2.0 ** -18}
FREE = dict.fromkeys(LOCAL_COST, 0.0)
CONFIGS = [
    # The reference's setting: rule off, every group at the global density.
    {"name": "uniform", "method": "lags", "options": {"density": 0.01, "adaptive": False}},
    # The rule on (default), fed given times: the backward time each gradient takes, the
    # alpha-beta model and the local costs, so the densities it chooses are known in advance.
    {"name": "adaptive", "method": "lags", "backward_seconds": GRADIENT_SECONDS, "cost_model": MODEL,
     "local_cost": LOCAL_COST, "options": ADAPTIVE},
    # The same with free local work and no slack: the wire alone decides, as in the paper, but
    # on one link.
    {"name": "wire_only", "method": "lags", "backward_seconds": GRADIENT_SECONDS, "cost_model": MODEL,
     "local_cost": FREE, "options": {**ADAPTIVE, "slack": 0.0}},
    # The alpha-beta model and the local costs calibrated on the job (allgathers, selections and
    # scatter-adds timed at the end of step 0): the densities follow the rule from whatever was
    # measured.
    {"name": "calibrated", "method": "lags", "backward_seconds": GRADIENT_SECONDS, "options": ADAPTIVE},
    # Calibrated after two dense warm-up steps: the local costs are timed at the end of the first
    # step that has a sparse group (step 2); t_comp is measured over steps 1 and 2 as without.
    {"name": "warmup", "method": "lags", "backward_seconds": GRADIENT_SECONDS,
     "options": {**ADAPTIVE, "warmup_steps": 2}},
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


def expected_counts(obs, rank, step):
    """The rule's counts (tests/support/reference_lags.py) from what the groups report at ``step``: the
    model, local costs, step time and t_comp agreed over the ranks, in the measured launch order."""
    stats = group_stats(obs, rank, step)
    extra = next(iter(stats.values()))["extra"]
    order = [name for name in obs.meta[0]["launch_order"][-1] if not stats[name]["dense"]]
    groups = [(stats[name]["numel"], stats[name]["extra"]["t_comp"]) for name in order]
    counts = reference_lags.counts(groups, extra["alpha"], extra["beta"], SIZE, extra["local_cost"], DENSITY, CAP,
                                   0.0 if extra["local_cost"] == FREE else 0.02)
    return dict(zip(order, counts))


def given_t_comp(obs):
    """Each group's backward time left when it became ready: the gradients computed after its
    last one, GRADIENT_SECONDS * (1 + rank) each, averaged over the ranks."""
    launch_order = obs.meta[0]["launch_order"][-1]
    members = dict(zip(group_names(obs), obs.groups))
    later = {name: sum(len(members[other]) for other in launch_order[i + 1:]) for i, name in enumerate(launch_order)}
    mean_factor = sum(1 + r for r in range(SIZE)) / SIZE
    return {name: count * GRADIENT_SECONDS * mean_factor for name, count in later.items()}


@pytest.mark.parametrize("name", ["adaptive", "wire_only", "calibrated"])
def test_adaptive_densities_follow_the_rule(run, name):
    """Every rank reports the same model, local costs, t_comp and density for every group at
    every step; the density is the global one until they are known, then the rule's."""
    obs = Observed(run, name, SIZE)
    t_comp = given_t_comp(obs)
    for step in range(8):
        per_rank = [group_stats(obs, r, step) for r in range(SIZE)]
        for group, stats in per_rank[0].items():
            extra = stats["extra"]
            assert all(other[group]["extra"] == extra and other[group]["target"] == stats["target"]
                       for other in per_rank[1:]), f"ranks disagree on {group} at step {step}"
            if name != "calibrated":  # the given models, from the start
                assert (extra["alpha"], extra["beta"]) == (MODEL["alpha"], MODEL["beta"])
                assert extra["local_cost"] == (LOCAL_COST if name == "adaptive" else FREE)
            elif step == 0:  # calibrated at the end of step 0
                assert extra["alpha"] is None and extra["local_cost"] is None and extra["rho"] == DENSITY
                continue
            else:
                assert extra["alpha"] >= 0 and extra["beta"] >= 0 and min(extra["local_cost"].values()) >= 0
            if step < 1 + MEASURE:  # t_comp is measured over steps 1..MEASURE (step 0 skipped)
                assert extra["t_comp"] is None and extra["rho"] == DENSITY
                assert stats["target"] == int(DENSITY * stats["numel"])
                continue
            assert extra["t_comp"] == pytest.approx(t_comp[group], rel=1e-12)
            assert stats["target"] == expected_counts(obs, 0, step)[group], f"{group} at step {step}"
            floor = int(DENSITY * stats["numel"])
            assert extra["rho"] == (DENSITY if stats["target"] == floor else stats["target"] / stats["numel"])


def test_given_times_give_the_hand_computed_densities(run):
    """With 1/32 s of backward per gradient (1/16 s and 3/32 s on ranks 1 and 2) and the given
    model (0.98 ms per pair on the wire), the group launched first has 6 gradients' worth of
    time left on average, the second 2, the last none. With free local work and no slack the
    first group's allgather may run until the second's must start to end with backward: the
    first gets 1024 (6/32 - 2 alpha log2 3) - 41 pairs, the others their floor (the paper's
    rule, each group on its own, gave the second 1024 (2/32 - alpha log2 3) = 62 pairs too,
    which the link cannot carry). With priced local work and the default 2% slack of the span
    from the first launch to the step's end (6/32 s + 40 pairs' wire time: 4.6 ms, under 5 pairs'
    wire time) the first gets a few more pairs, paid from the slack."""
    wire_only = Observed(run, "wire_only", SIZE)
    assert wire_only.groups == [[0], [1, 2], [3, 4, 5]]
    assert wire_only.meta[0]["launch_order"][-1] == ["group2.p3", "group1.p1", "p0"]
    latency = 2.0 ** -10 * np.log2(3)
    first = int(1024 * (6 / 32 - 2 * latency) - 41)
    assert first == 147
    final = {name: g["target"] for name, g in group_stats(wire_only, 0, 7).items()}
    assert final == {"group2.p3": first, "group1.p1": 41, "p0": 40}
    priced = {name: g["target"] for name, g in group_stats(Observed(run, "adaptive", SIZE), 0, 7).items()}
    assert first < priced["group2.p3"] <= first + 4 and priced["group1.p1"] == 41 and priced["p0"] == 40


def test_the_rule_applies_after_a_dense_warm_up(run):
    """Dense warm-up steps give LAGS no sparse group to time its local costs on: it times them at
    the end of the first sparse step, and the rule's counts apply once t_comp is measured."""
    obs = Observed(run, "warmup", SIZE)
    assert all(g["dense"] for step in (0, 1) for g in group_stats(obs, 0, step).values())
    assert next(iter(group_stats(obs, 0, 2).values()))["extra"]["local_cost"] is None
    assert min(next(iter(group_stats(obs, 0, 3).values()))["extra"]["local_cost"].values()) >= 0
    for step in range(3, 8):
        expected = expected_counts(obs, 0, step)
        for rank in range(SIZE):
            assert {n: g["target"] for n, g in group_stats(obs, rank, step).items()} == expected
