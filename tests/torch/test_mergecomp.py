"""The MergeComp scheduler (``groups="mergecomp"``) on a real 3-worker horovodrun job, on a model
where per-tensor grouping is slow by construction: 60 four-element tensors and one of 2000, so
per tensor means 61 selections and 122 collectives per step, whole-model one and two.

The step times the scheduler measures are given (the worker's virtual clock, see
``tests/workers/torch_exchange.py``), so its choice is a function of them, not of this
machine's speed: the tests check the times it fed the search, the search it ran and what it
applied."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from horovod_sparse.common.mergecomp import MergeCompOptions, SplitSearch, runs_of
from tests.support.checks import Observed, assert_conservation, assert_identical_replicas
from tests.support.launch import HANG_TIMEOUT, run_configs

SIZE = 3
SHAPES = [[4]] * 60 + [[2000]]
SEARCH = {"warmup_steps": 1, "timed_steps": 3, "refine_budget": 2, "confirm": 2}
PER_TENSOR = tuple(range(1, len(SHAPES)))
#: Given step times (seconds): rank r's step takes (1 + r) * (2^-10 per group + 2^-16 per element
#: of the last group launched), plus 64 s on each candidate's warm-up step and 1024 s on its
#: second timed step. Per tensor costs 61 fixed costs, whole-model a last group of 2240 elements
#: that overlaps nothing. Powers of two keep the virtual clock exact.
STEP_SECONDS = {"per_group": 2.0 ** -10, "per_element": 2.0 ** -16, "extra": [64.0, 0.0, 1024.0, 0.0]}


def config(name, cache, steps=48):
    return {"name": name, "method": "topk", "options": {"density": 0.25, "min_numel": 0},
            "steps": steps, "seed": 2, "shapes": SHAPES, "step_seconds": STEP_SECONDS,
            "groups": {"mergecomp": {**SEARCH, "cache": cache}}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mergecomp")
    cache = str(out / "mergecomp.json")
    configs = [config("search", cache), config("cached", cache, steps=6)]
    run_configs("torch_exchange.py", SIZE, out, configs)
    return out, configs


def given_seconds(result, splits, rank):
    """Rank ``rank``'s given step time with the groups ``splits`` cuts the ready order into
    (the extras left out)."""
    sizes = dict(zip(result["order"], result["sizes"]))
    last = runs_of(result["order"], splits)[-1]
    per_group, per_element = STEP_SECONDS["per_group"], STEP_SECONDS["per_element"]
    return (1 + rank) * (per_group * (len(splits) + 1) + per_element * sum(sizes[n] for n in last))


def agreed_seconds(result, splits):
    """A candidate's time as the ranks should agree it: each rank's median over the timed steps
    (the warm-up step and the 1024 s outlier left out) is its given step time; then the mean
    over ranks, summed in rank order as the worker's allgather does."""
    return sum(given_seconds(result, splits, r) for r in range(SIZE)) / SIZE


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


def assert_search_replayed(result):
    """MergeComp's ``result`` (one rank's) was fed the agreed median step times, and the same
    search fed them here proposes the same candidates and chooses the same; per tensor and
    whole-model are slow by construction, the choice is faster than both; its reported cost is
    its steps and this rank's given times in them (shared with ``tests/tensorflow/test_mergecomp.py``)."""
    for trial in result["trials"]:
        assert trial["seconds"] == pytest.approx(agreed_seconds(result, tuple(trial["splits"])), rel=1e-12)
    search = SplitSearch(result["sizes"], MergeCompOptions(**SEARCH))
    while search.candidate is not None:
        search.record(agreed_seconds(result, search.candidate))
    assert [list(t.splits) for t in search.trials] == [t["splits"] for t in result["trials"]]
    assert tuple(result["splits"]) == search.best.splits
    assert result["seconds"] == pytest.approx(agreed_seconds(result, search.best.splits), rel=1e-12)
    assert result["seconds"] < agreed_seconds(result, PER_TENSOR) / 10
    assert result["seconds"] < agreed_seconds(result, ()) / 4
    per_candidate = SEARCH["warmup_steps"] + SEARCH["timed_steps"]
    assert result["search_steps"] == 1 + len(result["trials"]) * per_candidate
    # rank 0's own step times: per candidate, its given time on every step plus the extras
    own = sum(per_candidate * given_seconds(result, tuple(t["splits"]), 0) + sum(STEP_SECONDS["extra"])
              for t in result["trials"])
    assert result["search_seconds"] == pytest.approx(own, rel=1e-12) and not result["from_cache"]


def test_the_search_is_fed_the_agreed_median_step_times_and_its_choice_applied(run):
    out, _ = run
    result = Observed(out, "search", SIZE).meta[0]["mergecomp"]
    # ready order: the last parameter's gradient first (the worker's loss is a sum)
    assert result["order"] == [f"p{i}" for i in reversed(range(len(SHAPES)))]
    assert_search_replayed(result)
    assert 1 < len(result["groups"]) < len(SHAPES)


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
                            timeout=HANG_TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restored" in result.stdout
