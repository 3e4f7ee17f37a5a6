"""The TensorFlow front end where Horovod users rely on Horovod's own behaviour: the checkpoint
idiom (rank 0 alone restores, then broadcasts) with the tape and with Keras'
BroadcastGlobalVariablesCallback, also after a global swap of Horovod's wrappers for ours,
IndexedSlices gradients, PartialDistributedGradientTape in a TF1-style graph. Real horovodrun
jobs (tests/workers/tf_dropin.py)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.checks import assert_trains_beside_own_collectives
from tests.support.launch import job_fixture, rank_records
from tests.workers.own_collectives import DELIVER_ALL

METHODS = ["topk", "threshold", "dgc", "gaussiank", "micro", "exdyna", "gtopk", "lags", "sparseloco"]
TRACEABLE = ["topk", "threshold", "gtopk", "lags"]
SPARSE = {"density": 0.1, "min_numel": 0}


def tape(method, traced=False, **extra):
    return {"scenario": "tape_checkpoint", "method": method, "options": dict(SPARSE, **extra), "steps": 4,
            "more": 3, "traced": traced}


def keras(method, **extra):
    return {"scenario": "keras_checkpoint", "method": method, "options": dict(SPARSE, **extra), "steps": 4, "more": 3}


TAPES_TWO = ([tape(m, warmup_steps=2) if m in ("topk", "micro") else tape(m, momentum=0.9) if m == "dgc" else tape(m)
              for m in METHODS] + [tape(m, traced=True) for m in TRACEABLE])
KERAS_TWO = [keras("topk", warmup_steps=2), keras("micro"), keras("dgc", momentum=0.9), keras("gtopk")]
# A codebase migrated by a global swap at start-up (hvd.DistributedGradientTape =
# hs.DistributedGradientTape, hvd.DistributedOptimizer = hs.DistributedOptimizer,
# hvd_keras.DistributedOptimizer = hsk.DistributedOptimizer), each config run without and with it:
# without it, a config is the two-worker job's run of the same config (one run, one launch).
SWAP_TAPES = [tape("topk", warmup_steps=2), tape("topk", traced=True), tape("dgc", momentum=0.9)]
SWAP_KERAS = [keras("topk", warmup_steps=2), keras("dgc", momentum=0.9)]
GRAPH = {"scenario": "graph_checkpoint", "method": "none", "steps": 4, "more": 3}
SWAPPED = [dict(config, swap=True) for config in SWAP_TAPES + SWAP_KERAS + [GRAPH]]

TWO = TAPES_TWO + KERAS_TWO + [
    {"scenario": "indexed_slices", "method": "none"},
    {"scenario": "indexed_slices", "method": "topk", "options": SPARSE},
    {"scenario": "graph_mode", "method": "none"},
    {"scenario": "keras_behaviours", "method": "none"},
    {"scenario": "keras_behaviours", "method": "topk", "options": {"density": 1.0, "min_numel": 0},
     "nonfinite": "skip"},
    GRAPH,
] + SWAPPED + [{"scenario": "own_collectives", "method": m} for m in METHODS] + [
    {"scenario": "kept_dense", "method": "topk", "options": SPARSE}]
TAPES_THREE = [tape("topk", warmup_steps=2), tape("exdyna"), tape("gtopk", traced=True), tape("dgc", momentum=0.9)]
KERAS_THREE = [keras("topk", warmup_steps=2), keras("micro")]
THREE = TAPES_THREE + KERAS_THREE

job2 = job_fixture("tf_dropin.py", 2, TWO)
job3 = job_fixture("tf_dropin.py", 3, THREE)


def label(config):
    return f"{config['method']}-{'traced' if config.get('traced') else 'eager'}-{config['options']}"


CASES = ([("job2", 2, TWO, i) for i in range(len(TAPES_TWO))]
         + [("job3", 3, THREE, i) for i in range(len(TAPES_THREE))])


@pytest.mark.parametrize("job_name, np_, configs, index", CASES,
                         ids=[f"n{n}-{label(c[i])}" for _, n, c, i in CASES])
def test_tape_checkpoint_idiom_resumes_in_step(request, job_name, np_, configs, index):
    """Rank 0 alone restores variables and tape state, hvd.broadcast_variables: every rank at
    rank 0's step, replicas bitwise identical, bitwise the original run's continuation with the
    other ranks' per-rank state emptied (the documented residual rule)."""
    ranks = rank_records(request.getfixturevalue(job_name), index, np_)
    assert_resumed_in_step(ranks, configs[index]["steps"] + configs[index]["more"])
    assert max(ranks[0]["residual_norms"]) > 0


def assert_resumed_in_step(ranks, steps):
    """Every rank at rank 0's step ``steps``, a bitwise replica of rank 0 and bitwise its
    ``expected`` continuation."""
    for rank, record in enumerate(ranks):
        assert record["steps"] == steps, f"rank {rank} is at step {record['steps']}, not rank 0's {steps}"
        np.testing.assert_array_equal(np.asarray(record["resumed"]), np.asarray(ranks[0]["resumed"]),
                                      err_msg=f"rank {rank} is not a replica of rank 0")
        np.testing.assert_array_equal(np.asarray(record["resumed"]), np.asarray(record["expected"]),
                                      err_msg=f"rank {rank} did not continue as documented")


