"""Exact resume for every method (PyTorch): N steps, every rank saves its ``state_dict()``,
fresh ``horovodrun`` processes load them and train N more steps: parameters and the whole
optimizer state (residuals, method state, base optimizer) bitwise equal to 2N steps in one run.
The state that matters is exercised: ExDyna's moved partition boundaries, LAGS's measured
densities (fed given times), MergeComp's chosen grouping, a warm-up and a density schedule
mid-way, DGC's velocity, MiCRO's threshold controller, the default ``min_numel`` (dense and
sparse groups side by side). Loading into another worker count works (state rebuilt, nothing
lost, checked by conservation); loading into another grouping raises a clear ``ValueError``.

Three launches: 2 workers (continuous runs and first halves), 2 fresh workers (second halves,
the grouping mismatch), 3 workers (checkpoints of 2 loaded on 3).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import horovod_sparse.torch  # noqa: F401  (registers the PyTorch methods)
from horovod_sparse.common.registry import method_names
from tests.support import reference_lags
from tests.support.checks import assert_conserved
from tests.support.launch import run_configs
from tests.support.streams import raw_gradient
from tests.torch.test_lags import CAP, DENSITY, GRADIENT_SECONDS, LOCAL_COST, MODEL
from tests.torch.test_lags import SIZE as LAGS_WORKERS

NP, GROWN, HALF = 2, LAGS_WORKERS, 6
#: 1920, 40, 1200 and 7 elements: with the default min_numel (1024) the first and third
#: parameters are sparsified per tensor and the others allreduced dense (the methods whose
#: default is flat buckets are given ``groups="tensor"``: their state is checked per tensor).
SHAPES = [[48, 40], [40], [30, 40], [7]]
#: LAGS fed the given times of tests/torch/test_lags.py (backward time per gradient, alpha-beta
#: model, local costs, floor and cap), with groups of at least 1000 elements: [p0], [p1, p2], [p3].
LAGS = {"method": "lags", "backward_seconds": GRADIENT_SECONDS, "cost_model": MODEL, "local_cost": LOCAL_COST}
LAGS_OPTIONS = {"density": DENSITY, "max_density": CAP, "group_size": 1000}
CONFIGS = [
    # the warm-up (8 dense steps) is still on at the save
    {"name": "topk_warmup", "method": "topk", "options": {"density": 0.05, "warmup_steps": 8}},
    {"name": "threshold", "method": "threshold", "options": {"density": 0.05}},
    # velocity kept per rank; an exponential density warm-up between its stages at the save
    {"name": "dgc", "method": "dgc", "options": {"density": 0.05, "momentum": 0.9, "density_schedule": "exp_warmup:4"}},
    {"name": "gaussiank", "method": "gaussiank", "options": {"density": 0.05, "fp16_values": True}},
    # the published multiplicative threshold rule: its threshold compounds from step to step
    {"name": "micro", "method": "micro", "options": {"density": 0.05, "controller": "paper"}},
    {"name": "exdyna", "method": "exdyna", "options": {"density": 0.05}},
    {"name": "gtopk", "method": "gtopk", "options": {"density": 0.05}},
    # chunks of 256: the 1920-element group is cut into 7 full chunks and a last one of 128
    {"name": "sparseloco", "method": "sparseloco", "options": {"density": 0.05, "chunk_size": 256}},
    # t_comp measured over steps 1-2: the adaptive densities apply from step 3, before the save
    {"name": "lags", **LAGS, "options": {**LAGS_OPTIONS, "measure_steps": 2}},
    # measured over steps 1-8: the save falls in the middle of the measurement
    {"name": "lags_measuring", **LAGS, "options": {**LAGS_OPTIONS, "measure_steps": 8}},
    # MergeComp's search on given step times (one step per candidate) decides before the save
    {"name": "mergecomp", "method": "topk", "options": {"density": 0.05},
     "step_seconds": {"per_group": 2.0 ** -10, "per_element": 2.0 ** -16},
     "groups": {"mergecomp": {"warmup_steps": 0, "timed_steps": 1, "patience": 1, "refine_budget": 0,
                              "confirm": 0}}},
]
for _config in CONFIGS:
    _config.update(shapes=SHAPES, seed=11, half=HALF)
    if _config["method"] in ("topk", "threshold", "dgc", "gaussiank", "sparseloco") and "groups" not in _config:
        _config["groups"] = "tensor"
NAMES = [config["name"] for config in CONFIGS]
#: Top-k's checkpoint (per-tensor groups) loaded into an optimizer with one group for the model.
REGROUP = {**CONFIGS[0], "name": "regroup", "source": "topk_warmup", "groups": "model"}


def phase(configs, name):
    return [{**config, "phase": name} for config in configs]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    run_configs("torch_resume.py", NP, out, phase(CONFIGS, "continuous") + phase(CONFIGS, "first"))
    run_configs("torch_resume.py", NP, out, phase(CONFIGS, "second") + phase([REGROUP], "regroup"))
    run_configs("torch_resume.py", GROWN, out, phase(CONFIGS, "grow"))
    return out


def record(out, name, phase_name, rank):
    return json.loads((out / f"{name}.{phase_name}.rank{rank}.json").read_text())


def saved(out, name, phase_name, rank):
    return torch.load(out / f"{name}.{phase_name}.rank{rank}.pt", weights_only=True)


#: Each rank's own wall-clock statistics of MergeComp's search: after a resume every rank
#: reports rank 0's (the grouping is agreed from rank 0), which decide nothing.
RANK_STATISTICS = {"search_seconds", "search_overhead_seconds"}


def assert_same(a, b, where):
    """``a`` and ``b`` (nested dicts, lists, tensors, numbers) are equal, tensors bitwise
    (MergeComp's :data:`RANK_STATISTICS` left out)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), f"{where}: keys differ"
        for key in a:
            if not (where.endswith(".mergecomp") and key in RANK_STATISTICS):
                assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), f"{where}: {a!r} != {b!r}"


