"""Every ported method through horovod_sparse.tensorflow on real horovodrun jobs (two and three
workers, Gloo; one launch per size for all methods), against the slow single-process references
the PyTorch tests use: aggregated gradients and residuals, identical replicas, conservation, and
each method's own invariant (gTop-k: exactly k coordinates, the same on every rank)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.support.checks import Observed, assert_conservation, assert_identical_replicas, assert_matches_reference
from tests.tensorflow.test_topk import launcher
from tests.support.reference import allgather_method, topk_indices
from tests.support.reference_gtopk import gtopk_method
from tests.support.reference_partitioned import group_stream, partitioned_reference
from tests.support.reference_sparseloco import sparseloco_method
from tests.support import reference_lags
from tests.torch.test_lags import LOCAL_COST, MODEL
from tests.torch.test_threshold_baselines import SELECTORS, dgc_momentum_reference, select_dgc

SHAPES = [[50, 40], [40], [30, 7], [3]]
NUMEL = sum(int(np.prod(s)) for s in SHAPES)
SIZES = [2, 3]


def config(name, method, density, api="tape", steps=6, seed=11, **extra):
    options = {"density": density, "min_numel": 0, **extra.pop("options", {})}
    return {"name": name, "method": method, "options": options, "steps": steps, "seed": seed, "shapes": SHAPES,
            "api": api, **extra}


def constant_k(cfg):
    return lambda numel: (lambda step: max(1, int(cfg["options"]["density"] * numel)))


def gtopk_reference(cfg, k_of=constant_k):
    def reference(grads):
        return gtopk_method(grads, k_of(cfg)(grads[0][0].size), cfg["options"].get("residual", "exact"))
    return reference


def piecewise_k(density_before, until):
    def k_of(cfg):
        return lambda numel: (lambda step: max(1, int((density_before if step < until else cfg["options"]["density"])
                                                      * numel)))
    return k_of


GTOPK = [
    config("gtopk_eager", "gtopk", 0.05),
    config("gtopk_ties_function", "gtopk", 0.05, api="tape_function", stream="ties"),
    config("gtopk_paper_keras", "gtopk", 0.05, api="keras_function", options={"residual": "paper"}),
    config("gtopk_schedule_function", "gtopk", 0.02, api="tape_function", groups=2,
           options={"density_schedule": "piecewise:0.1@3"}),
    config("gtopk_recall_keras_function", "gtopk", 0.05, api="keras_function", options={"recall_every": 2}),
]
#: Sizes 4096, 64, 4096, 100, 2500, 900: with group_size 8192 -> [0, 1, 2], [3, 4, 5].
LAGS_SHAPES = [[64, 64], [64], [64, 64], [100], [50, 50], [30, 30]]
LAGS = [config("lags_uniform_keras_function", "lags", 0.01, api="keras_function", shapes=LAGS_SHAPES,
               options={"adaptive": False})]
#: LAGS's rule on (the default): the alpha-beta model and local costs calibrated on the job, or
#: given (tests/torch/test_lags.py's), traced. Measured over one step after step 0.
LAGS_ADAPTIVE = [config("lags_calibrated_eager", "lags", 0.01, shapes=LAGS_SHAPES, options={"measure_steps": 1}),
                 config("lags_given_keras_function", "lags", 0.01, api="keras_function", shapes=LAGS_SHAPES,
                        options={"measure_steps": 1}, cost_model=MODEL, local_cost=LOCAL_COST)]


def topk_reference(cfg):
    def reference(grads):
        return allgather_method(grads, lambda x, step: topk_indices(x, max(1, int(cfg["options"]["density"] * x.size))))
    return reference


PARTITIONED = [
    config("micro_histogram", "micro", 0.05, steps=8),
    config("micro_paper_keras_function", "micro", 0.05, api="keras_function", steps=8, options={"controller": "paper"}),
    config("exdyna_default", "exdyna", 0.05, steps=8, options={"num_blocks": 16}),
    config("exdyna_paper_keras_function", "exdyna", 0.05, api="keras_function", steps=8,
           options={"controller": "paper", "balancer": "paper", "num_blocks": 16}),
    config("exdyna_silent_rank", "exdyna", 0.05, steps=6, zero_ranks=[1], options={"num_blocks": 16}),
    config("micro_fewer_elements_than_ranks", "micro", 0.05, steps=3, shapes=[[1]]),
]


BASELINES = [
    config("threshold_function", "threshold", 0.05, api="tape_function", steps=8, seed=5),
    config("threshold_keras_function_schedule", "threshold", 0.05, api="keras_function", steps=8, seed=5,
           options={"density_schedule": "piecewise:0.1@3"}),
    config("dgc", "dgc", 0.05, steps=8, seed=5),
    config("dgc_sampled_wide_keras_function", "dgc", 0.05, api="keras_function", steps=8, seed=5,
           options={"sample_ratio": 0.25, "max_adaptations": 2}),
    config("dgc_momentum", "dgc", 0.05, steps=8, seed=5, groups="model", options={"momentum": 0.9}),
    config("gaussiank", "gaussiank", 0.05, steps=8, seed=5),
    config("gaussiank_function", "gaussiank", 0.05, api="tape_function", steps=8, seed=5),
]


def baseline_reference(cfg):
    """The PyTorch tests' slow NumPy selections (written for density 0.05) through the allgather
    reference; the schedule's first steps select at the hard threshold of density 0.1."""
    if cfg["name"] == "dgc_momentum":
        return dgc_momentum_reference
    method, options = cfg["method"], cfg["options"]
    select = (functools.partial(select_dgc, sample_ratio=options["sample_ratio"],
                                max_adaptations=options["max_adaptations"])
              if "sample_ratio" in options else SELECTORS[method])
    if "density_schedule" in options:
        def select(x, step, plain=select):
            if step >= 3:
                return plain(x, step)
            return np.flatnonzero(np.abs(x) >= np.float32(1.0 / (2.0 * np.sqrt(max(1, int(0.1 * x.size))))))
    return functools.partial(allgather_method, select=select)


