"""Grouping is its own axis: every compression x every grouping on real horovodrun jobs.

One launch runs the whole matrix (every name ``hs.Compression.names()`` lists, so methods join
as they land) plus the Horovod-semantics configs; the assertions read what the workers wrote.
"""
from __future__ import annotations

import numpy as np
import pytest

import horovod_sparse.common.methods  # noqa: F401  (fills the registry)
from horovod_sparse.common import registry
from tests.checks import Observed, assert_conservation, assert_identical_replicas
from tests.launch import run_configs

#: Sizes 2000, 40, 210, 3, 400, 64: "size:256" merges [0], [1, 2, 3, 4], [5].
SHAPES = [[50, 40], [40], [30, 7], [3], [20, 20], [64]]
STEPS = 10
GROUPINGS = {
    "tensor": "tensor",
    "model": "model",
    "int2": 2,
    "size256": "size:256",
    "lists": [[3, 1], [4, 0]],
    "mergecomp": {"mergecomp": {"warmup_steps": 0, "timed_steps": 1, "refine_budget": 1, "confirm": 2}},
}
EXPECTED_GROUPS = {
    "tensor": [[0], [1], [2], [3], [4], [5]],
    "model": [[0, 1, 2, 3, 4, 5]],
    "int2": [[0, 1, 2], [3, 4, 5]],
    "size256": [[0], [1, 2, 3, 4], [5]],
    "lists": [[1, 3], [0, 4], [2], [5]],  # Horovod: listed groups first, the rest one each
}
#: Horovod's dense path (``none``; ``fp16`` takes the same path) and every registered method.
METHODS = ["none", *registry.method_names()]


def matrix_config(method, grouping):
    options = {} if method == "none" else {"density": 0.1, "min_numel": 0}
    return {"name": f"{method}-{grouping}", "method": method, "options": options, "steps": STEPS,
            "seed": 11, "shapes": SHAPES, "groups": GROUPINGS[grouping]}


MATRIX = [matrix_config(m, g) for m in METHODS for g in GROUPINGS]
SEMANTICS = [
    # Horovod's own optimizer side by side: groups as lists and accumulation keep its semantics.
    {"name": "stock-lists-passes", "method": "none", "steps": 6, "seed": 5, "shapes": SHAPES,
     "groups": [[3, 1], [4, 0]], "backward_passes": 3, "compare_stock": True},
    {"name": "stock-int-passes", "method": "none", "steps": 6, "seed": 5, "shapes": SHAPES,
     "groups": 2, "backward_passes": 2, "compare_stock": True},
    # Sparse exchanges with accumulation over passes: nothing lost, replicas identical.
    *[{**matrix_config(m, g), "name": f"passes-{m}-{g}", "backward_passes": 2}
      for m in ("topk", "lags") for g in ("tensor", "size256", "mergecomp")],
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grouping")
    run_configs("torch_exchange.py", 2, out, MATRIX + SEMANTICS)
    return out


@pytest.mark.parametrize("config", MATRIX + SEMANTICS[2:], ids=lambda c: c["name"])
def test_replicas_identical_and_nothing_lost(run, config):
    obs = Observed(run, config["name"], 2)
    assert_identical_replicas(obs)
    assert_conservation(obs, config)
    assert obs.meta[1]["groups"] == obs.groups


@pytest.mark.parametrize("grouping", sorted(EXPECTED_GROUPS))
def test_groups_formed_as_asked(run, grouping):
    for method in METHODS:
        assert Observed(run, f"{method}-{grouping}", 2).groups == EXPECTED_GROUPS[grouping], method


def test_mergecomp_result_identical_on_every_rank_and_applied(run):
    for method in METHODS:
        obs = Observed(run, f"{method}-mergecomp", 2)
        result = obs.meta[0]["mergecomp"]
        assert result is not None, f"{method}: the search did not finish in {STEPS} steps"
        assert obs.meta[1]["mergecomp"]["splits"] == result["splits"]
        assert obs.meta[1]["mergecomp"]["trials"] == result["trials"]
        chosen = [[int(name[1:]) for name in group] for group in result["groups"]]
        assert sorted(map(sorted, chosen)) == sorted(map(sorted, obs.groups))
        # Step 0 is the dense recording step; afterwards the groups follow the candidates.
        assert all(group["dense"] for group in obs.stats(0)[0]["groups"])


def test_groups_launch_in_backprop_order(run):
    """The worker's loss is a sum over parameters, so backprop produces their gradients last
    parameter first; every group is launched when its last gradient arrives."""
    for grouping in ("tensor", "model", "int2", "size256", "lists"):
        obs = Observed(run, f"topk-{grouping}", 2)
        names = {tuple(sorted(g)): name for g, name in zip(obs.groups, group_names(obs))}
        expected = [names[tuple(sorted(g))] for g in sorted(obs.groups, key=lambda g: -min(g))]
        for step_order in obs.meta[0]["launch_order"]:
            assert step_order == expected, grouping


def group_names(obs):
    """The name the optimizer gives each group (its first parameter, or groupN.<first>)."""
    return [f"p{g[0]}" if len(g) == 1 else f"group{i}.p{g[0]}" for i, g in enumerate(obs.groups)]


@pytest.mark.parametrize("name", ["stock-lists-passes", "stock-int-passes"])
def test_lists_and_backward_passes_match_horovods_optimizer(run, name):
    obs = Observed(run, name, 2)
    for rank in range(2):
        ours, stock = obs.params(rank), obs.params(rank, "stock")
        for i in range(len(SHAPES)):
            np.testing.assert_allclose(ours[f"param_{i}"], stock[f"stock_{i}"], rtol=1e-6, atol=1e-7)
