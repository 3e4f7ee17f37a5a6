"""Keras 3 (``tf.keras`` without ``TF_USE_LEGACY_KERAS``): traced ``model.fit`` through
horovod_sparse.tensorflow.keras.DistributedOptimizer with its broadcast, metric-average and
statistics callbacks, for dense and every method, on one two-worker horovodrun job
(tests/workers/tf_keras3.py): the weights step by step against the slow references of the Keras
2 tests (tests/tensorflow/test_methods.py, tests/tensorflow/test_topk.py), bitwise identical replicas, local
aggregation, the non-finite policy, a LossScaleOptimizer inside the wrapper, and the broadcast of
optimizer state restored on rank 0 alone."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.support.checks import Observed, assert_identical_replicas, assert_matches_reference, raw_group_stream
from tests.support.launch import job_fixture
from tests.support.reference import allgather_method
from tests.tensorflow.test_methods import CONFIGS as METHOD_CONFIGS
from tests.tensorflow.test_methods import REFERENCES, SHAPES
from tests.tensorflow.test_topk import reference_for, topk_config


def of_method(name):
    """The Keras 2 tests' config ``name`` for this job (same gradients, options and reference)."""
    return dict(next(c for c in METHOD_CONFIGS if c["name"] == name), name=f"k3_{name}", reference=name)


DENSE = {"name": "k3_dense", "method": "none", "shapes": SHAPES, "seed": 11, "steps": 4}
TOPK = topk_config("k3_topk", 0.05, "keras3", steps=6)
#: One config per method (dense and every registered one), each checked against its reference.
REFERENCE = [DENSE, TOPK] + [of_method(name) for name in (
    "gtopk_eager", "lags_uniform_keras_function", "micro_histogram", "exdyna_default", "threshold_function",
    "dgc", "gaussiank")]
#: ``model.fit(run_eagerly=True)``: the same wrapper, eagerly.
EAGER = topk_config("k3_topk_eager", 0.05, "keras3", steps=4, run_eagerly=True)
PASSES = topk_config("k3_topk_two_passes", 0.05, "keras3", steps=4, scenario="passes", passes=2)
#: An Inf on rank 1 at the last step.
SKIP = topk_config("k3_topk_skip", 0.05, "keras3", steps=4, scenario="nonfinite", nonfinite="skip", bad=[1, 3])
RAISE = dict(SKIP, name="k3_topk_raise", nonfinite="raise")
SCALER = dict(SKIP, name="k3_topk_scaler", scenario="scaler", initial_scale=16.0)
del SCALER["nonfinite"]
#: The LossScaleOptimizer inside the wrapper with local aggregation: the Inf in both passes of the last step.
SCALER_PASSES = dict(SCALER, name="k3_topk_scaler_two_passes", passes=2)
#: Keras' mixed_float16 policy, a LossScaleOptimizer inside the wrapper.
MIXED = topk_config("k3_topk_mixed_float16", 0.05, "keras3", steps=4, scenario="mixed", initial_scale=16.0)
RESTORED = topk_config("k3_topk_restored", 0.05, "keras3", steps=3, scenario="restored")
CONFIGS = REFERENCE + [EAGER, PASSES, SKIP, RAISE, SCALER, SCALER_PASSES, MIXED, RESTORED]

job = job_fixture("tf_keras3.py", 2, CONFIGS, env={"TF_USE_LEGACY_KERAS": None})


def reference_of(config):
    if config["method"] == "none":
        return functools.partial(allgather_method, select=lambda x, step: np.arange(x.size))
    if config["method"] == "topk":
        return reference_for(config)
    return REFERENCES[config["reference"]]