def partitioned_reference_of(cfg):
    """The reference fed the partitioned tests' streams (with ``zero_ranks``), not the raw ones."""
    def reference(grads):
        stream = group_stream(cfg, len(grads[0]), list(range(len(cfg["shapes"]))))
        updates, residuals, _ = partitioned_reference(stream, cfg["method"], cfg["options"])
        return updates, residuals
    return reference


#: SparseLoCo eager and traced (its exchange is traced into the graph), chunks shorter than the
#: groups (the model's 2253 elements: 35 chunks of 64 and one of 13), 1, 2 and 8 bits and unquantized.
SPARSELOCO = [config("sparseloco_eager", "sparseloco", 0.05, groups="model", options={"chunk_size": 64}),
              config("sparseloco_function", "sparseloco", 0.1, api="tape_function",
                     options={"chunk_size": 64, "bits": 1}),
              config("sparseloco_keras_function", "sparseloco", 0.05, api="keras_function",
                     options={"chunk_size": 300, "bits": 8}),
              config("sparseloco_unquantized_function", "sparseloco", 0.05, api="tape_function",
                     options={"chunk_size": 100, "bits": None})]


def sparseloco_reference(cfg):
    return lambda grads: sparseloco_method(grads, cfg["options"])


REFERENCES = {c["name"]: gtopk_reference(c) for c in GTOPK}
REFERENCES.update({c["name"]: sparseloco_reference(c) for c in SPARSELOCO})
REFERENCES["gtopk_schedule_function"] = gtopk_reference(GTOPK[3], piecewise_k(0.1, 3))
REFERENCES.update({c["name"]: topk_reference(c) for c in LAGS})
REFERENCES.update({c["name"]: partitioned_reference_of(c) for c in PARTITIONED})
REFERENCES.update({c["name"]: baseline_reference(c) for c in BASELINES})
CONFIGS = GTOPK + LAGS + LAGS_ADAPTIVE + PARTITIONED + BASELINES + SPARSELOCO
#: Conservation is checked against the raw streams: not for a silenced rank (its reference
#: check covers updates and residuals exactly), gTop-k's lossy "paper" residual, or DGC's
#: momentum correction (its residual holds velocity, not gradient).
EXACT = [c for c in CONFIGS if c["options"].get("residual", "exact") == "exact" and not c.get("zero_ranks")
         and not c["options"].get("momentum")]
#: The methods a traced step runs on the host (``Sparsifier.host_exchange``), each run eagerly
#: and inside a ``tf.function`` on the same gradients: (name, method, options, eager api, groups).
HOST = [("micro_warmup", "micro", {"warmup_steps": 2}, "tape", None),
        ("exdyna", "exdyna", {"num_blocks": 16}, "keras", None),
        ("dgc_two_groups", "dgc", {"sample_ratio": 0.25}, "tape", 2),
        ("dgc_momentum", "dgc", {"momentum": 0.9}, "keras", "model"),
        ("gaussiank", "gaussiank", {}, "keras", None),
        ("gtopk_recall", "gtopk", {"recall_every": 2}, "tape", None)]
