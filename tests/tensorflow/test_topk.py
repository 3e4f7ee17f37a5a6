"""Top-k through horovod_sparse.tensorflow (DistributedGradientTape and the Keras optimizer, eager
and inside tf.function) on real horovodrun jobs, checked against the slow NumPy reference."""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from tests.support.checks import Observed, assert_conservation, assert_exchange_correct, assert_identical_replicas
from tests.support.launch import run_configs
from tests.support.reference import allgather_method, topk_indices

SHAPES = [[50, 40], [40], [30, 7], [3]]
NUMEL = sum(int(np.prod(s)) for s in SHAPES)


def topk_config(name, density, api, **extra):
    options = {"density": density, "min_numel": 0, **extra.pop("options", {})}
    return {"name": name, "method": "topk", "options": options, "steps": 8, "seed": 7, "shapes": SHAPES,
            "api": api, **extra}


CONFIGS = [
    topk_config("tape_per_tensor", 0.05, "tape"),
    topk_config("tape_function_model", 0.02, "tape_function", groups="model"),
    topk_config("keras_two_groups", 0.1, "keras", groups=2),
    topk_config("keras_function_model", 0.03, "keras_function", groups="model"),
    topk_config("tape_warmup_min_numel", 0.05, "tape", groups="tensor", options={"warmup_steps": 3, "min_numel": 100}),
    topk_config("function_schedule", 0.02, "tape_function", groups="model",
                options={"density_schedule": "piecewise:0.1@3"}),
    # Horovod's local aggregation (backward_passes_per_step) with the exchange plugged in.
    topk_config("keras_function_two_passes", 0.05, "keras_function", backward_passes=2),
    # Warm-up inside a tf.function: the dense and the sparse step are both traced (tf.cond).
    topk_config("keras_function_warmup", 0.05, "keras_function", groups="tensor",
                options={"warmup_steps": 3, "min_numel": 100}),
]


def reference_for(config):
    """Top-k per group, with the dense cases (warm-up steps, groups below min_numel) selecting
    every coordinate, and the density schedule applied."""
    options = config["options"]
    stages = options.get("density_schedule")
    switch = [(float(d), int(s)) for d, s in (stage.split("@") for stage in stages.split(":")[1].split(";"))] \
        if stages else []

    def select(x, step):
        if step < options.get("warmup_steps", 0) or x.size < options["min_numel"]:
            return np.arange(x.size)
        density = next((d for d, until in switch if step < until), options["density"])
        return topk_indices(x, max(1, int(density * x.size)))

    return functools.partial(allgather_method, select=select)


STOCK = [{"name": f"stock_{method}_{api}", "method": method, "steps": 5, "seed": 3, "shapes": SHAPES,
          "api": api, "compare_stock": True}
         for method, api in [("none", "tape"), ("fp16", "tape_function"), ("none", "keras_function"),
                             ("fp16", "keras")]]
FP16 = topk_config("fp16_values", 0.05, "keras_function", groups="model", options={"fp16_values": True})
#: A sparsifier given to Horovod's own wrappers refuses instead of silently dropping gradient.
STOCK_REFUSALS = [dict(topk_config(f"stock_refuses_{api}", 0.05, api), stock=True, expect_error=True)
                  for api in ("tape", "keras_function")]
#: Configs checked at one size only ride along in the two-worker launch (a launch costs seconds).
TWO_WORKERS_ONLY = [*STOCK, FP16, *STOCK_REFUSALS]


def launcher(tmp_path_factory, prefix, configs_for_size):
    """``run(size)``: the output folder of one horovodrun launch of ``tf_exchange.py`` with
    ``configs_for_size(size)``, launched on first use and shared by the tests (a launch costs
    seconds of start-up per worker); a failed launch fails every test that needs it, once."""
    done = {}

    def run(size):
        if isinstance(done.get(size), Exception):
            raise done[size]
        if size not in done:
            out = tmp_path_factory.mktemp(f"{prefix}_np{size}")
            try:
                run_configs("tf_exchange.py", size, out, configs_for_size(size))
            except AssertionError as failure:
                done[size] = failure
                raise
            done[size] = out
        return done[size]

    return run


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return launcher(tmp_path_factory, "tf_topk", lambda size: CONFIGS + (TWO_WORKERS_ONLY if size == 2 else []))


