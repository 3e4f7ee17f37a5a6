"""Reliability of the PyTorch wrapper under horovodrun: configuration mismatches, dtypes, odd
parameters, state broadcast, the finiteness check (exact resume: ``tests/torch/test_resume.py``;
the NaN/Inf policy: ``tests/common/test_nonfinite.py``). Every launch has a timeout, so a hang fails the
test instead of stalling the suite."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.support.checks import assert_conserved
from tests.support.launch import job_fixture
from tests.support.mismatch import assert_every_rank_refused, wrapper_cases
from tests.support.streams import raw_gradient

NP = 2


def records(out, name, size=NP):
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(size)]


def same_on_all_ranks(recs, key="params"):
    for rank, rec in enumerate(recs[1:], start=1):
        for a, b in zip(recs[0][key], rec[key]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"rank {rank} {key} differ")


def conserved(recs, shapes, steps, dtype, skipped=lambda step, rank, i: False):
    """The reliability workers' records (gradients ``raw_gradient(5, ...)``, cast to ``dtype``;
    none where ``skipped``) lose and invent nothing beyond ``dtype``'s rounding
    (:func:`tests.support.checks.conservation_bound`)."""
    for i, shape in enumerate(shapes):
        raw = np.array([[np.zeros(int(np.prod(shape))) if skipped(t, r, i)
                          else raw_gradient(5, t, r, shape, i).reshape(-1)
                          for r in range(NP)] for t in range(steps)])
        assert_conserved(np.asarray(recs[0]["delivered"][i]), [np.asarray(rec["residuals"][i]) for rec in recs],
                         raw, dtype, f"parameter {i}")


#: A mismatch in every field of the wrapper's configuration fingerprint (``tests/support/mismatch.py``).
MISMATCHES = wrapper_cases(lambda case, i: f"p{i}", lambda name: f"torch.{name}", "average", "sum") + [
    {"name": "backward_passes_per_step", "rank0": {}, "rank1": {"wrapper": {"backward_passes_per_step": 2}},
     "expect": "backward_passes_per_step=2 (rank 0: 1)"},
    {"name": "dense_compression", "rank0": {"method": "none"}, "rank1": {"method": "fp16"},
     "expect": "compression='FP16Compressor' (rank 0: 'NoneCompressor')"},
    {"name": "gradient_predivide_factor", "rank0": {"method": "none"},
     "rank1": {"method": "none", "wrapper": {"gradient_predivide_factor": 2.0}},
     "expect": "gradient_predivide_factor=2.0 (rank 0: 1.0)"},
]
SCENARIOS = [
    {"name": "mismatches", "scenario": "mismatches", "cases": MISMATCHES},
    {"name": "stock", "scenario": "stock_refuses"},
    *({"name": f"dtype_{d}", "scenario": "dtypes", "dtype": d} for d in ("float32", "float64", "float16", "bfloat16")),
    {"name": "dtype_float32_fp16wire", "scenario": "dtypes", "dtype": "float32", "fp16_values": True},
    {"name": "odd", "scenario": "odd_parameters"},
    {"name": "nothing", "scenario": "nothing_to_exchange"},
    {"name": "broadcast", "scenario": "broadcast_state"},
]


run = job_fixture("torch_reliability.py", NP, SCENARIOS)


@pytest.mark.parametrize("case", MISMATCHES, ids=lambda case: case["name"])
def test_configuration_mismatch_raises_on_every_rank_naming_the_rank_and_setting(run, case):
    assert_every_rank_refused(records(run, "mismatches"), case)


def test_stock_horovod_optimizer_refuses_a_sparsifier(run):
    for rec in records(run, "stock"):
        assert rec["raised"] == "TypeError"
        assert "Use horovod_sparse.torch.DistributedOptimizer(" in rec["message"]


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "float32_fp16wire"])
def test_dtypes_train_identically_and_conserve(run, dtype):
    from tests.workers.torch_reliability import SHAPES

    recs = records(run, f"dtype_{dtype}")
    same_on_all_ranks(recs)
    param_dtype = dtype.split("_")[0]
    conserved(recs, SHAPES, 5, param_dtype)
    assert set(recs[0]["grad_dtypes"]) == {f"torch.{param_dtype}"}


def test_odd_parameters_are_ignored_or_handled(run):
    recs = records(run, "odd")
    same_on_all_ranks(recs)
    # q3 integer, q4 frozen, q5 empty and q7 bool carry no gradient: no group, left alone
    assert recs[0]["groups"] == [["q0"], ["q1"], ["q2"], ["q6"], ["q8"]]
    for rec in recs:
        assert rec["ignored_unchanged"] == [True, True]
        # q8 has no gradient on any rank: exchanged as zeros (as Horovod's optimizer does), no update
        assert rec["unused_grads"] == [0.0] * 6 and rec["unused_unchanged"]


def test_an_optimizer_with_nothing_to_exchange_steps_without_collectives(run):
    for rec in records(run, "nothing"):
        assert (rec["groups"], rec["steps"], rec["residuals"]) == ([], 3, 0)
        assert rec["params"] == [[1.0] * 4, [0] * 3, [True]]


def test_broadcast_optimizer_state_works_with_the_wrapper(run):
    recs = records(run, "broadcast")
    # The ranks start from different parameters: identical ones at the end come from the broadcast.
    assert not np.array_equal(np.asarray(recs[0]["initial"][0]), np.asarray(recs[1]["initial"][0]))
    same_on_all_ranks(recs)
    # Neither broadcast runs an exchange (hvd's initialises the state with the base step).
    assert recs[0]["steps"] == 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_cheap_finiteness_check_is_exact(dtype):
    """One sum decides the usual case; finite values whose sum overflows, and NaN/Inf anywhere
    (including +Inf and -Inf together), still get the exact answer, of one tensor and of several;
    so does the accelerators' flag (``finite_flag``, no host read)."""
    from horovod_sparse.torch_core.tensor_backend import all_finite, finite_flag

    values = torch.randn(3000, generator=torch.Generator().manual_seed(0)).to(dtype)
    huge = torch.full((3000,), torch.finfo(dtype).max, dtype=dtype)
    cases = [values, huge, torch.zeros(0, dtype=dtype)]
    for position, bad in ((17, float("nan")), (2999, float("inf")), (0, -float("inf"))):
        poisoned = values.clone()
        poisoned[position] = bad
        cases.append(poisoned)
    opposite = huge.clone()
    opposite[1], opposite[2] = float("inf"), -float("inf")
    cases.append(opposite)
    for case in cases:
        exact = bool(torch.isfinite(case).all())
        assert all_finite(case) == all_finite(values, case) == exact
        assert finite_flag(case).dim() == 0 and bool(finite_flag(case)) == exact
        assert bool(finite_flag(values, case)) == bool(finite_flag(case, huge)) == exact