def test_every_registered_method_is_covered():
    assert {config["method"] for config in CONFIGS} == set(method_names())


@pytest.mark.parametrize("name", NAMES)
def test_resume_is_bitwise_the_continuous_run(out, name):
    """Parameters and the whole state dict (residuals, method state, step counter, MergeComp's
    result, LAGS's measurements, the base optimizer's momentum) at step 2N, on every rank."""
    for rank in range(NP):
        continuous, resumed = saved(out, name, "continuous", rank), saved(out, name, "second", rank)
        assert resumed["optimizer"]["horovod_sparse"]["steps"] == 2 * HALF
        assert_same(continuous, resumed, f"{name} rank {rank}")


def stats(out, name, rank=0):
    return record(out, name, "continuous", rank)["stats"]


def groups_at(out, name, step):
    return {group["name"]: group for group in stats(out, name)[step]["groups"]}


def test_the_saved_state_is_the_state_that_matters(out):
    """At the save the state is one a restart from scratch would not reproduce."""
    before, after = HALF - 1, 2 * HALF - 1
    # warm-up on at the save, off at the end
    assert all(g["dense"] for g in groups_at(out, "topk_warmup", before).values())
    assert not groups_at(out, "topk_warmup", after)["p0"]["dense"]
    # default min_numel: p1 and p3 dense, p0 and p2 sparse
    assert {name: g["dense"] for name, g in groups_at(out, "threshold", after).items()} == \
        {"p0": False, "p1": True, "p2": False, "p3": True}
    # the density schedule: 0.0625 of 1920 at the save (stage 2), 0.05 at the end
    assert [groups_at(out, "dgc", step)["p0"]["target"] for step in (0, before, after)] == [480, 120, 96]
    # ExDyna's partition boundaries moved before the save
    bounds = [groups_at(out, "exdyna", step)["group0.p0"]["extra"]["bounds"] for step in range(HALF)]
    assert bounds[-1] != bounds[0]
    # MiCRO's threshold compounds from step to step
    thresholds = [groups_at(out, "micro", step)["group0.p0"]["extra"]["threshold"] for step in range(HALF)]
    assert len(set(thresholds)) == HALF
    # LAGS: adaptive densities above the global one before the save ...
    assert max(g["extra"]["rho"] for g in groups_at(out, "lags", before).values() if not g["dense"]) > 0.01
    # ... and for lags_measuring only once the measurement that spans the save completed (step 8)
    measuring = [max(g["extra"]["rho"] for g in groups_at(out, "lags_measuring", step).values() if not g["dense"])
                 for step in range(2 * HALF)]
    assert measuring[:9] == [0.01] * 9 and measuring[9] > 0.01
    # MergeComp decided before the save, on a grouping that is not per tensor
    result = saved(out, "mergecomp", "first", 0)["optimizer"]["horovod_sparse"]["mergecomp"]
    assert result is not None and result["search_steps"] < HALF
    assert len(record(out, "mergecomp", "continuous", 0)["groups"]) < len(SHAPES)