def swap_records(job, config):
    """The ranks' records of ``config`` run without and with the global swap."""
    return [rank_records(job, TWO.index(dict(config, swap=True) if swap else config), 2) for swap in (False, True)]


@pytest.mark.parametrize("config", SWAP_TAPES, ids=label)
def test_tape_checkpoint_idiom_after_a_global_swap(job2, config):
    """With ``hvd.DistributedGradientTape = hs.DistributedGradientTape`` at start-up and the tape
    wrapped by Horovod's name: the checkpoint idiom as in
    test_tape_checkpoint_idiom_resumes_in_step, bitwise the run without the swap; Horovod's own
    PartialDistributedGradientTape, which looks DistributedGradientTape up when called, gives ours."""
    plain, swapped = swap_records(job2, config)
    assert_resumed_in_step(swapped, config["steps"] + config["more"])
    assert max(swapped[0]["residual_norms"]) > 0
    for rank in range(2):
        assert swapped[rank]["partial_is_ours"]
        np.testing.assert_array_equal(np.asarray(swapped[rank]["resumed"]), np.asarray(plain[rank]["resumed"]),
                                      err_msg=f"rank {rank}: the swap changed the run")


@pytest.mark.parametrize("config", SWAP_KERAS, ids=lambda c: f"{c['method']}-{c['options']}")
def test_keras_load_model_and_broadcast_callback_after_a_global_swap(job2, config):
    """With ``hvd_keras.DistributedOptimizer = hsk.DistributedOptimizer`` at start-up, rank 0 alone
    resumes through Horovod's ``hvd_keras.load_model(path, compression=<sparsifier>)`` (it wraps
    the loaded optimizer through the swapped name: ours, iterations restored from the file), the
    others build theirs by Horovod's name, BroadcastGlobalVariablesCallback(0): every rank at rank
    0's exchange count and iterations, identical weights, bitwise those of the run without the swap."""
    plain, swapped = swap_records(job2, config)
    steps = config["steps"] + config["more"]
    for rank in range(2):
        assert (swapped[rank]["steps"], swapped[rank]["iterations"]) == (steps, steps)
        np.testing.assert_array_equal(np.asarray(swapped[rank]["weights"]), np.asarray(swapped[0]["weights"]))
        np.testing.assert_array_equal(np.asarray(swapped[rank]["weights"]), np.asarray(plain[rank]["weights"]),
                                      err_msg=f"rank {rank}: the swap changed the run")
    assert max(swapped[0]["residual_norms"]) > 0


def test_tf1_optimizer_checkpoint_idiom_after_a_global_swap(job2):
    """With ``hvd.DistributedOptimizer = hs.DistributedOptimizer`` at start-up, a
    ``tf.compat.v1.train`` optimizer wrapped by Horovod's name in a graph goes to Horovod's own
    wrapper (not back to the swapped name: an endless recursion); rank 0 alone restores,
    hvd.broadcast_global_variables(0): every rank at rank 0's global step, replicas, the
    original run's continuation, bitwise the run without the swap."""
    plain, swapped = swap_records(job2, GRAPH)
    steps = GRAPH["steps"] + GRAPH["more"]
    for records in (plain, swapped):
        assert_resumed_in_step(records, steps)
    np.testing.assert_array_equal(np.asarray(swapped[0]["resumed"]), np.asarray(plain[0]["resumed"]))


KERAS_CASES = ([("job2", 2, TWO, TWO.index(c)) for c in KERAS_TWO]
               + [("job3", 3, THREE, THREE.index(c)) for c in KERAS_THREE])


@pytest.mark.parametrize("job_name, np_, configs, index", KERAS_CASES,
                         ids=[f"n{n}-{c[i]['method']}-{c[i]['options']}" for _, n, c, i in KERAS_CASES])
def test_keras_broadcast_callback_after_rank0_restore(request, job_name, np_, configs, index):
    """model.fit (traced where the method traces) with BroadcastGlobalVariablesCallback after
    rank 0 alone restored weights, iterations and exchanger state: no hang, every rank at rank
    0's exchange count, identical weights after the fit."""
    ranks = rank_records(request.getfixturevalue(job_name), index, np_)
    steps = configs[index]["steps"] + configs[index]["more"]
    for record in ranks:
        assert (record["steps"], record["iterations"]) == (steps, steps)
        np.testing.assert_array_equal(np.asarray(record["weights"]), np.asarray(ranks[0]["weights"]))
    assert max(ranks[0]["residual_norms"]) > 0


def test_indexed_slices_with_compression_none_is_stock_horovod(job2):
    index = TWO.index({"scenario": "indexed_slices", "method": "none"})
    for record in rank_records(job2, index, 2):
        stock, ours = record["stock"], record["ours"]
        assert ours["is_slices"] and stock["is_slices"]
        for key in ("table", "dense"):
            np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(stock[key]))


