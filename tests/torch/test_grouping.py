"""Grouping is its own axis: every compression x every grouping on real horovodrun jobs.

One launch runs the whole matrix (every name ``hs.Compression.names()`` lists, so methods join
as they land) plus the Horovod-semantics configs; the assertions read what the workers wrote.
Each config is checked against the slow reference of ``tests.support.reference_grouping`` fed the same
gradients and the same groups (which coordinates each step delivers, their values, the final
residuals), for conservation and for identical replicas. The matrix runs at ``min_numel=0``
(every group sparse); the ``defaults-*`` configs at the default ``min_numel`` (groups below it go
dense) with warm-up steps, which the reference models the same way.
"""
from __future__ import annotations

import numpy as np
import pytest

import horovod_sparse.methods  # noqa: F401  (fills the registry)
from horovod_sparse.common import registry
from horovod_sparse.common.options import SparsifierOptions
from tests.support.checks import Observed, assert_conservation, assert_identical_replicas
from tests.support.launch import run_configs
from tests.support.reference_grouping import group_exchange, model_reference
from tests.support.streams import raw_gradient

#: Sizes 2000, 40, 210, 3, 400, 64: "size:256" merges [0], [1, 2, 3, 4], [5].
SHAPES = [[50, 40], [40], [30, 7], [3], [20, 20], [64]]
STEPS = 10
GROUPINGS = {
    "tensor": "tensor",
    "model": "model",
    "int2": 2,
    "size256": "size:256",
    "buckets": "buckets:0.002",  # 2,097 bytes: a bucket closes before 2.1 kB of float32
    "lists": [[3, 1], [4, 0]],
    "mergecomp": {"mergecomp": {"warmup_steps": 0, "timed_steps": 1, "refine_budget": 1, "confirm": 2}},
}
EXPECTED_GROUPS = {
    "tensor": [[0], [1], [2], [3], [4], [5]],
    "model": [[0, 1, 2, 3, 4, 5]],
    "int2": [[0, 1, 2], [3, 4, 5]],
    "size256": [[0], [1, 2, 3, 4], [5]],
    "buckets": [[3, 4, 5], [1, 2], [0]],  # 256 + 1600 + 12 bytes, then 840 + 160, then 8000 alone
    "lists": [[1, 3], [0, 4], [2], [5]],  # Horovod: listed groups first, the rest one each
}
#: Horovod's dense path (``none``; ``fp16`` takes the same path) and every registered method.
METHODS = ["none", *registry.method_names()]


#: The density the threshold baselines' reference selections are written for; LAGS at the
#: uniform density (its adaptive densities follow measured backward times, tested with given
#: times in ``tests/torch/test_lags.py``).
DENSITY = 0.05


def matrix_config(method, grouping, **options):
    """``options`` besides these: ``min_numel=None`` leaves the default."""
    if method != "none":
        options = {"density": DENSITY, "min_numel": 0, **({"adaptive": False} if method == "lags" else {}),
                   **options}
        options = {key: value for key, value in options.items() if value is not None}
    return {"name": f"{method}-{grouping}", "method": method, "options": options, "steps": STEPS,
            "seed": 11, "shapes": SHAPES, "groups": GROUPINGS[grouping]}


MATRIX = [matrix_config(m, g) for m in METHODS for g in GROUPINGS]
#: SparseLoCo's 2-D blocks (4 x 4) on groups of several parameters: each cut by its own shape.
BLOCKS = [{**matrix_config("sparseloco", "buckets", blocks=True, chunk_size=16, density=0.125),
           "name": "sparseloco_blocks-buckets"}]
#: The defaults users get: ``min_numel`` left at 1024 (of the size:256 groups of 2000, 653 and 64
#: elements only the first is sparse) and dense warm-up steps first.
DEFAULTS = [{**matrix_config(m, "size256", min_numel=None, warmup_steps=3), "name": f"defaults-{m}"}
            for m in METHODS[1:]]
