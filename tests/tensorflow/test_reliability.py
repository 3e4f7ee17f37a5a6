"""Reliability of the TensorFlow front end under horovodrun, as ``tests/torch/test_reliability.py``
checks the PyTorch one: configuration mismatches, dtypes, variables without gradients (exact
resume: ``tests/tensorflow/test_resume.py``; non-finite gradients: ``tests/common/test_nonfinite.py``). Every
launch has a timeout, so a hang fails the test instead of stalling the suite."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.launch import HANG_TIMEOUT, job_fixture, worker_env
from tests.support.mismatch import assert_every_rank_refused, wrapper_cases
from tests.torch.test_reliability import conserved, records, same_on_all_ranks
from tests.workers.tf_reliability import SHAPES

NP = 2
STEPS = 5
DTYPES = ("float32", "float64", "float16", "bfloat16")

#: A mismatch in every field of the exchanger's configuration fingerprint (``tests/support/mismatch.py``).
#: TensorFlow's front ends refuse SparseLoCo's error_decay and blocks on every rank that gives one
#: (tests/tensorflow/test_api.py): there is no mismatch of them to agree on.
MISMATCHES = [case for case in wrapper_cases(lambda case, i: f"{case}_p{i}:0", lambda name: name, "average", "sum")
              if case["name"] not in ("sparseloco.error_decay", "sparseloco.blocks")]
SCENARIOS = [
    {"name": "mismatches", "scenario": "mismatches", "cases": MISMATCHES},
    *({"name": f"dtype_{d}", "scenario": "dtypes", "dtype": d} for d in DTYPES),
    {"name": "dtype_float32_fp16wire", "scenario": "dtypes", "dtype": "float32", "options": {"fp16_values": True}},
    {"name": "odd", "scenario": "odd_variables"},
]


run = job_fixture("tf_reliability.py", NP, SCENARIOS)


@pytest.mark.parametrize("case", MISMATCHES, ids=lambda case: case["name"])
def test_configuration_mismatch_raises_on_every_rank_naming_the_rank_and_setting(run, case):
    assert_every_rank_refused(records(run, "mismatches"), case)


@pytest.mark.parametrize("dtype", [*DTYPES, "float32_fp16wire"])
def test_dtypes_train_identically_and_conserve(run, dtype):
    recs = records(run, f"dtype_{dtype}")
    same_on_all_ranks(recs)
    conserved(recs, SHAPES, STEPS, dtype.split("_")[0])
    assert set(recs[0]["grad_dtypes"]) == {dtype.split("_")[0]}


def test_odd_variables_are_passed_through_and_missing_gradients_do_not_hang(run):
    recs = records(run, "odd")
    same_on_all_ranks(recs)
    assert recs[0]["groups"] == [[f"odd_p{i}:0"] for i in range(len(SHAPES))] + [["odd_unused:0"]]
    assert recs[0]["odd"] == [None, None, [0]]  # integer, bool variables: no gradient; zero-size: its own
    for rec in recs:
        # no gradient for `unused` on any rank: exchanged as zeros (every rank takes part), so no
        # update; an empty variable list: nothing
        assert rec["unused_grads"] == [0.0] * 6 and rec["nothing"] == []
    conserved(recs, SHAPES, 6, "float32", skipped=lambda step, rank, i: rank == 0 and i == 1 and step % 2 == 0)


#: One rank, one TensorFlow inter-op thread: a step traced into the graph (Top-k) runs; a host
#: step (MiCRO with warm-up, which hung a 2-worker job so) is refused when traced, naming the fix.
ONE_THREAD_SCRIPT = """
import horovod.tensorflow as hvd, numpy as np, tensorflow as tf
import horovod_sparse.tensorflow as hs

hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(1)
v = tf.Variable(np.arange(50, dtype=np.float32))

def traced_step(compression):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v)
        return hs.DistributedGradientTape(tape, compression=compression).gradient(loss, [v])[0]
    return step()

print("graph", traced_step(hs.Compression.topk(density=0.1, min_numel=0)).numpy().tolist())
try:
    traced_step(hs.Compression.micro(density=0.1, min_numel=0, warmup_steps=1))
except RuntimeError as error:
    print("refused", str(error).replace(chr(10), " "))
"""


def test_a_host_step_is_refused_on_one_inter_op_thread_naming_the_fix():
    """With one inter-op thread a traced host step would hang (its tf.py_function holds the only
    thread its collectives need): it raises RuntimeError when traced, naming the two fixes; a
    step traced into the graph still runs (on one rank, Top-k's first step delivers the 5 largest
    of the gradient 2v, v = 0..49)."""
    result = subprocess.run([sys.executable, "-c", ONE_THREAD_SCRIPT], capture_output=True, text=True,
                            timeout=HANG_TIMEOUT, env=worker_env())
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("graph", "refused")))
    assert lines["graph"] == str([2.0 * i if i >= 45 else 0.0 for i in range(50)])
    assert "micro's exchange on the host" in lines["refused"]
    assert "set_inter_op_parallelism_threads(2)" in lines["refused"] and "run_eagerly=True" in lines["refused"]