def test_indexed_slices_rows_exchanged_exactly_with_a_sparsifier(job2):
    """The rows of an IndexedSlices gradient travel as they are, whatever the compression: the
    aggregate is the mean of the ranks' local gradients (as the stock tape gives)."""
    index = TWO.index({"scenario": "indexed_slices", "method": "topk", "options": SPARSE})
    ranks = rank_records(job2, index, 2)
    mean = np.mean([np.asarray(r["ours"]["local"], dtype=np.float64) for r in ranks], axis=0)
    for record in ranks:
        assert record["ours"]["is_slices"]
        np.testing.assert_array_equal(np.asarray(record["ours"]["table"]), np.asarray(record["stock"]["table"]))
        np.testing.assert_allclose(np.asarray(record["ours"]["table"]), mean, rtol=1e-6)


def test_partial_tape_in_a_tf1_graph(job2):
    """PartialDistributedGradientTape in a TF1-style graph and session: with Compression.none the
    stock tape's gradients (local source scaled by 1/size, the other averaged); a sparsifier
    refuses with an error saying to use Horovod's dense compressions there."""
    index = TWO.index({"scenario": "graph_mode", "method": "none"})
    ranks = rank_records(job2, index, 2)
    for record in ranks:
        np.testing.assert_array_equal(np.asarray(record["ours"]["grads"][0]), np.asarray(record["stock"]["grads"][0]))
        np.testing.assert_array_equal(np.asarray(record["ours"]["grads"][1]), np.asarray(record["stock"]["grads"][1]))
        assert "TF1-style graph" in record["sparsifier"]["error"]
    assert ranks[0]["ours"]["grads"][0] != ranks[1]["ours"]["grads"][0]  # local: not averaged
    assert ranks[0]["ours"]["grads"][1] == ranks[1]["ours"]["grads"][1]  # shared: averaged


@pytest.mark.parametrize("method", ["none", "topk"])
def test_keras_behaviours_as_stock(job2, method):
    """Horovod's Keras tests' behaviours, ours against the stock wrapper on the same inputs:
    model.fit with the LearningRateWarmup/Schedule callbacks, backward_passes_per_step=2 and a
    sparse_as_dense embedding (same learning rates, same weights: bitwise with Compression.none,
    float32 rounding apart with Top-k at density 1, whose sum runs in another order),
    get_config/from_config, and aggregation over an Inf gradient (Top-k with nonfinite="skip")."""
    config = next(c for c in TWO if c["scenario"] == "keras_behaviours" and c["method"] == method)
    for record in rank_records(job2, TWO.index(config), 2):
        stock, ours = record["stock"], record["ours"]
        assert ours["rates"] == stock["rates"] and len(set(stock["rates"])) > 1
        assert ours["from_config"] and stock["from_config"]
        assert ours["inf_then_finite"] and stock["inf_then_finite"]
        if method == "none":
            np.testing.assert_array_equal(np.asarray(ours["weights"]), np.asarray(stock["weights"]))
        else:
            np.testing.assert_allclose(np.asarray(ours["weights"]), np.asarray(stock["weights"]), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("method", METHODS)
def test_beside_the_models_own_collectives(job2, method):
    """A Keras model making Horovod collectives of its own in both passes (Horovod's
    SyncBatchNormalization, an allreduce in a layer): every method trains through the tape
    beside them without a hang or a mismatch, replicas identical, and at density 1 the methods
    that deliver everything give the dense run, bitwise."""
    config = next(c for c in TWO if c["scenario"] == "own_collectives" and c["method"] == method)
    assert_trains_beside_own_collectives(rank_records(job2, TWO.index(config), 2), method, DELIVER_ALL)


def test_kept_dense_variables(job2):
    """The tape's ``dense`` keeping the biases dense beside Top-k at density 0.1: at every step
    their gradients are the ranks' average, bitwise (Horovod's allreduce of their own gradients),
    the weights' are not; the biases are one group after the weights' bucket, marked
    ``kept_dense`` and dense in the statistics; a misspelt name and ranks choosing differently raise on every rank,
    naming the near miss and what differs."""
    index = next(i for i, c in enumerate(TWO) if c["scenario"] == "kept_dense")
    for record in rank_records(job2, index, 2):
        weight0, bias0, weight1, bias1 = names = record["names"]
        for exact in record["exact"]:
            assert exact[1] and exact[3], record["exact"]
        assert not any(exact[0] or exact[2] for exact in record["exact"]), record["exact"]
        assert record["groups"] == [[weight0, weight1], [bias0, bias1]]
        assert {s["name"]: (s["dense"], s["kept_dense"]) for s in record["stats"]} == {
            f"group0.{weight0}": (False, False), f"group1.{bias0}": (True, True)}
        assert f"dense={bias0[:-1] + 'O'!r} matches no variable" in record["typo"] and repr(bias0) in record["typo"]
        assert f"dense=[{bias1!r}] (rank 0: [{bias0!r}])" in record["mismatch"], (names, record["mismatch"])
