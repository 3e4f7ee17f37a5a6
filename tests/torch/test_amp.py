"""The training loops users write (issue 29), on real jobs: mixed precision with a loss scaler
in both PyTorch front ends (``tests/workers/torch_amp.py`` under ``horovodrun``,
``tests/workers/ddp_amp.py`` under ``torchrun``) and gradients that keep their parameter's
layout under fused and foreach optimizers."""
from __future__ import annotations

import numpy as np
import pytest

import horovod_sparse.methods  # noqa: F401  (registers the methods)
from horovod_sparse.common.registry import method_names
from tests.support.checks import Observed
from tests.support.launch import run_configs

NP = 2
METHODS = method_names()
#: LAGS's adaptive rule decides from measured times, which differ between two runs: the exact
#: comparisons take its uniform rule.
OPTIONS = {"density": 0.1, "min_numel": 0}
EXACT = {method: {**OPTIONS, **({"adaptive": False} if method == "lags" else {})} for method in METHODS}
#: The loss scale of every step of the ``units`` runs (powers of two): constant, up, down, below 1.
EXPONENTS = [0, 10, 10, 3, 15, -2, 7, 7]
UNITS_SHAPES = [[30, 20], [20], [40, 30]]
RECIPE_STEPS = 24
#: Far too large a first scale: the first steps overflow in float16 and the scaler backs off.
INIT_EXPONENT = 24

HOROVOD = ([{"name": f"recipe_{m}", "scenario": "recipe", "method": m, "options": OPTIONS, "steps": RECIPE_STEPS,
             "init_exponent": INIT_EXPONENT} for m in [*METHODS, "none"]]
           + [{"name": "recipe_without_scaler_argument", "scenario": "recipe", "method": "topk", "options": OPTIONS,
               "steps": RECIPE_STEPS, "init_exponent": INIT_EXPONENT, "pass_scaler": False},
              {"name": "bfloat16", "scenario": "recipe", "method": "topk", "options": OPTIONS, "steps": RECIPE_STEPS,
               "init_exponent": 0, "autocast": "bfloat16"}]
           + [{"name": f"units_{m}", "scenario": "units", "method": m, "options": EXACT.get(m, {}), "seed": 3,
               "shapes": UNITS_SHAPES, "exponents": EXPONENTS} for m in [*METHODS, "none"]]
           + [{"name": f"layout_{o}", "scenario": "layout", "method": "topk",
               "options": {"density": 0.3, "min_numel": 0}, "optimizer": o}
              for o in ("adamw_fused", "adamw_foreach", "sgd")])
DDP = ([{"name": f"recipe_{m}", "scenario": "recipe", "method": m, "options": {**OPTIONS, "warmup_steps": 1},
         "steps": RECIPE_STEPS, "init_exponent": INIT_EXPONENT} for m in METHODS]
       + [{"name": f"units_{m}", "scenario": "units", "method": m, "options": {**EXACT[m], "warmup_steps": 1},
           "seed": 3, "shapes": UNITS_SHAPES, "exponents": EXPONENTS, "bucket_cap_mb": 0.003} for m in METHODS])


@pytest.fixture(scope="module")
def horovod_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("amp_horovod")
    run_configs("torch_amp.py", NP, out, HOROVOD)
    return out


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("amp_ddp")
    run_configs("ddp_amp.py", NP, out, DDP, backend="torchrun")
    return out


def check_recipe(obs: Observed) -> None:
    """Our run skips the overflowing steps and backs the scale off exactly as the stock run
    (the same scale at every step until the first applied one, where both apply), then trains:
    finite loss, parameters and residuals at every step, the scale growing again after clean
    steps, a lower loss at the end, and the replicas bitwise identical."""
    for rank, record in enumerate(obs.meta):
        stock, ours = record["stock"]["steps"], record["ours"]["steps"]
        first = next(t for t, s in enumerate(stock) if s["moved"])
        assert first >= 2, f"rank {rank}: the stock run overflowed only {first} times: the test lost its point"
        assert [s["scale"] for s in ours[:first + 1]] == [s["scale"] for s in stock[:first + 1]], rank
        assert [s["moved"] for s in ours[:first + 1]] == [False] * first + [True], rank
        assert all(s["residuals_finite"] and np.isfinite(s["loss"]) for s in ours), rank
        assert any(b["scale"] > a["scale"] for a, b in zip(ours[first:], ours[first + 1:])), \
            f"rank {rank}: the scale never grew after the overflows"
        assert ours[-1]["loss"] < ours[first]["loss"], (rank, ours[first]["loss"], ours[-1]["loss"])
        assert np.isfinite(record["ours"]["params"]).all()
    for rank in range(1, obs.size):
        assert obs.meta[rank]["ours"]["params"] == obs.meta[0]["ours"]["params"], f"rank {rank} differs from rank 0"


