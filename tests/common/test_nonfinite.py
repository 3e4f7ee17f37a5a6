"""NaN and Inf on any rank, for every method, in both front ends (docs/guarantees.md: "NaN/Inf
policy"): three workers train through the faults of :mod:`tests.support.nonfinite_faults` (NaN, +Inf and
-Inf; on rank 0, on rank 1, on several ranks at once; in a sparse group, in the dense group of a
sparse step, during warm-up) under ``nonfinite="raise"`` and ``"skip"``, and the tests check that

* every rank raises ``FloatingPointError`` naming the bad ranks (``"raise"``) or warns and carries
  on (``"skip"``) exactly at the faulted steps, with ``last_stats.abandoned`` set;
* the abandoned step updates nothing (parameters and optimizer state as before; the optimizer is
  SGD with momentum, so applying zero gradients would show) and the replicas stay bitwise
  identical on every rank at every step;
* every step's parameters and residuals equal, bitwise, those of a reference run fed the
  gradients as the policy documents them (see the workers): the abandoned step keeps each
  healthy sparse gradient in its residual, drops the non-finite one, and the training after it
  continues exactly from there;
* an abandoned step's aggregated gradients are NaN on every rank (so that a loss scaler sees
  the overflow), in both front ends;
* nothing is lost: the delivered updates plus the mean residual equal the mean of every
  gradient the policy keeps, to the float32 rounding bound of :func:`tests.support.checks.conservation_bound`.

Every launch runs under the suite's hang guard, so a rank left waiting fails the test.
"""
from __future__ import annotations

import numpy as np
import pytest

import horovod_sparse.methods  # noqa: F401  (registers the methods)
from horovod_sparse.common.registry import method_names
from tests.support import nonfinite_faults as faults
from tests.support.checks import Observed, assert_conserved
from tests.support.launch import job_fixture

POLICIES = ("raise", "skip")
#: Options besides the defaults: LAGS at its reference setting (its adaptive densities are fitted
#: to measured times, which would differ between the faulted and the reference run).
OPTIONS = {"lags": {"adaptive": False}}
TORCH_METHODS = [*method_names(), "none"]
TORCH = [{"name": method, "method": method, "options": OPTIONS.get(method, {})} for method in TORCH_METHODS]

#: TensorFlow: every method eagerly under both policies, one through the tape and the other
#: through the Keras wrapper (alternating), against one eager tape reference (the two APIs
#: compute the same); and traced (inside a tf.function) under both policies, against a traced
#: reference.
TF = [*({"name": m, "method": m, "api": "tape", "runs": [["tape", POLICIES[i % 2]], ["keras", POLICIES[1 - i % 2]]]}
        for i, m in enumerate(method_names())),
      *({"name": f"{m}_traced", "method": m, "api": "tape_function",
         "runs": [["tape_function", policy] for policy in POLICIES]}
        for m in method_names())]
for config in TF:
    config["options"] = OPTIONS.get(config["method"], {})

torch_job = job_fixture("torch_nonfinite.py", faults.NP, TORCH)
tf_job = job_fixture("tf_nonfinite.py", faults.NP, TF)


def check_policy(obs: Observed, run: str, policy: str, traced: bool) -> None:
    """Every rank raised (``"raise"``) or warned (``"skip"``) at each faulted step, naming the
    bad ranks, and nowhere else; every faulted step, and only those, was abandoned."""
    for rank, meta in enumerate(obs.meta):
        for step, seen in enumerate(meta[run]):
            where = f"rank {rank} step {step}"
            assert seen["abandoned"] == (step in faults.FAULTS), where
            if step not in faults.FAULTS:
                assert seen["raised"] is None and not seen["warned"], where
                continue
            named = f"rank(s) {faults.bad_ranks(step)} at step {step}"
            if policy == "raise":
                assert seen["raised"] is not None and named in seen["raised"], (where, seen["raised"])
                assert "FloatingPointError" in seen["raised"] or not traced, (where, seen["raised"])
            else:
                assert seen["raised"] is None, (where, seen["raised"])
                # Traced, the warning comes from TensorFlow's executor thread, out of reach here.
                assert traced or any(named in message for message in seen["warned"]), (where, seen["warned"])


