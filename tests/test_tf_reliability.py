"""Reliability of the TensorFlow front end under horovodrun, as ``test_torch_reliability.py``
checks the PyTorch one: configuration mismatches, dtypes, variables without gradients (exact
resume: ``tests/test_tf_resume.py``; non-finite gradients: ``tests/test_nonfinite.py``). Every
launch has a timeout, so a hang fails the test instead of stalling the suite."""
from __future__ import annotations

import pytest

from tests.launch import job_fixture
from tests.mismatch import assert_every_rank_refused, wrapper_cases
from tests.test_torch_reliability import conserved, records, same_on_all_ranks
from tests.workers.tf_reliability import SHAPES

NP = 2
STEPS = 5
DTYPES = ("float32", "float64", "float16", "bfloat16")

#: A mismatch in every field of the exchanger's configuration fingerprint (``tests/mismatch.py``).
MISMATCHES = wrapper_cases(lambda case, i: f"{case}_p{i}:0", lambda name: name, "average", "sum")
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
