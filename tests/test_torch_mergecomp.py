"""The MergeComp scheduler (``groups="mergecomp"``) on a real 3-worker horovodrun job, on a model
where per-tensor grouping is slow by construction: 60 four-element tensors and one of 2000, so
per tensor means 61 selections and 122 collectives per step, whole-model one and two."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.checks import Observed, assert_conservation, assert_identical_replicas
from tests.launch import run_configs

SIZE = 3
SHAPES = [[4]] * 60 + [[2000]]
SEARCH = {"warmup_steps": 1, "timed_steps": 2, "refine_budget": 2, "confirm": 2}
PER_TENSOR = list(range(1, len(SHAPES)))


def config(name, cache, steps=32):
    return {"name": name, "method": "topk", "options": {"density": 0.25, "min_numel": 0},
            "steps": steps, "seed": 2, "shapes": SHAPES,
            "groups": {"mergecomp": {**SEARCH, "cache": cache}}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mergecomp")
    cache = str(out / "mergecomp.json")
    configs = [config("search", cache), config("cached", cache, steps=6)]
    run_configs("torch_exchange.py", SIZE, out, configs)
    return out, configs


def test_every_rank_chooses_the_same_grouping(run):
    out, _ = run
    obs = Observed(out, "search", SIZE)
    results = [meta["mergecomp"] for meta in obs.meta]
    assert results[0] is not None, "the search did not finish"
    for other in results[1:]:
        assert (other["order"], other["splits"], other["trials"]) == \
            (results[0]["order"], results[0]["splits"], results[0]["trials"])
    assert all(meta["groups"] == obs.groups for meta in obs.meta)
    assert sorted(map(sorted, obs.groups)) == sorted(sorted(int(n[1:]) for n in g) for g in results[0]["groups"])


def test_choice_is_faster_than_per_tensor(run):
    out, _ = run
    result = Observed(out, "search", SIZE).meta[0]["mergecomp"]
    measured = {}
    for trial in result["trials"]:
        measured.setdefault(tuple(trial["splits"]), []).append(trial["seconds"])
    times = {splits: float(np.mean(seconds)) for splits, seconds in measured.items()}
    assert tuple(PER_TENSOR) in times and () in times  # both endpoints are always timed
    assert result["splits"] != PER_TENSOR
    assert result["seconds"] == pytest.approx(min(times.values()))
    assert result["seconds"] < times[tuple(PER_TENSOR)]
    # ready order: the last parameter's gradient first (the worker's loss is a sum)
    assert result["order"][0] == f"p{len(SHAPES) - 1}"


def test_search_cost_is_reported(run):
    out, _ = run
    result = Observed(out, "search", SIZE).meta[0]["mergecomp"]
    assert result["search_steps"] == 1 + len(result["trials"]) * (SEARCH["warmup_steps"] + SEARCH["timed_steps"])
    assert result["search_seconds"] > 0 and not result["from_cache"]


def test_nothing_lost_across_regroupings_and_the_users_optimizer_applies(run):
    """Residuals carry over when the grouping changes, and the user's SGD with momentum (not
    the reference's plain SGD) applies every aggregated gradient."""
    out, configs = run
    obs = Observed(out, "search", SIZE)
    assert_identical_replicas(obs)
    assert_conservation(obs, configs[0])
    generator = torch.Generator().manual_seed(configs[0]["seed"])
    params = [torch.nn.Parameter(torch.randn(*s, generator=generator)) for s in SHAPES]
    replay = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    for step in range(configs[0]["steps"]):
        for i, p in enumerate(params):
            p.grad = torch.from_numpy(obs.arrays[0][f"agg_{step}_{i}"]).float()
        replay.step()
    for i, p in enumerate(params):
        np.testing.assert_allclose(obs.arrays[0][f"param_{i}"], p.detach().double().numpy(), rtol=1e-6, atol=1e-6)


def test_cached_grouping_is_reused_without_a_search(run):
    out, _ = run
    searched = Observed(out, "search", SIZE).meta[0]["mergecomp"]
    obs = Observed(out, "cached", SIZE)
    for meta in obs.meta:
        cached = meta["mergecomp"]
        assert cached["from_cache"] and cached["splits"] == searched["splits"] and cached["search_steps"] == 1
    assert obs.groups == Observed(out, "search", SIZE).groups
    # the cached grouping applies right after the recording step
    names = {g["name"] for g in obs.stats(0)[1]["groups"]}
    assert len(names) == len(searched["groups"])


CHECKPOINT_SCRIPT = """
import horovod.torch as hvd, torch
import horovod_sparse.torch as hs
from horovod_sparse.common.mergecomp import MergeCompOptions

hvd.init()
def build():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in [4] * 12 + [300]]
    opt = hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                  named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                  compression=hs.Compression.topk(density=0.2, min_numel=0),
                                  groups=MergeCompOptions(warmup_steps=0, timed_steps=1))
    return params, opt
params, opt = build()
while opt.mergecomp.result is None:
    opt.zero_grad(); sum((p * (i + 1)).sum() for i, p in enumerate(params)).backward(); opt.step()
saved = opt.state_dict()
params2, opt2 = build()
opt2.load_state_dict(saved)
assert opt2.groups == opt.groups, (opt2.groups, opt.groups)
assert opt2.mergecomp.result == opt.mergecomp.result
for name, residual in opt.residuals().items():
    assert torch.equal(opt2.residuals()[name], residual), name
print("restored", len(opt2.groups), "groups")
"""


def test_checkpoint_restores_the_chosen_grouping_and_residuals():
    """A checkpoint taken after the search resumes with the same groups and residuals (one-rank
    Horovod job in a subprocess)."""
    result = subprocess.run([sys.executable, "-c", CHECKPOINT_SCRIPT], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restored" in result.stdout