@pytest.mark.parametrize("config", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_keras_3_traced_fit_from_rank_0s_weights(job, config):
    """Every config ran under Keras 3, traced (but the eager one), and
    BroadcastGlobalVariablesCallback(0) gave every rank rank 0's weights (zeros) before the
    first step."""
    obs = Observed(job, config["name"], 2)
    for rank in range(2):
        assert obs.meta[rank]["tf_keras"].startswith("keras."), obs.meta[rank]["tf_keras"]
        assert obs.meta[rank]["keras"].startswith("3."), obs.meta[rank]["keras"]
        assert obs.meta[rank]["run_eagerly"] == config.get("run_eagerly", False)
        for i in range(len(config["shapes"])):
            np.testing.assert_array_equal(obs.arrays[rank][f"start_{i}"], 0.0, err_msg=f"rank {rank} start {i}")


@pytest.mark.parametrize("config", REFERENCE + [EAGER, PASSES], ids=[c["name"] for c in REFERENCE + [EAGER, PASSES]])
def test_matches_slow_reference_with_identical_replicas(job, config):
    """The update of every step (the weights' difference, SGD at learning rate 1) and the final
    residuals equal the slow reference's to float32 rounding; replicas are bitwise identical."""
    obs = Observed(job, config["name"], 2)
    assert obs.meta[0]["error"] is None, obs.meta[0]["error"]
    assert_matches_reference(obs, config, reference_of(config))
    assert_identical_replicas(obs)


def test_backward_passes_per_step_exchanges_once_per_step(job):
    """With backward_passes_per_step=2 the weights change only at every second batch (the
    aggregated gradient checked above) and ``iterations`` counts every pass, as on Keras 2."""
    obs = Observed(job, PASSES["name"], 2)
    batches = PASSES["steps"] * PASSES["passes"]
    for meta in obs.meta:
        assert meta["unchanged"] == [b for b in range(1, batches + 1) if b % PASSES["passes"]]
        assert meta["iterations"] == batches


def test_metric_average_callback_averages_the_loss_over_ranks(job):
    """MetricAverageCallback: both ranks report the mean over ranks of their own epoch loss
    (``<w, x>`` per batch, recomputed here from the weights before each step)."""
    obs = Observed(job, DENSE["name"], 2)
    members = list(range(len(SHAPES)))
    stream = raw_group_stream(DENSE, 2, members)
    start = obs.params(0, "start")
    weights = np.concatenate([start[f"start_{i}"].reshape(-1) for i in members])
    losses = [[] for _ in range(2)]
    for step in range(DENSE["steps"]):
        for rank in range(2):
            losses[rank].append(float(weights.astype(np.float32) @ stream[step][rank].astype(np.float32)))
        weights = weights - obs.aggregated(0, step, members)
    expected = np.mean([np.mean(per_rank) for per_rank in losses])
    for meta in obs.meta:
        assert meta["history"]["loss"] == obs.meta[0]["history"]["loss"]
        np.testing.assert_allclose(meta["history"]["loss"][0], expected, rtol=1e-4)


def test_sparsification_stats_callback_under_keras_3(job):
    """SparsificationStatsCallback adds the epoch's figures to the logs: Top-k's union density
    between the target and twice it, the mean of the steps' statistics; a fraction of dense's bytes."""
    topk, dense = Observed(job, TOPK["name"], 2), Observed(job, DENSE["name"], 2)
    for rank in range(2):
        history, steps = topk.meta[rank]["history"], topk.meta[rank]["stats"]
        union = history["union_density"][0]
        assert 0.05 <= union <= 2 * 0.05 + 1e-9
        assert union == pytest.approx(np.mean([s["union_density"] for s in steps]))
        assert history["bytes_sent"][0] < dense.meta[rank]["history"]["bytes_sent"][0] / 5
        assert dense.meta[rank]["history"]["union_density"][0] == 1.0


def assert_updates_before(obs, config, steps):
    """The updates of the first ``steps`` steps equal the reference's."""
    before = dict(config, steps=steps)
    for members in obs.groups:
        updates, _ = reference_of(config)(raw_group_stream(before, obs.size, members))
        for step, expected in enumerate(updates):
            for rank in range(obs.size):
                np.testing.assert_allclose(obs.aggregated(rank, step, members), expected, rtol=1e-5,
                                           atol=1e-5 * float(np.abs(expected).max()))


@pytest.mark.parametrize("config", [SKIP, SCALER], ids=["skip", "loss_scale_optimizer"])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(job, config):
    """An Inf on rank 1 at the last step: no rank applies it (weights and ``iterations`` as
    before), the steps before match the reference, replicas stay identical; with
    nonfinite='skip' the step is reported abandoned, and a LossScaleOptimizer inside the wrapper
    skips it on every rank and halves its scale (the scale divided out of the residuals: the
    earlier steps are the unscaled reference's)."""
    obs = Observed(job, config["name"], 2)
    last = config["bad"][1]
    assert_updates_before(obs, config, last)
    assert_identical_replicas(obs)
    for meta in obs.meta:
        assert meta["error"] is None, meta["error"]
        assert meta["unchanged"] == [last + 1]
        assert meta["iterations"] == last
        assert meta["stats"][last]["abandoned"] is True
        if config is SCALER:
            assert meta["loss_scale"] == config["initial_scale"] / 2


def test_nonfinite_raise_stops_fit_on_every_rank_without_an_update(job):
    """nonfinite='raise': model.fit raises on every rank with the policy's message (through the
    traced step's tf.errors error), and the abandoned step changed nothing."""
    obs = Observed(job, RAISE["name"], 2)
    last = RAISE["bad"][1]
    assert_updates_before(obs, RAISE, last)
    assert_identical_replicas(obs)
    for meta in obs.meta:
        assert "non-finite (NaN/Inf) gradient on rank(s) [1] at step 3" in meta["error"]["message"], meta["error"]
        assert meta["iterations"] == last and meta["final_is_last_recorded"]


def test_broadcast_callback_sends_rank_0s_optimizer_state(job):
    """Rank 0 alone holds optimizer state (momentum buffers, iterations 5) when fit begins: after
    the broadcast every rank trains from it, replicas bitwise identical, iterations 5 + steps."""
    obs = Observed(job, RESTORED["name"], 2)
    assert_identical_replicas(obs)
    for meta in obs.meta:
        assert meta["error"] is None, meta["error"]
        assert meta["iterations"] == 5 + RESTORED["steps"]


def test_a_loss_scale_optimizer_inside_with_two_passes_skips_the_inf_step_everywhere(job):
    """backward_passes_per_step=2 with a LossScaleOptimizer inside the wrapper, the Inf in both
    passes of the last step: the weights change only at the exchanging batches before it, whose
    updates match the reference; no rank applies the last step; ``iterations`` counts every
    pass but the skipped update; the step is reported abandoned and the scale halves on every
    rank."""
    obs = Observed(job, SCALER_PASSES["name"], 2)
    last, batches = SCALER_PASSES["bad"][1], SCALER_PASSES["steps"] * SCALER_PASSES["passes"]
    assert_updates_before(obs, SCALER_PASSES, last)
    assert_identical_replicas(obs)
    for meta in obs.meta:
        assert meta["error"] is None, meta["error"]
        assert meta["unchanged"] == [b for b in range(1, batches) if b % 2] + [batches]
        assert meta["iterations"] == batches - 1
        assert meta["stats"][-1]["abandoned"] is True
        assert meta["loss_scale"] == SCALER_PASSES["initial_scale"] / 2


def test_mixed_float16_fit_matches_the_reference_on_float16_gradients(job):
    """Keras' mixed_float16 policy with a LossScaleOptimizer inside the wrapper (compile keeps
    it as given): the model computes in float16 over float32 variables, so the gradient reaching
    the exchange is the stream rounded to float16 (scaling by 16 and back is exact); each step's
    update and the residuals equal the reference's on that rounded stream, replicas are bitwise
    identical, and the scale stays 16 (nothing overflowed)."""
    obs = Observed(job, MIXED["name"], 2)
    for meta in obs.meta:
        assert meta["error"] is None, meta["error"]
        assert (meta["compute_dtype"], meta["variable_dtype"]) == ("float16", "float32")
        assert meta["optimizer_is_ours"] and meta["loss_scale"] == MIXED["initial_scale"]

    def on_float16(stream):
        return reference_of(MIXED)([[g.astype(np.float16).astype(g.dtype) for g in per_rank] for per_rank in stream])

    assert_matches_reference(obs, MIXED, on_float16)
    assert_identical_replicas(obs)
