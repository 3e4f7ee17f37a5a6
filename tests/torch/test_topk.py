"""Top-k through horovod_sparse.torch.DistributedOptimizer on real horovodrun jobs."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.support.checks import Observed, assert_conservation, assert_exchange_correct, assert_identical_replicas
from tests.support.launch import run_configs
from tests.support.reference import allgather_method, topk_indices

SHAPES = [[50, 40], [40], [30, 7], [3]]


def topk_config(name, density, **extra):
    options = {"density": density, "min_numel": 0, **extra.pop("options", {})}
    return {"name": name, "method": "topk", "options": options, "steps": 12, "seed": 7,
            "shapes": SHAPES, **extra}


CONFIGS = [
    topk_config("per_tensor", 0.05),
    topk_config("model", 0.02, groups="model"),
    topk_config("two_groups", 0.1, groups=2),
    # hierarchical=True on one host: nothing to split, so exactly the flat run of "model"
    topk_config("model_one_host_two_tier", 0.02, groups="model", hierarchical=True),
]


def reference_for(config, size):
    density = config["options"]["density"]

    def select(x, step):
        return topk_indices(x, max(1, int(density * x.size)))

    return functools.partial(allgather_method, select=select)


@pytest.fixture(scope="module", params=[2, 3])
def gloo_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"topk_np{request.param}")
    run_configs("torch_exchange.py", request.param, out, CONFIGS)
    return request.param, out


@pytest.mark.parametrize("config", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_topk_matches_slow_reference_replicas_identical_and_nothing_lost(gloo_run, config):
    size, out = gloo_run
    assert_exchange_correct(Observed(out, config["name"], size), config, reference_for(config, size))


def test_topk_statistics(gloo_run):
    size, out = gloo_run
    obs = Observed(out, "model", size)
    numel = sum(int(np.prod(s)) for s in SHAPES)
    k = int(0.02 * numel)
    for record in obs.stats(0):
        (group,) = record["groups"]
        assert group["target"] == k and group["selected"] == k
        assert k <= group["union"] <= size * k
        assert record["density_ratio"] == pytest.approx(group["union"] / k)
        assert record["bytes_sent"]["values"] == 4 * k and record["bytes_sent"]["indices"] == 4 * k
        assert record["bytes_received"]["values"] == 4 * k * (size - 1)


def test_two_tier_on_one_host_runs_exactly_as_flat(gloo_run):
    size, out = gloo_run
    flat, asked = Observed(out, "model", size), Observed(out, "model_one_host_two_tier", size)
    for rank in range(size):
        assert asked.arrays[rank].keys() == flat.arrays[rank].keys()
        for key, value in flat.arrays[rank].items():
            np.testing.assert_array_equal(asked.arrays[rank][key], value, err_msg=f"rank {rank} {key}")
        assert all(record["bytes_sent"]["node"] == 0 for record in asked.stats(rank))


def test_topk_fp16_values_over_mpi(tmp_path):
    """MPI transport, float16 values on the wire: rounding error stays in the residual."""
    config = topk_config("fp16_mpi", 0.05, groups="model", options={"fp16_values": True})
    run_configs("torch_exchange.py", 2, tmp_path, [config], backend="mpi")
    obs = Observed(tmp_path, config["name"], 2)
    assert_identical_replicas(obs)
    assert_conservation(obs, config, rtol=1e-4)
    assert obs.stats(0)[0]["bytes_sent"]["values"] == 2 * int(0.05 * sum(int(np.prod(s)) for s in SHAPES))


def test_none_through_wrapper_equals_stock_optimizer(tmp_path):
    configs = [{"name": f"stock_{c}", "method": c, "steps": 6, "seed": 3, "shapes": SHAPES,
                "compare_stock": True} for c in ("none", "fp16")]
    run_configs("torch_exchange.py", 2, tmp_path, configs)
    for config in configs:
        obs = Observed(tmp_path, config["name"], 2)
        for rank in range(2):
            ours, stock = obs.params(rank), obs.params(rank, "stock")
            for i in range(len(SHAPES)):
                np.testing.assert_array_equal(ours[f"param_{i}"], stock[f"stock_{i}"])
        # Statistics of a dense step: one allreduce per tensor, its payload in the wire dtype.
        itemsize = 2 if config["method"] == "fp16" else 4
        for record in obs.stats(0):
            assert record["collectives"] == len(SHAPES) and record["target_density"] == 1.0
            assert all(group["dense"] and group["union"] == group["numel"] for group in record["groups"])
            numel = sum(int(np.prod(s)) for s in SHAPES)
            assert record["bytes_sent"]["values"] == record["bytes_received"]["values"] == itemsize * numel