def check_units(obs: Observed, what: tuple = ("agg", "residual", "param")) -> None:
    """With the gradients scaled by a changing power of two and the scaler given, every step's
    unscaled aggregate, residual and parameter equal the unscaled run's bitwise."""
    for rank, arrays in enumerate(obs.arrays):
        keys = [k for k in arrays if k.startswith("plain_") and k.split("_")[1] in what]
        assert len(keys) >= len(EXPONENTS) * 2, sorted(arrays)
        for key in keys:
            np.testing.assert_array_equal(arrays["scaled" + key[len("plain"):]], arrays[key],
                                          err_msg=f"rank {rank}: {key} differs with the loss scaled")


@pytest.mark.parametrize("method", [*METHODS, "none"])
def test_horovod_amp_recipe_trains_like_stock(horovod_job, method):
    obs = Observed(horovod_job, f"recipe_{method}", NP)
    check_recipe(obs)
    assert all(record["ours"]["warnings"] == [] for record in obs.meta)


def test_horovod_amp_recipe_without_the_scaler_argument_trains_and_says_so_once(horovod_job):
    """Without ``loss_scaler=`` the recipe still skips and backs off as stock Horovod and trains;
    one warning says how to keep the residuals in unscaled units."""
    obs = Observed(horovod_job, "recipe_without_scaler_argument", NP)
    check_recipe(obs)
    for rank, record in enumerate(obs.meta):
        messages = record["ours"]["warnings"]
        assert len(messages) == 1 and "loss_scaler=scaler" in messages[0], (rank, messages)
        assert record["stock"]["warnings"] == []


def test_horovod_bfloat16_autocast_trains(horovod_job):
    """bfloat16 autocast (no loss scaling): every step applied, finite, the loss lower at the end,
    bitwise identical replicas, no warning."""
    obs = Observed(horovod_job, "bfloat16", NP)
    for rank, record in enumerate(obs.meta):
        steps = record["ours"]["steps"]
        assert all(s["moved"] and s["residuals_finite"] and np.isfinite(s["loss"]) for s in steps), rank
        assert steps[-1]["loss"] < steps[0]["loss"] and record["ours"]["warnings"] == [], rank
        assert obs.meta[rank]["ours"]["params"] == obs.meta[0]["ours"]["params"], f"rank {rank} differs from rank 0"


@pytest.mark.parametrize("method", [*METHODS, "none"])
def test_horovod_residuals_in_unscaled_units(horovod_job, method):
    check_units(Observed(horovod_job, f"units_{method}", NP))


@pytest.mark.parametrize("optimizer", ["adamw_fused", "adamw_foreach", "sgd"])
def test_gradients_keep_their_parameters_layout(horovod_job, optimizer):
    """Every ``p.grad`` has ``p``'s strides, and ``channels_last`` / transposed parameters end
    bitwise where contiguous ones do (Top-k selects by magnitude: the same coordinates in
    either memory order)."""
    obs = Observed(horovod_job, f"layout_{optimizer}", NP)
    for rank, (record, arrays) in enumerate(zip(obs.meta, obs.arrays)):
        assert record["strides_kept"], f"rank {rank}: a gradient's strides differ from its parameter's"
        for i in range(4):
            np.testing.assert_array_equal(arrays[f"strided_{i}"], arrays[f"contiguous_{i}"],
                                          err_msg=f"rank {rank}: parameter {i} differs with its layout")


@pytest.mark.parametrize("method", METHODS)
def test_ddp_amp_loop_trains_like_stock(ddp_job, method):
    check_recipe(Observed(ddp_job, f"recipe_{method}", NP))


@pytest.mark.parametrize("method", METHODS)
def test_ddp_residuals_in_unscaled_units(ddp_job, method):
    check_units(Observed(ddp_job, f"units_{method}", NP))