def check_no_update_and_identical_replicas(obs: Observed, run: str) -> None:
    """Abandoned steps leave the parameters bitwise as they were; every step leaves them bitwise
    identical on every rank."""
    for step in range(faults.STEPS):
        for i in range(len(faults.SHAPES)):
            mine = obs.arrays[0][f"{run}_param_{step}_{i}"]
            for rank in range(1, obs.size):
                np.testing.assert_array_equal(obs.arrays[rank][f"{run}_param_{step}_{i}"], mine,
                                              err_msg=f"step {step}: rank {rank}'s parameter {i} differs from rank 0's")
            if step in faults.FAULTS and step > 0:
                np.testing.assert_array_equal(mine, obs.arrays[0][f"{run}_param_{step - 1}_{i}"],
                                              err_msg=f"abandoned step {step} moved parameter {i}")
            assert np.isfinite(mine).all()


def check_reference(obs: Observed, run: str) -> None:
    """Every step's parameters and residuals, on every rank, equal the reference run's bitwise."""
    for rank, arrays in enumerate(obs.arrays):
        for step in range(faults.STEPS):
            for i in range(len(faults.SHAPES)):
                for what in ("param", "residual"):
                    np.testing.assert_array_equal(arrays[f"{run}_{what}_{step}_{i}"],
                                                  arrays[f"reference_{what}_{step}_{i}"],
                                                  err_msg=f"rank {rank} step {step}: {what} {i} differs from "
                                                          "the reference run's")


def check_conserved(obs: Observed, run: str, method: str, abandoned_fill: float) -> None:
    """An abandoned step's aggregated gradients are ``abandoned_fill`` on every rank (NaN in both
    front ends, so a loss scaler sees the overflow) and deliver nothing; the delivered updates
    plus the mean final residual equal the mean of the kept gradients."""
    last = faults.STEPS - 1
    for i in range(len(faults.SHAPES)):
        for rank, arrays in enumerate(obs.arrays):
            for step in faults.FAULTS:
                np.testing.assert_array_equal(arrays[f"{run}_grad_{step}_{i}"], abandoned_fill,
                                              err_msg=f"rank {rank}: abandoned step {step}'s aggregate {i}")
        delivered = sum(obs.arrays[0][f"{run}_grad_{step}_{i}"].astype(np.float64).reshape(-1)
                        for step in range(faults.STEPS) if step not in faults.FAULTS)
        residuals = [arrays[f"{run}_residual_{last}_{i}"].astype(np.float64) for arrays in obs.arrays]
        for rank, residual in enumerate(residuals):
            assert np.isfinite(residual).all(), f"rank {rank}'s residual {i} is not finite"
        assert_conserved(delivered, residuals, faults.raw_stream(i, method), "float32", f"{method}: parameter {i}")


def check_run(obs: Observed, run: str, policy: str, method: str, abandoned_fill: float, traced: bool = False) -> None:
    """Everything the module docstring lists, for the faulted ``run`` under ``policy``."""
    check_policy(obs, run, policy, traced)
    check_no_update_and_identical_replicas(obs, run)
    check_reference(obs, run)
    check_conserved(obs, run, method, abandoned_fill)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("method", TORCH_METHODS)
def test_torch(torch_job, method, policy):
    check_run(Observed(torch_job, method, faults.NP), policy, policy, method, np.nan)


@pytest.mark.parametrize("config,api,policy", [(c, api, policy) for c in TF for api, policy in c["runs"]],
                         ids=lambda value: value["name"] if isinstance(value, dict) else value)
def test_tensorflow(tf_job, config, api, policy):
    obs = Observed(tf_job, config["name"], faults.NP)
    run = f"{api}_{policy}"
    check_run(obs, run, policy, config["method"], np.nan, traced=api == "tape_function")
    for rank, meta in enumerate(obs.meta):
        # The optimizer took no step (its iterations did not advance) where the reference took none.
        assert [seen["iterations"] for seen in meta[run]] == meta["reference_iterations"], f"rank {rank}"