SEMANTICS = [
    # Horovod's own optimizer side by side: groups as lists and accumulation keep its semantics.
    {"name": "stock-lists-passes", "method": "none", "steps": 6, "seed": 5, "shapes": SHAPES,
     "groups": [[3, 1], [4, 0]], "backward_passes": 3, "compare_stock": True},
    {"name": "stock-int-passes", "method": "none", "steps": 6, "seed": 5, "shapes": SHAPES,
     "groups": 2, "backward_passes": 2, "compare_stock": True},
    # Sparse exchanges with accumulation over passes: the reference's selection, nothing lost, replicas identical.
    *[{**matrix_config(m, g), "name": f"passes-{m}-{g}", "backward_passes": 2}
      for m in ("topk", "lags") for g in ("tensor", "size256", "mergecomp")],
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grouping")
    run_configs("torch_exchange.py", 2, out, MATRIX + BLOCKS + DEFAULTS + SEMANTICS)
    return out


CHECKED = MATRIX + BLOCKS + DEFAULTS + SEMANTICS[2:]


@pytest.mark.parametrize("config", CHECKED, ids=lambda c: c["name"])
def test_replicas_identical_and_nothing_lost(run, config):
    obs = Observed(run, config["name"], 2)
    assert_identical_replicas(obs)
    assert_conservation(obs, config)
    assert obs.meta[1]["groups"] == obs.groups


def is_dense(config, step, numel):
    """Which groups go through Horovod's dense allreduce, by the documented rule: every group of
    the dense method, every group during ``warmup_steps`` and in MergeComp's first (recording)
    step, and groups of fewer than ``min_numel`` elements."""
    options = config["options"]
    return (config["method"] == "none" or step < options.get("warmup_steps", 0)
            or numel < options.get("min_numel", SparsifierOptions.min_numel)
            or (isinstance(config["groups"], dict) and step == 0))


def assert_matches_model_reference(obs, config, groups_at):
    """Per step and group, the coordinates every rank's aggregated gradient is non-zero at are
    exactly those the reference delivers, the values agree with it, and so do the final
    residuals; ``groups_at[t]``: the groups of step t."""
    stream = [[[raw_gradient(config["seed"], t, r, shape, i).reshape(-1) for i, shape in enumerate(config["shapes"])]
               for r in range(obs.size)] for t in range(config["steps"])]
    updates, residuals = model_reference(
        stream, groups_at, lambda step, numel: is_dense(config, step, numel),
        lambda members: group_exchange(config["method"], config["options"], sum(stream[0][0][i].size for i in members),
                                       obs.size, [config["shapes"][i] for i in members]))
    name = config["name"]
    for step, expected_step in enumerate(updates):
        for g, members in enumerate(groups_at[step]):
            expected = np.concatenate([expected_step[i] for i in members])
            for rank in range(obs.size):
                got = obs.aggregated(rank, step, members)
                where = f"{name}: group {g} {members}, step {step}, rank {rank}"
                np.testing.assert_array_equal(np.flatnonzero(got), np.flatnonzero(expected),
                                              err_msg=f"{where}: coordinates delivered")
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()),
                                           err_msg=where)
    for g, members in enumerate(obs.groups):
        for rank in range(obs.size):
            expected = np.concatenate([residuals[rank][i] for i in members])
            np.testing.assert_allclose(obs.residual(rank, g), expected, rtol=1e-5,
                                       atol=1e-5 * float(np.abs(expected).max() + 1e-12),
                                       err_msg=f"{name}: residual of group {g} {members} on rank {rank}")


@pytest.mark.parametrize("config", CHECKED, ids=lambda c: c["name"])
def test_every_step_matches_the_reference(run, config):
    """The same gradients and groups (as each step launched them) through the slow reference."""
    obs = Observed(run, config["name"], 2)
    assert obs.meta[1]["step_groups"] == obs.meta[0]["step_groups"]
    assert_matches_model_reference(obs, config, obs.meta[0]["step_groups"])


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


#: Each method's grouping for ``groups=None``: flat buckets of at most 25 MiB, except the methods
#: defined on other groups (LAGS's merging up to 8192 elements; one group for MiCRO, ExDyna and gTop-k).
DEFAULT_GROUPING = {"lags": "size:8192", "micro": "model", "exdyna": "model", "gtopk": "model"}


@pytest.mark.parametrize("method", METHODS[1:])
def test_groups_none_takes_the_methods_default(method):
    """Without ``groups=`` the optimizer's groups are the method's default: on float32 tensors of
    16, 4 and 16 MiB, buckets of 25 MiB hold the last two together and the first alone."""
    import torch

    import horovod_sparse.torch as hs
    from horovod_sparse.torch.parameters import flat_groups

    ordered = [(f"p{i}", torch.empty(n << 20, device="meta")) for i, n in enumerate([4, 1, 4])]
    expected = {"buckets": [["p1", "p2"], ["p0"]], "size:8192": [["p0"], ["p1"], ["p2"]],
                "model": [["p0", "p1", "p2"]]}[DEFAULT_GROUPING.get(method, "buckets")]
    compression = hs.Compression.create(method, density=0.01)
    assert [g.names for g in flat_groups(ordered, None, compression.default_grouping, ())] == expected
