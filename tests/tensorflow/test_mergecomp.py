"""The MergeComp scheduler (``groups="mergecomp"``) in TensorFlow, on a real 3-worker horovodrun
job: the PyTorch test's model and given step times (``tests/torch/test_mergecomp.py``), through
the tape eagerly and inside a ``tf.function``, and through Keras traced.

The tape returns every gradient at once, so the order MergeComp records is the variable order: the
model lists the PyTorch test's tensors in reverse, which is the order PyTorch sees them ready in. The
step times it measures are given (a virtual clock), so the search it runs, the times it is fed
and its choice are checked exactly against the shared ``SplitSearch`` fed the same times here."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.checks import Observed, assert_conservation, assert_identical_replicas
from tests.support.launch import HANG_TIMEOUT, run_configs
from tests.torch.test_mergecomp import SEARCH, SHAPES, SIZE, STEP_SECONDS, assert_search_replayed

#: The search takes 41 steps (the recording step, then 10 candidates of SEARCH's 1 + 3 steps);
#: three more run with the chosen groups.
STEPS = 44
#: The PyTorch test's ready order (its last tensor, of 2000 elements, first), as variables.
TF_SHAPES = SHAPES[::-1]


def config(name, api, cache, steps=STEPS):
    return {"name": name, "api": api, "method": "topk", "options": {"density": 0.25, "min_numel": 0},
            "steps": steps, "seed": 2, "shapes": TF_SHAPES, "step_seconds": STEP_SECONDS, "prefix": "p",
            "groups": {"mergecomp": {**SEARCH, "cache": cache}}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tf_mergecomp")
    cache = str(out / "mergecomp.json")
    configs = [config("eager", "tape", None), config("traced", "tape_function", None),
               config("keras_traced", "keras_function", cache), config("cached", "tape", cache, steps=6)]
    # Without tensor fusion every dense allreduce sums each element in the same order in every run:
    # fused, an element's place in the ring depends on what else was ready, and 3 float32 terms
    # then round differently from run to run (the traced and eager runs compare bitwise).
    run_configs("tf_exchange.py", SIZE, out, configs, env={"HOROVOD_FUSION_THRESHOLD": "0"})
    return out, {c["name"]: c for c in configs}


SEARCHED = ["eager", "traced", "keras_traced"]


@pytest.mark.parametrize("name", SEARCHED)
def test_every_rank_chooses_the_same_grouping_and_applies_it(run, name):
    out, _ = run
    obs = Observed(out, name, SIZE)
    results = [meta["mergecomp"] for meta in obs.meta]
    assert results[0] is not None, "the search did not finish"
    agreed = ("order", "sizes", "splits", "trials", "groups", "seconds", "search_steps")
    for other in results[1:]:  # search_seconds is each rank's own wall time
        assert {k: other[k] for k in agreed} == {k: results[0][k] for k in agreed}
    assert all(meta["groups"] == obs.groups for meta in obs.meta)
    assert obs.groups == [[int(n[1:].split(":")[0]) for n in g] for g in results[0]["groups"]]
    # Every step after the search ran with the chosen groups.
    chosen = [[g["name"], g["numel"]] for g in obs.stats(0)[-1]["groups"]]
    assert len(chosen) == len(obs.groups)
    for record in obs.stats(0)[results[0]["search_steps"]:]:
        assert [[g["name"], g["numel"]] for g in record["groups"]] == chosen


@pytest.mark.parametrize("name", SEARCHED)
def test_the_search_is_fed_the_agreed_median_step_times(run, name):
    out, _ = run
    result = Observed(out, name, SIZE).meta[0]["mergecomp"]
    assert result["order"] == [f"p{i}:0" for i in range(len(TF_SHAPES))]  # the variable order
    assert_search_replayed(result)


@pytest.mark.parametrize("name", SEARCHED)
def test_nothing_lost_across_regroupings(run, name):
    out, configs = run
    obs = Observed(out, name, SIZE)
    assert_identical_replicas(obs)
    assert_conservation(obs, configs[name])


def test_traced_steps_give_the_eager_results_bitwise(run):
    """Regrouping inside a ``tf.function`` (the step runs on the host): the same groups, step
    after step, and bitwise the same aggregated gradients, residuals and variables as eagerly."""
    out, _ = run
    eager, traced = Observed(out, "eager", SIZE), Observed(out, "traced", SIZE)
    for rank in range(SIZE):
        assert [[g["name"] for g in r["groups"]] for r in traced.stats(rank)] == \
            [[g["name"] for g in r["groups"]] for r in eager.stats(rank)]
        assert eager.arrays[rank].keys() == traced.arrays[rank].keys()
        for key, value in eager.arrays[rank].items():
            np.testing.assert_array_equal(traced.arrays[rank][key], value, err_msg=f"rank {rank} {key}")
    assert max(traced.meta[0]["traces"]) <= 2


def test_cached_grouping_is_reused_without_a_search(run):
    out, _ = run
    searched = Observed(out, "keras_traced", SIZE)
    obs = Observed(out, "cached", SIZE)
    for meta in obs.meta:
        cached = meta["mergecomp"]
        assert cached["from_cache"] and cached["splits"] == searched.meta[0]["mergecomp"]["splits"]
        assert cached["search_steps"] == 1
    assert obs.groups == searched.groups
    assert len(obs.stats(0)[1]["groups"]) == len(searched.groups)  # right after the recording step


CHECKPOINT_SCRIPT = """
import horovod.tensorflow as hvd, numpy as np, tensorflow as tf
import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from horovod_sparse.common.mergecomp import MergeCompOptions

hvd.init()
def build(values=None):
    values = values or [np.full(n, 1.0 + i, np.float32) for i, n in enumerate([4] * 12 + [300])]
    variables = [tf.Variable(v, name=f"v{i}") for i, v in enumerate(values)]
    opt = hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=hs.Compression.topk(
        density=0.2, min_numel=0), groups=MergeCompOptions(warmup_steps=0, timed_steps=1))
    return variables, opt
def step(variables, opt, t):
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * v * (i + 1 + t % 3)) for i, v in enumerate(variables)])
    grads = [g for g, _ in opt.compute_gradients(loss, variables, tape)]
    opt.apply_gradients(zip(grads, variables))
    return [g.numpy() for g in grads]
variables, opt = build()
t = 0
while opt.exchanger.mergecomp is None or opt.exchanger.mergecomp.result is None:
    step(variables, opt, t); t += 1
saved = opt.exchanger.state_dict()
variables2, opt2 = build([v.numpy() for v in variables])
opt2.exchanger.load_state_dict(saved)
for later in range(t, t + 3):
    ours, theirs = step(variables, opt, later), step(variables2, opt2, later)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs)), later
assert opt2.exchanger.groups() == opt.exchanger.groups() and len(opt.exchanger.groups()) < 13, opt.exchanger.groups()
assert opt2.exchanger.mergecomp.result == opt.exchanger.mergecomp.result
for name, residual in opt.exchanger.residuals().items():
    assert np.array_equal(opt2.exchanger.residuals()[name].numpy(), residual.numpy()), name
print("restored", len(opt2.exchanger.groups()), "groups")
"""


def test_checkpoint_restores_the_chosen_grouping_and_residuals():
    """A checkpoint taken after the search resumes with the same groups and residuals: the next
    steps give bitwise the same gradients (one-rank Horovod job in a subprocess)."""
    result = subprocess.run([sys.executable, "-c", CHECKPOINT_SCRIPT], capture_output=True, text=True,
                            timeout=HANG_TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                       "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restored" in result.stdout