TWINS = [config(f"twin_{name}_{api}", method, 0.05, api=api, steps=5, options=options, groups=groups)
         for name, method, options, eager, groups in HOST for api in (eager, f"{eager}_function")]
#: LAGS with its rule (given model and local costs, so that both twins choose alike).
HOST.append(("lags_given", "lags", {"measure_steps": 1}, "tape", None))
TWINS += [config(f"twin_lags_given_{api}", "lags", 0.05, api=api, steps=5, options={"measure_steps": 1},
                 shapes=LAGS_SHAPES, cost_model=MODEL, local_cost=LOCAL_COST) for api in ("tape", "tape_function")]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return launcher(tmp_path_factory, "tf_methods", lambda size: CONFIGS + (TWINS if size == 2 else []))


@pytest.fixture(params=SIZES)
def gloo_run(request, launches):
    return request.param, launches(request.param)


def reported_topk_reference(obs):
    """Top-k with error feedback per group at the count rank 0 reported for it at each step (a
    group is known by its size)."""
    def reference(grads):
        numel = grads[0][0].size
        counts = [next(g["target"] for g in record["groups"] if g["numel"] == numel) for record in obs.stats(0)]
        return allgather_method(grads, lambda x, step: topk_indices(x, counts[step]))
    return reference


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_matches_slow_reference(gloo_run, cfg):
    size, out = gloo_run
    obs = Observed(out, cfg["name"], size)
    assert_matches_reference(obs, cfg, REFERENCES.get(cfg["name"]) or reported_topk_reference(obs))


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_replicas_identical(gloo_run, cfg):
    size, out = gloo_run
    assert_identical_replicas(Observed(out, cfg["name"], size))


@pytest.mark.parametrize("cfg", EXACT, ids=[c["name"] for c in EXACT])
def test_nothing_lost(gloo_run, cfg):
    size, out = gloo_run
    assert_conservation(Observed(out, cfg["name"], size), cfg)


@pytest.mark.parametrize("cfg", GTOPK, ids=[c["name"] for c in GTOPK])
def test_gtopk_applies_exactly_k_identical_coordinates(gloo_run, cfg):
    size, out = gloo_run
    obs = Observed(out, cfg["name"], size)
    k_of = piecewise_k(0.1, 3)(cfg) if "schedule" in cfg["name"] else constant_k(cfg)
    for members in obs.groups:
        k = k_of(sum(int(np.prod(SHAPES[i])) for i in members))
        for step in range(cfg["steps"]):
            first = obs.aggregated(0, step, members)
            for rank in range(1, size):
                np.testing.assert_array_equal(obs.aggregated(rank, step, members), first)
            if cfg.get("stream") != "ties":  # sparse streams: some selected sums are 0
                assert np.count_nonzero(first) == k(step)
            for rank in range(size):
                (group,) = [g for g in obs.stats(rank)[step]["groups"] if g["numel"] == len(first)]
                assert group["target"] == group["selected"] == group["union"] == k(step)


def test_gtopk_recall_on_debug_steps_only(gloo_run):
    size, out = gloo_run
    for step, record in enumerate(Observed(out, "gtopk_recall_keras_function", size).stats(0)):
        recall = record["groups"][0]["extra"].get("recall")
        assert (recall is not None) == (step % 2 == 0)
        assert recall is None or 0.5 <= recall <= 1.0


def test_lags_without_the_rule_merges_layers_and_sends_the_floor_density(gloo_run):
    """Groups merged up to 8192 elements; with ``adaptive=False`` nothing is measured (t_comp,
    alpha, beta, local_cost None) and every group sends the global density."""
    size, out = gloo_run
    obs = Observed(out, LAGS[0]["name"], size)
    assert obs.groups == [[0, 1, 2], [3, 4, 5]]
    for record in obs.stats(0):
        for group in record["groups"]:
            assert group["target"] == int(0.01 * group["numel"])
            assert group["extra"] == {"rho": 0.01, "t_comp": None, "alpha": None, "beta": None, "local_cost": None}


