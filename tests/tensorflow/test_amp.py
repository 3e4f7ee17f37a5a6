"""TensorFlow mixed precision with a Keras ``LossScaleOptimizer`` (issue 29), on one real
two-worker job (``tests/workers/tf_amp.py``): Keras' own recipes around horovod_sparse behave as
around stock Horovod, for every method, and the residuals stay in the loss's own units.

* ``model.fit`` (traced, and ``run_eagerly=True``) with
  ``LossScaleOptimizer(hsk.DistributedOptimizer(SGD, compression=...))``, and the custom loop
  (``get_scaled_loss``, ``hs.DistributedGradientTape(..., loss_scaler=opt)``,
  ``get_unscaled_gradients``, ``apply_gradients``; eager and inside a ``tf.function``), under the
  ``mixed_float16`` policy with an initial scale of 2**24, so that the first steps overflow: the
  same scale at every step and the same skipped steps as stock Horovod until the first applied
  step (every method in ``fit`` and the eager custom loop; Top-k, gTop-k, MiCRO and DGC, one per
  way a method runs, in the other two), then finite losses, weights and residuals, the scale
  growing again, a lower final loss and bitwise identical replicas
  (``tests.torch.test_amp.check_recipe``, PyTorch's check).
* Given gradients scaled by a power of two that changes every step (up, down, below 1), through
  the tape given the LossScaleOptimizer and through a LossScaleOptimizer around the Keras
  wrapper, eagerly (every method) and traced (Top-k, gTop-k, MiCRO, DGC): every step's unscaled
  aggregate, residual and variable bitwise equal to those of the same gradients with no loss
  scaling (``tests.torch.test_amp.check_units``).
* Without a loss scaler the Keras wrapper's ``nonfinite`` policy acts in ``apply_gradients``, as
  ``step()`` does in PyTorch, eagerly and traced: an infinite gradient on rank 1 gives NaN
  gradients on both ranks, no update (variables and ``iterations`` as before), and the error
  (``"raise"``) or the warning (``"skip"``, eagerly) naming rank 1 on both ranks.
* ``nonfinite=None`` with a sparsifier and a loss scaler is refused: by the tape at construction,
  by the Keras wrapper at the first exchange inside a LossScaleOptimizer, on every rank.
"""
from __future__ import annotations

import numpy as np
import pytest

import horovod_sparse.methods  # noqa: F401  (registers the methods)
from horovod_sparse.common.registry import method_names
from tests.support.checks import Observed
from tests.support.launch import job_fixture
from tests.torch.test_amp import EXACT, EXPONENTS, OPTIONS, check_recipe, check_units

NP = 2
METHODS = method_names()
LOOPS = ("fit", "fit_eager", "tape", "tape_function")
APIS = ("tape", "tape_function", "keras", "keras_function")

#: Steps of a recipe run: from 2**24 the first 6 steps overflow, the scale grows after 4 clean
#: steps (at step 10), and one more step leaves a margin (check_recipe needs the overflows and
#: the growth).
RECIPE_STEPS = 12

#: What each loop and API runs. Every method through Keras' default (``fit``, traced) and the
#: eager tape and Keras optimizer; the other loops and the traced APIs run one method per way a
#: method runs there, the loss-scale code they exercise being the same for all: Top-k (traced
#: into the graph), gTop-k (a tree of collectives in the graph), MiCRO and DGC (decided on the
#: host from a traced step; DGC's momentum), and Horovod's ``none`` through our wrappers.
EVERY_WAY = ["topk", "gtopk", "micro", "dgc"]
RECIPE_METHODS = {"fit": [*METHODS, "none"], "tape": [*METHODS, "none"], "fit_eager": [*EVERY_WAY, "none"],
                  "tape_function": [*EVERY_WAY, "none"]}
UNITS_METHODS = {"tape": METHODS, "keras": METHODS, "tape_function": EVERY_WAY, "keras_function": EVERY_WAY}

