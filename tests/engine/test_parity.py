"""PyTorch and TensorFlow agree: the same per-rank gradients, flattened in the same order, through
both front ends (TensorFlow's tape eagerly and inside a ``tf.function``) on real three-worker
horovodrun jobs, give the same groups, the same selected coordinates, the same aggregated gradients
and residuals (up to float rounding) and the same statistics (counts, bytes, and every method-
specific figure such as thresholds or partition tables). MergeComp joins with its grouping from a
cache file (a search's timings, and so its choice, differ between frameworks and runs). Bad
arguments are refused with the same messages by both."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from horovod_sparse.common.mergecomp import MergeCompResult
from tests.support.checks import Observed
from tests.support.launch import run_configs

SIZE = 3
SHAPES = [[50, 40], [40], [30, 7], [3]]


def config(name, method, groups=None, steps=6, stream="normal", **options):
    return {"name": name, "method": method, "options": {"min_numel": 0, **options}, "groups": groups,
            "steps": steps, "seed": 11, "shapes": SHAPES, "stream": stream}


CONFIGS = [
    config("topk_per_tensor", "topk", density=0.05),
    config("topk_model_fp16", "topk", groups="model", density=0.02, fp16_values=True),
    config("topk_two_groups_schedule", "topk", groups=2, density=0.02, density_schedule="piecewise:0.1@2"),
    config("gtopk_model_recall", "gtopk", density=0.05, recall_every=2),
    config("gtopk_ties_paper", "gtopk", groups=2, density=0.05, residual="paper", stream="ties"),
    config("lags_uniform", "lags", density=0.01, adaptive=False, group_size=2000),
    config("micro_histogram", "micro", density=0.05, steps=8),
    config("micro_paper_per_tensor", "micro", groups="tensor", density=0.05, controller="paper"),
    config("exdyna_quantile", "exdyna", density=0.05, steps=8, num_blocks=16),
    config("exdyna_paper_fp16", "exdyna", density=0.05, steps=8, num_blocks=16, balancer="paper",
           controller="paper", fp16_values=True),
    config("threshold_per_tensor", "threshold", density=0.05),
    config("dgc_per_tensor", "dgc", density=0.05),
    config("dgc_momentum_model", "dgc", groups="model", density=0.05, momentum=0.9),
    config("gaussiank_two_groups", "gaussiank", groups=2, density=0.05),
    # groups="mergecomp" becomes MergeCompOptions(cache=...) with MERGECOMP_CACHED (see with_cache)
    config("topk_mergecomp", "topk", groups="mergecomp", density=0.05),
    config("exdyna_mergecomp", "exdyna", groups="mergecomp", density=0.05, steps=8, num_blocks=16),
]
#: The cached MergeComp grouping: the ready order p3, p2, p1, p0 (PyTorch's) cut after p3; each
#: group's buffer holds its members in parameter order.
MERGECOMP_ORDER, MERGECOMP_SPLITS = [3, 2, 1, 0], (1,)
MERGECOMP_CACHED = [[3], [0, 1, 2]]
#: Figures that measure this machine, not the algorithm (at any depth of a record).
UNCOMPARED = {"seconds", "select_seconds"}


def with_cache(cfg, folder: Path, tensorflow: bool):
    """``cfg``, and with ``groups="mergecomp"`` MergeComp reading the grouping MERGECOMP_CACHED
    from a cache file written here for the framework's parameter names (TensorFlow's variables
    named ``p<i>`` like PyTorch's parameters, plus ``:0``); the first step is still dense."""
    if cfg["groups"] != "mergecomp":
        return cfg
    names = [f"p{i}:0" if tensorflow else f"p{i}" for i in MERGECOMP_ORDER]
    result = MergeCompResult(order=names, sizes=[int(np.prod(SHAPES[i])) for i in MERGECOMP_ORDER],
                             splits=MERGECOMP_SPLITS, seconds=1.0, trials=[], search_steps=1, search_seconds=0.0)
    cache = folder / f"{cfg['name']}.mergecomp.json"
    cache.write_text(json.dumps(result.as_dict()))
    return dict(cfg, groups={"mergecomp": {"cache": str(cache)}}, **({"prefix": "p"} if tensorflow else {}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    outputs = {}
    for run, worker, api in (("torch", "torch_exchange.py", None), ("tensorflow", "tf_exchange.py", "tape"),
                             ("tensorflow_traced", "tf_exchange.py", "tape_function")):
        outputs[run] = tmp_path_factory.mktemp(f"parity_{run}")
        configs = [dict(with_cache(c, outputs[run], api is not None), api=api) for c in CONFIGS]
        run_configs(worker, SIZE, outputs[run], configs)
    return outputs


#: The TensorFlow runs compared with PyTorch: the tape eagerly and inside a tf.function.
TF_RUNS = ("tensorflow", "tensorflow_traced")


def observed(runs, name, tf_run):
    return Observed(runs["torch"], name, SIZE), Observed(runs[tf_run], name, SIZE)


def assert_same_figures(torch_value, tf_value, where):
    """Equal, except floats (thresholds, ratios) which agree to float32 rounding."""
    if isinstance(torch_value, dict):
        assert set(torch_value) == set(tf_value), f"{where}: keys differ"
        for key in set(torch_value) - UNCOMPARED:
            assert_same_figures(torch_value[key], tf_value[key], f"{where}.{key}")
    elif isinstance(torch_value, (list, tuple)):
        assert len(torch_value) == len(tf_value), f"{where}: lengths differ"
        for i, (a, b) in enumerate(zip(torch_value, tf_value)):
            assert_same_figures(a, b, f"{where}[{i}]")
    elif isinstance(torch_value, float) or isinstance(tf_value, float):
        assert math.isclose(torch_value, tf_value, rel_tol=1e-5, abs_tol=1e-12), f"{where}: {torch_value} != {tf_value}"
    else:
        assert torch_value == tf_value, f"{where}: {torch_value!r} != {tf_value!r}"


@pytest.mark.parametrize("tf_run", TF_RUNS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_same_groups_coordinates_and_aggregates(runs, cfg, tf_run):
    pt, tf = observed(runs, cfg["name"], tf_run)
    assert pt.groups == tf.groups
    if cfg["groups"] == "mergecomp":
        assert pt.groups == MERGECOMP_CACHED
    for step in range(cfg["steps"]):
        for rank in range(SIZE):
            for members in pt.groups:
                a, b = pt.aggregated(rank, step, members), tf.aggregated(rank, step, members)
                np.testing.assert_array_equal(np.flatnonzero(a), np.flatnonzero(b),
                                              err_msg=f"step {step} rank {rank}: selected coordinates differ")
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(a).max())
    for group in range(len(pt.groups)):
        for rank in range(SIZE):
            a, b = pt.residual(rank, group), tf.residual(rank, group)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(a).max())


@pytest.mark.parametrize("tf_run", TF_RUNS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_same_statistics(runs, cfg, tf_run):
    pt, tf = observed(runs, cfg["name"], tf_run)
    for rank in range(SIZE):
        for step, (a, b) in enumerate(zip(pt.stats(rank), tf.stats(rank))):
            for i, (ga, gb) in enumerate(zip(a["groups"], b["groups"])):
                ga, gb = ({k: v for k, v in g.items() if k != "name"} for g in (ga, gb))
                assert_same_figures(ga, gb, f"rank {rank} step {step} group {i}")
            assert len(a["groups"]) == len(b["groups"])


BAD_OPTIONS = [("topk", {"density": 0}), ("topk", {"density": "0.1"}), ("topk", {"densty": 0.1}),
               ("topk", {"min_numel": -1}), ("topk", {"density_schedule": "piecewise:0.1"}),
               ("tpok", {}), ("gtopk", {"fp16_values": True}), ("gtopk", {"residual": "approx"}),
               ("micro", {"controller": "pid"}), ("exdyna", {"num_blocks": 0}), ("lags", {"group_size": 0})]


@pytest.mark.parametrize("method,options", BAD_OPTIONS)
def test_bad_options_refused_with_the_same_message(method, options):
    import horovod_sparse.tensorflow as hs_tf
    import horovod_sparse.torch as hs_torch

    errors = []
    for framework in (hs_torch, hs_tf):
        with pytest.raises((TypeError, ValueError)) as caught:
            framework.Compression.create(method, **options)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]


def torch_wrapper(**kwargs):
    import torch

    import horovod_sparse.torch as hs_torch

    return hs_torch.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), **kwargs)


def tf_wrapper(**kwargs):
    import tensorflow

    import horovod_sparse.tensorflow as hs_tf

    return hs_tf.DistributedGradientTape(tensorflow.GradientTape(), **kwargs)


@pytest.mark.parametrize("op,extra", [("Adasum", {}), ("Sum", {"gradient_predivide_factor": 2.0}),
                                      ("Average", {"gradient_predivide_factor": 2.0})])
def test_bad_wrapper_arguments_refused_with_the_same_message(op, extra):
    """Frameworks are imported inside the tests: collecting this module stays cheap."""
    import horovod.tensorflow as hvd_tf
    import horovod.torch as hvd_torch

    import horovod_sparse.tensorflow as hs_tf
    import horovod_sparse.torch as hs_torch

    messages = []
    for hvd, hs, wrap in ((hvd_torch, hs_torch, torch_wrapper), (hvd_tf, hs_tf, tf_wrapper)):
        with pytest.raises(ValueError) as caught:
            wrap(compression=hs.Compression.topk(density=0.1), op=getattr(hvd, op), **extra)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