def test_another_grouping_is_refused_on_every_rank_naming_both(out):
    for rank in range(NP):
        raised, message = record(out, "regroup", "regroup", rank)["raised"]
        assert raised == "ValueError", f"rank {rank}: {raised}: {message}"
        assert "the checkpoint has {'p0': 1920, 'p1': 40, 'p2': 1200, 'p3': 7}" in message
        assert "the model {'group0.p0': 3167}" in message
        assert "build the optimizer (or tape) with the model and groups= the checkpoint was saved with" in message


@pytest.mark.parametrize("name", NAMES)
def test_another_worker_count_loses_nothing_and_rebuilds_the_state(out, name):
    """Checkpoints of 2 workers loaded on 3 (the third rank starts empty, after Horovod's state
    broadcast): residuals loaded bitwise, replicas identical, state built for 3 workers, and
    conservation over the resumed steps counting the loaded residuals."""
    recs = [record(out, name, "grow", rank) for rank in range(GROWN)]
    assert [rec["loaded"] for rec in recs] == [True, True, False]
    for rank in range(NP):
        first = record(out, name, "first", rank)["end_residuals"]
        for i, (loaded, kept) in enumerate(zip(recs[rank]["start_residuals"], first)):
            np.testing.assert_array_equal(loaded, kept, err_msg=f"rank {rank} p{i}: residual not loaded as saved")
    assert not any(np.any(r) for r in recs[2]["start_residuals"])
    final = [saved(out, name, "grow", rank) for rank in range(GROWN)]
    for rank in range(1, GROWN):
        assert_same(final[0]["params"], final[rank]["params"], f"rank {rank} parameters")
    state = final[0]["optimizer"]["horovod_sparse"]
    assert state["steps"] == 2 * HALF
    assert all(group["state"]["world_size"] == GROWN for group in state["groups"].values() if group["state"])
    if name == "exdyna":
        assert len(recs[0]["stats"][-1]["groups"][0]["extra"]["bounds"]) == GROWN + 1
    if name == "lags":  # the loaded models, t_comp and launch order give the rule's counts for 3 workers
        sparse = {g["name"]: g for g in recs[0]["stats"][-1]["groups"] if not g["dense"]}
        order = [group for group, _ in state["method"]["launch_order"]]
        extra = sparse[order[0]]["extra"]
        expected = reference_lags.counts([(sparse[n]["numel"], sparse[n]["extra"]["t_comp"]) for n in order],
                                         extra["alpha"], extra["beta"], GROWN, extra["local_cost"], DENSITY, CAP,
                                         0.02)
        assert {n: sparse[n]["target"] for n in order} == dict(zip(order, expected))
        sparse = list(sparse.values())
        assert any(DENSITY < g["extra"]["rho"] < CAP for g in sparse)
    if name == "dgc":
        return  # momentum correction delivers velocities, not gradients (see the next test)
    for i, shape in enumerate(SHAPES):
        raw = np.array([[rec["start_residuals"][i] for rec in recs]] +
                       [[raw_gradient(11, step, rank, shape, i).reshape(-1) for rank in range(GROWN)]
                        for step in range(HALF, 2 * HALF)])
        delivered = np.sum([step[i] for step in recs[0]["delivered"]], axis=0)
        assert_conserved(delivered, [np.asarray(rec["end_residuals"][i]) for rec in recs], raw, "float32",
                         f"{name} p{i} on {GROWN} workers")


def test_dgc_velocity_survives_another_worker_count(out):
    """On 3 workers the loaded velocity u goes on as u' = 0.9 u + g where not sent (zeroed where
    sent), on the ranks that loaded one; the new rank starts from u' = g."""
    recs = [record(out, "dgc", "grow", rank) for rank in range(GROWN)]
    for rank, rec in enumerate(recs):
        for i, name in ((0, "p0"), (2, "p2")):
            grad = raw_gradient(11, HALF, rank, SHAPES[i], i).reshape(-1).astype(np.float32)
            after = np.asarray(rec["velocity_after"][name])
            before = np.asarray(rec["velocity_before"][name]) if rank < NP else np.zeros_like(after)
            kept = after != 0
            assert kept.sum() > 0.5 * after.size
            np.testing.assert_allclose(after[kept], (np.float32(0.9) * before + grad)[kept], rtol=1e-5,
                                       atol=1e-5 * np.abs(grad).max(), err_msg=f"rank {rank} {name}")