CONFIGS = ([{"name": loop, "scenario": "recipe", "loop": loop, "methods": RECIPE_METHODS[loop], "options": OPTIONS,
             "steps": RECIPE_STEPS, "init_exponent": 24, "growth_steps": 4} for loop in LOOPS]
           + [{"name": f"units_{api}", "scenario": "units", "api": api, "methods": UNITS_METHODS[api],
               "options": EXACT, "seed": 3, "shapes": [[30, 20], [20], [40, 30]], "exponents": EXPONENTS}
              for api in APIS]
           + [{"name": "policy", "scenario": "policy", "options": OPTIONS, "seed": 4, "shapes": [[30, 20], [20]]}])

job = job_fixture("tf_amp.py", NP, CONFIGS)


@pytest.mark.parametrize("loop,method", [(loop, m) for loop in LOOPS for m in RECIPE_METHODS[loop]])
def test_loss_scale_optimizer_skips_and_backs_off_as_with_stock_horovod(job, loop, method):
    check_recipe(Observed(job, f"recipe_{loop}_{method}", NP))


@pytest.mark.parametrize("api,method", [(api, m) for api in APIS for m in UNITS_METHODS[api]])
def test_residuals_in_unscaled_units(job, api, method):
    check_units(Observed(job, f"units_{api}_{method}", NP))


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_keras_policy_acts_where_the_step_is_applied(job, mode, policy):
    """Rank 1's infinite gradient at step 1: abandoned on both ranks, no update there (the
    variables and ``iterations`` as after step 0), the policy's error or warning naming rank 1,
    NaN aggregates (``"skip"``), training on at step 2, identical replicas."""
    obs = Observed(job, f"policy_{mode}_{policy}", NP)
    for rank, record in enumerate(obs.meta):
        before, faulted, after = record["steps"]
        assert [s["abandoned"] for s in record["steps"]] == [False, True, False], rank
        assert [s["iterations"] for s in record["steps"]] == [1, 1, 2], rank
        assert faulted["params"] == before["params"] and after["params"] != faulted["params"], rank
        assert before["raised"] is None and after["raised"] is None, rank
        named = "rank(s) [1] at step 1"
        if policy == "raise":
            assert faulted["raised"] is not None and named in faulted["raised"], (rank, faulted["raised"])
            assert "FloatingPointError" in faulted["raised"], (rank, faulted["raised"])
        else:
            assert faulted["raised"] is None, (rank, faulted["raised"])
            assert all(np.isnan(g).all() for g in map(np.asarray, faulted["aggregated"])), rank
            # Traced, the warning comes from TensorFlow's executor thread, out of reach here.
            assert mode == "traced" or any(named in w for w in faulted["warned"]), (rank, faulted["warned"])
        assert record["steps"][-1]["params"] == obs.meta[0]["steps"][-1]["params"], f"rank {rank} differs"


def test_keras_without_a_policy_inside_a_loss_scale_optimizer_is_refused(job):
    for rank, record in enumerate(Observed(job, "policy_unchecked", NP).meta):
        assert record["raised"] is not None and "nonfinite=None with loss_scaler" in record["raised"], rank


def test_the_tapes_loss_scaler_is_checked_at_construction():
    """In one process, before any collective: a loss scaler that is no LossScaleOptimizer, and
    ``nonfinite=None`` with one."""
    import tensorflow as tf

    import horovod_sparse.tensorflow as hs

    topk = hs.Compression.topk(density=0.1)
    with pytest.raises(TypeError, match="pass the tf.keras.mixed_precision.LossScaleOptimizer"):
        hs.DistributedGradientTape(tf.GradientTape(), compression=topk, loss_scaler=tf.keras.optimizers.SGD(0.1))
    scaler = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="nonfinite=None with loss_scaler"):
        hs.DistributedGradientTape(tf.GradientTape(), compression=topk, loss_scaler=scaler, nonfinite=None)
