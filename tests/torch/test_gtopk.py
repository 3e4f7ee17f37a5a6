"""gTop-k through horovod_sparse.torch.DistributedOptimizer on real horovodrun jobs (n = 2..6),
against the slow single-process reference of the same schedule; plus the merge in one process."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from horovod_sparse.methods.gtopk.butterfly import largest_power_of_two, round_count
from horovod_sparse.torch_core.top_k import top_k
from horovod_sparse.methods.gtopk.butterfly import SparseSet
from horovod_sparse.methods.gtopk.exchange import merge
from horovod_sparse.torch import backend
from tests.support.checks import (Observed, assert_conservation, assert_identical_replicas, assert_matches_reference,
                                  raw_group_stream)
from tests.support.launch import run_configs
from tests.support.reference import allgather_method, topk_indices
from tests.support.reference_gtopk import gtopk_method, merge_sets

SHAPES = [[50, 40], [40], [30, 7], [3]]
NUMEL = sum(int(np.prod(s)) for s in SHAPES)
SIZES = [2, 3, 4, 5, 6]


def config(name, density, method="gtopk", steps=6, **extra):
    options = {"density": density, "min_numel": 0, **extra.pop("options", {})}
    return {"name": name, "method": method, "options": options, "steps": steps, "seed": 11,
            "shapes": SHAPES, **extra}


CONFIGS = [
    config("model", 0.05, options={"recall_every": 3}),                    # default grouping: model
    config("ties", 0.05, stream="ties"),                                    # k > non-zeros, tied magnitudes
    config("paper", 0.05, steps=4, options={"residual": "paper"}),
    config("schedule", 0.02, groups=2, options={"density_schedule": "piecewise:0.1@3"}),
    config("topk_schedule", 0.02, method="topk", groups="model",
           options={"density_schedule": "exp_warmup:2;0.5"}),
]
GTOPK = [c for c in CONFIGS if c["method"] == "gtopk"]
EXACT = [c for c in GTOPK if c["options"].get("residual", "exact") == "exact"]
BY_NAME = {c["name"]: c for c in CONFIGS}


def k_at(config, numel):
    """Target count per step, from the config's literal densities (independent of the options
    code): the schedules used above, spelled out."""
    density = config["options"]["density"]
    schedule = config["options"].get("density_schedule")
    if schedule == "piecewise:0.1@3":
        return lambda step: max(1, int((0.1 if step < 3 else density) * numel))
    if schedule == "exp_warmup:2;0.5":
        return lambda step: max(1, int(max(density, 0.5 ** (step // 2 + 1)) * numel))
    assert schedule is None
    return lambda step: max(1, int(density * numel))


def reference_for(config, trace=None):
    def reference(grads):
        k = k_at(config, grads[0][0].size)
        if config["method"] == "topk":
            return allgather_method(grads, lambda x, step: topk_indices(x, k(step)))
        return gtopk_method(grads, k, config["options"].get("residual", "exact"), trace=trace)
    return reference


@pytest.fixture(scope="module", params=SIZES)
def run(request, tmp_path_factory):
    size = request.param
    out = tmp_path_factory.mktemp(f"gtopk_np{size}")
    run_configs("torch_exchange.py", size, out, CONFIGS)
    return size, out


@pytest.mark.parametrize("name", [c["name"] for c in CONFIGS])
def test_matches_reference_of_the_same_schedule(run, name):
    size, out = run
    assert_matches_reference(Observed(out, name, size), BY_NAME[name], reference_for(BY_NAME[name]))


@pytest.mark.parametrize("name", [c["name"] for c in GTOPK])
def test_every_rank_applies_the_identical_global_set_of_k(run, name):
    size, out = run
    obs = Observed(out, name, size)
    assert_identical_replicas(obs)
    cfg = BY_NAME[name]
    for members in obs.groups:
        k = k_at(cfg, sum(int(np.prod(SHAPES[i])) for i in members))
        for step in range(cfg["steps"]):
            first = obs.aggregated(0, step, members)
            for rank in range(1, size):
                np.testing.assert_array_equal(obs.aggregated(rank, step, members), first,
                                              err_msg=f"{name}: rank {rank} step {step}")
            nonzero = np.count_nonzero(first)
            if cfg.get("stream") == "ties":  # k > non-zeros: some of the k selected sums are 0
                assert 0 < nonzero <= k(step)
            else:
                assert nonzero == k(step)
    for rank in range(size):
        for step, record in enumerate(obs.stats(rank)):
            for g in record["groups"]:
                assert g["union"] == g["target"] == k_at(cfg, g["numel"])(step), f"{name}: rank {rank} step {step}"


@pytest.mark.parametrize("name", [c["name"] for c in EXACT])
def test_nothing_lost_across_steps(run, name):
    size, out = run
    assert_conservation(Observed(out, name, size), BY_NAME[name])


def test_statistics_rounds_bytes_and_k(run):
    size, out = run
    obs = Observed(out, "model", size)
    p, k = largest_power_of_two(size), k_at(BY_NAME["model"], NUMEL)(0)
    pair = 8 * k  # float32 value + int32 index
    for step in range(BY_NAME["model"]["steps"]):
        groups = {rank: obs.stats(rank)[step]["groups"] for rank in range(size)}
        assert all(len(g) == 1 for g in groups.values()), "gtopk groups the whole model by default"
        for rank in range(size):
            (g,) = groups[rank]
            assert g["target"] == g["selected"] == g["union"] == k
            extra = g["extra"]
            assert extra["rounds"] == round_count(size)
            expected = [pair if rank < p else 0] * round_count(size)
            if size > p:
                host_of_extra = rank + p < size
                fold_out = pair + k if host_of_extra else 0  # and a byte per coordinate: which were delivered
                expected = [pair if rank >= p else 0, *expected, fold_out]
            assert extra["bytes_per_round"] == expected, f"rank {rank} step {step}"
            recall_bytes = 4 * NUMEL if step % 3 == 0 else 0  # the debug allreduce of recall_every=3
            assert sum(g["sent"].values()) == sum(expected) + recall_bytes


def test_recall_matches_reference(run):
    """Recall of the global set vs the exact top-k of the sum, on the debug steps only (the
    exact top-k may differ at the boundary by the order of the float sums: one coordinate)."""
    size, out = run
    cfg, trace = BY_NAME["model"], []
    reference_for(cfg, trace)(raw_group_stream(cfg, size, [0, 1, 2, 3]))
    k = k_at(cfg, NUMEL)(0)
    obs = Observed(out, "model", size)
    for rank in range(size):
        for step, (record, expected) in enumerate(zip(obs.stats(rank), trace)):
            extra = record["groups"][0]["extra"]
            if step % 3 == 0:
                assert extra["recall"] == pytest.approx(expected["recall"], abs=1 / k)
                assert extra["recall_mass"] == pytest.approx(expected["recall_mass"], rel=1e-3)
                assert 0 < extra["recall"] <= 1 and 0 < extra["recall_mass"] <= 1
            else:
                assert "recall" not in extra and "recall_mass" not in extra


def test_density_schedule_sets_every_steps_target(run):
    size, out = run
    for name in ("schedule", "topk_schedule"):
        obs = Observed(out, name, size)
        for step, record in enumerate(obs.stats(0)):
            for g in record["groups"]:
                assert g["target"] == k_at(BY_NAME[name], g["numel"])(step), f"{name} step {step}"


# -- the merge, in one process -------------------------------------------------------------------
def _as_set(indices, values):
    return SparseSet(torch.tensor(indices, dtype=torch.int64), torch.tensor(values, dtype=torch.float32))


@pytest.mark.parametrize("seed", range(20))
def test_merge_is_symmetric_and_equals_the_reference_merge(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 12))
    sets = []
    for _ in range(2):
        indices = np.sort(rng.choice(30, size=k, replace=False))
        sets.append((indices, rng.integers(-3, 4, size=k).astype(np.float32)))  # many ties, some zeros
    ab = merge(backend, _as_set(*sets[0]), _as_set(*sets[1]), k)
    ba = merge(backend, _as_set(*sets[1]), _as_set(*sets[0]), k)
    assert torch.equal(ab.idx, ba.idx) and torch.equal(ab.val, ba.val)
    expected = merge_sets(*[{int(i): (v, frozenset()) for i, v in zip(*s)} for s in sets], k)
    assert ab.idx.tolist() == sorted(expected)
    assert ab.val.tolist() == [float(expected[i][0]) for i in sorted(expected)]


def test_local_selection_breaks_ties_toward_the_lower_index():
    magnitude = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0, 2.0])
    assert top_k(magnitude, 4).tolist() == [1, 2, 3, 4]
    assert top_k(torch.zeros(6), 3).tolist() == [0, 1, 2]
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.integers(0, 4, size=40).astype(np.float32)
        k = int(rng.integers(1, 40))
        assert top_k(torch.from_numpy(x), k).tolist() == sorted(topk_indices(x, k).tolist())