@pytest.mark.parametrize("cfg", LAGS_ADAPTIVE, ids=[c["name"] for c in LAGS_ADAPTIVE])
def test_lags_rule_applies_with_no_backward_left(gloo_run, cfg):
    """The tape returns every gradient at once: every group's measured t_comp is 0 on every
    rank, and from then on each group sends the count of the rule (tests/support/reference_lags.py, in
    group order, which is launch order) fed the model and local costs the groups report, the same
    on every rank: above the floor only what the 2% slack of the step pays for."""
    size, out = gloo_run
    obs = Observed(out, cfg["name"], size)
    assert obs.groups == [[0, 1, 2], [3, 4, 5]]
    for step in range(cfg["steps"]):
        per_rank = [{g["name"]: g for g in obs.stats(rank)[step]["groups"]} for rank in range(size)]
        for name, group in per_rank[0].items():
            assert all(other[name]["extra"] == group["extra"] and other[name]["target"] == group["target"]
                       for other in per_rank[1:]), f"ranks disagree on {name} at step {step}"
        groups = [per_rank[0][name] for name in sorted(per_rank[0])]
        extra = groups[0]["extra"]
        if "cost_model" in cfg:
            assert (extra["alpha"], extra["beta"], extra["local_cost"]) == (MODEL["alpha"], MODEL["beta"], LOCAL_COST)
        elif step == 0:  # calibrated at the end of step 0
            assert extra["alpha"] is None and extra["local_cost"] is None
        if step < 2:  # step 0 skipped, step 1 measured
            assert all(g["extra"]["t_comp"] is None and g["target"] == int(0.01 * g["numel"]) for g in groups)
            continue
        assert all(g["extra"]["t_comp"] == 0.0 for g in groups)
        expected = reference_lags.counts([(g["numel"], 0.0) for g in groups], extra["alpha"], extra["beta"], size,
                                         extra["local_cost"], 0.01, 0.1, 0.02)
        assert [g["target"] for g in groups] == expected, f"step {step}"
    if "cost_model" in cfg:
        assert expected[0] > int(0.01 * groups[0]["numel"]), "the slack buys the first group more pairs"


@pytest.mark.parametrize("cfg", PARTITIONED, ids=[c["name"] for c in PARTITIONED])
def test_partitioned_decisions_match_the_reference_on_every_rank(gloo_run, cfg):
    """Partition tables, thresholds and counts: the reference's, on every rank, every step."""
    size, out = gloo_run
    obs = Observed(out, cfg["name"], size)
    assert obs.groups == [list(range(len(cfg["shapes"])))], "MiCRO/ExDyna group the whole model by default"
    _, _, records = partitioned_reference(group_stream(cfg, size, obs.groups[0]), cfg["method"], cfg["options"])
    for step, record in enumerate(records):
        for rank in range(size):
            (group,) = obs.stats(rank)[step]["groups"]
            extra = group["extra"]
            assert (extra["bounds"], extra["threshold"], extra["counts"]) == \
                (record.bounds, record.threshold, record.counts), f"rank {rank} step {step}"
            assert group["union"] == sum(record.counts) and group["selected"] == record.counts[rank]


def test_threshold_baselines_report_their_thresholds(gloo_run):
    size, out = gloo_run
    for name in ("threshold_function", "dgc", "gaussiank"):
        for record in Observed(out, name, size).stats(0):
            for group in record["groups"]:
                k = max(1, int(0.05 * group["numel"]))
                assert group["extra"]["threshold"] > 0
                if name == "threshold_function":
                    assert group["extra"]["threshold"] == float(np.float32(1 / (2 * np.sqrt(k))))
                if name == "dgc":
                    assert group["selected"] <= 1.3 * k


def comparable(value):
    """``value`` (nested statistics) without the figures that measure this machine and without
    group names (named after the variables, whose names differ between the twins)."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in ("seconds", "select_seconds", "name")}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


@pytest.mark.parametrize("host", HOST, ids=[h[0] for h in HOST])
def test_host_methods_traced_give_eager_results_bitwise_and_trace_once(launches, host):
    """Inside a tf.function (tape or Keras) the methods that decide on the host give bitwise the
    aggregated gradients, parameters, residuals and statistics of eager mode, and the step is
    not traced again after the first steps (the eager twin's body runs every step: the count
    sees a re-trace)."""
    name, _, options, eager, _ = host
    out = launches(2)
    eager_run, traced = (Observed(out, f"twin_{name}_{api}", 2) for api in (eager, f"{eager}_function"))
    for rank in range(2):
        assert eager_run.arrays[rank].keys() == traced.arrays[rank].keys()
        for key, value in eager_run.arrays[rank].items():
            np.testing.assert_array_equal(traced.arrays[rank][key], value, err_msg=f"rank {rank} {key}")
        assert comparable(traced.stats(rank)) == comparable(eager_run.stats(rank))
        assert eager_run.meta[rank]["traces"] == [1, 2, 3, 4, 5]
        traces = traced.meta[rank]["traces"]
        assert traces[-1] == traces[1] <= 2, traces
    warm = options.get("warmup_steps", 0)
    assert [record["groups"][0]["dense"] for record in traced.stats(0)] == [True] * warm + [False] * (5 - warm)