@pytest.fixture(params=[2, 3])
def gloo_run(request, launches):
    return request.param, launches(request.param)


@pytest.fixture
def np2_extra_run(launches):
    return launches(2), FP16


@pytest.mark.parametrize("config", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_topk_matches_slow_reference_replicas_identical_and_nothing_lost(gloo_run, config):
    size, out = gloo_run
    assert_exchange_correct(Observed(out, config["name"], size), config, reference_for(config))


def test_topk_statistics(gloo_run):
    size, out = gloo_run
    obs = Observed(out, "tape_function_model", size)
    k = int(0.02 * NUMEL)
    for step, record in enumerate(obs.stats(0)):
        (group,) = record["groups"]
        assert record["step"] == step
        assert group["target"] == k and group["selected"] == k and not group["dense"]
        assert k <= group["union"] <= size * k
        assert record["density_ratio"] == pytest.approx(group["union"] / k)
        assert record["bytes_sent"]["values"] == 4 * k and record["bytes_sent"]["indices"] == 4 * k
        assert record["bytes_received"]["values"] == 4 * k * (size - 1)
        assert record["collectives"] == 2


def test_schedule_and_warmup_statistics(gloo_run):
    size, out = gloo_run
    schedule = Observed(out, "function_schedule", size).stats(0)
    assert [r["groups"][0]["target"] for r in schedule] == [int(0.1 * NUMEL)] * 3 + [int(0.02 * NUMEL)] * 5
    for name in ("tape_warmup_min_numel", "keras_function_warmup"):
        warmup = Observed(out, name, size).stats(0)
        assert [r["step"] for r in warmup] == list(range(8))
        assert all(g["dense"] for r in warmup[:3] for g in r["groups"])
        for record in warmup[3:]:
            dense = [g["dense"] for g in record["groups"]]
            assert sum(dense) == 2, "the two tensors below min_numel stay dense after warm-up"
    eager = Observed(out, "tape_warmup_min_numel", size).stats(0)
    assert all(g["seconds"] for g in eager[3]["groups"] if not g["dense"]), "eager steps are timed"


@pytest.mark.parametrize("config", STOCK, ids=[c["name"] for c in STOCK])
def test_dense_compression_equals_stock_horovod(np2_extra_run, config):
    """With Horovod's Compression.none / fp16 the wrappers are Horovod's, bit for bit."""
    out, _ = np2_extra_run
    obs = Observed(out, config["name"], 2)
    for rank in range(2):
        ours, stock = obs.params(rank), obs.params(rank, "stock")
        for i in range(len(SHAPES)):
            np.testing.assert_array_equal(ours[f"param_{i}"], stock[f"stock_{i}"])
    record = obs.stats(0)[0]
    itemsize = 2 if config["method"] == "fp16" else 4
    assert record["union_density"] == 1.0 and record["bytes_sent"]["values"] == itemsize * NUMEL


def test_fp16_values_keep_rounding_in_residual(np2_extra_run):
    out, config = np2_extra_run
    obs = Observed(out, config["name"], 2)
    assert_identical_replicas(obs)
    assert_conservation(obs, config, rtol=1e-4)
    assert obs.stats(0)[0]["bytes_sent"]["values"] == 2 * int(0.05 * NUMEL)


@pytest.mark.parametrize("config", STOCK_REFUSALS, ids=[c["name"] for c in STOCK_REFUSALS])
def test_horovods_own_wrappers_refuse_a_sparsifier(launches, config):
    error = json.loads((launches(2) / f"{config['name']}.rank0.json").read_text())["error"]
    assert error["type"] == "TypeError"
    assert "horovod_sparse.tensorflow.DistributedGradientTape" in error["message"]
