"""The TensorFlow front end's arguments, in one process (no Horovod job needed): what is refused
before any collective runs, and with which message."""
from __future__ import annotations

import os
import subprocess
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from horovod_sparse.tensorflow import keras3
from horovod_sparse.methods.topk import TopK
from tests.support.launch import HANG_TIMEOUT

#: What the tape's refusal of a Keras 3 loss scaler names: the problem and the fix.
KERAS_3 = r"Keras 3.*TF_USE_LEGACY_KERAS=1.*tf-keras"


def test_a_tf1_optimizer_is_refused_with_a_sparsifier():
    with pytest.raises(TypeError, match="use a Keras optimizer"):
        hs.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                compression=hs.Compression.topk(density=0.1))


def test_error_decay_is_refused_naming_the_pytorch_front_ends():
    with pytest.raises(ValueError, match=r"error_decay=0.95 is applied by the PyTorch front ends only.*=1.0"):
        hs.DistributedGradientTape(tf.GradientTape(), compression=hs.Compression.sparseloco(error_decay=0.95))


def test_sparseloco_blocks_are_refused_naming_the_pytorch_front_ends():
    with pytest.raises(ValueError, match=r"blocks=True runs in the PyTorch front ends only.*give blocks=False"):
        hs.DistributedGradientTape(tf.GradientTape(), compression=hs.Compression.sparseloco(blocks=True))


def test_a_sparsifier_class_instead_of_an_instance_is_refused():
    with pytest.raises(TypeError, match=r"create an instance with Compression.topk\(density=...\)"):
        hs.DistributedGradientTape(tf.GradientTape(), compression=TopK)


@pytest.mark.parametrize("op", [hvd.Min, hvd.Max, hvd.Product])
def test_a_sparsifier_sums_so_other_reductions_are_refused(op):
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum"):
        hs.DistributedGradientTape(tf.GradientTape(), compression=hs.Compression.topk(density=0.1), op=op)


def test_buffer_strategies_are_refused_for_horovods_dense_reduction():
    with pytest.raises(ValueError, match="groups='size:100' sets the flat buffers of a sparsifier"):
        hs.DistributedGradientTape(tf.GradientTape(), compression=hs.Compression.none, groups="size:100")


def test_keras_wrapper_keeps_horovods_op_check():
    with pytest.raises(ValueError, match="op currently only supports Average and Sum"):
        hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), op=hvd.Adasum)


def test_keras_wrapper_is_the_optimizers_class_with_the_exchanger_installed():
    optimizer = hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9),
                                              compression=hs.Compression.topk(density=0.1))
    assert type(optimizer).__name__ == "SGD" and isinstance(optimizer, tf.keras.optimizers.SGD)
    assert optimizer._allreduce_grads is optimizer.exchanger and optimizer.last_stats is None
    assert optimizer.get_config()["momentum"] == 0.9


@pytest.mark.parametrize("nonfinite", ["bogus", "", 1, True])
def test_an_unknown_nonfinite_policy_is_refused_naming_the_choices(nonfinite):
    compression = hs.Compression.topk(density=0.1)
    with pytest.raises(ValueError, match=r"nonfinite must be one of 'raise', 'skip', got"):
        hs.DistributedGradientTape(tf.GradientTape(), compression=compression, nonfinite=nonfinite)
    with pytest.raises(ValueError, match=r"nonfinite must be one of 'raise', 'skip', got"):
        hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=compression, nonfinite=nonfinite)


@pytest.mark.parametrize("passes", [0, -1, 1.5, True])
def test_keras_backward_passes_per_step_below_one_is_refused(passes):
    with pytest.raises((ValueError, TypeError), match="backward_passes_per_step"):
        hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=hs.Compression.topk(density=0.1),
                                      backward_passes_per_step=passes)


def test_the_keras_3_package_is_installed_beside_keras_2():
    """The Keras 3 tests below run a real Keras 3 (TensorFlow >= 2.16 depends on it) while
    tf.keras is Keras 2 (tests/conftest.py sets TF_USE_LEGACY_KERAS=1): a ``keras`` 3 optimizer is
    wrapped for Keras 3 whatever tf.keras is."""
    assert keras.__version__.split(".")[0] == "3", keras.__version__
    assert tf.keras.__name__.startswith("tf_keras."), tf.keras.__name__


TOPK = hs.Compression.topk(density=0.1)


@pytest.mark.parametrize("wrapper", [hs_keras.DistributedOptimizer, hs.DistributedOptimizer], ids=["keras", "dispatch"])
@pytest.mark.parametrize("compression", [hvd.Compression.none, TOPK], ids=["dense", "topk"])
def test_a_keras_3_optimizer_is_wrapped_for_keras_3(wrapper, compression):
    """Its own class, dynamically subclassed as Horovod does, exchanging in ``apply`` (Keras 3's
    model.fit never calls get_gradients, where Horovod's Keras 2 wrapper reduces)."""
    optimizer = wrapper(keras.optimizers.SGD(0.1, momentum=0.9), compression=compression)
    assert type(optimizer).__name__ == "SGD" and isinstance(optimizer, keras.optimizers.SGD)
    assert isinstance(optimizer, keras3._Distributed) and optimizer.exchanger.reports_in == "apply"
    assert optimizer.last_stats is None and optimizer.get_config()["momentum"] == 0.9
    assert hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=compression).exchanger


@pytest.mark.parametrize("arguments, error, message", [
    ({"op": hvd.Adasum}, ValueError, "op currently only supports Average and Sum"),
    ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step"),
    ({"scale_local_gradients": False}, ValueError, r"register_local_var.*leave it True"),
    ({"nonfinite": "bogus"}, ValueError, "nonfinite must be one of 'raise', 'skip', got"),
], ids=["op", "passes", "scale_local_gradients", "nonfinite"])
def test_keras_3_wrapper_refuses_what_cannot_apply(arguments, error, message):
    with pytest.raises(error, match=message):
        hs_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=TOPK, **arguments)


def test_keras_3_gradient_accumulation_is_refused_for_backward_passes_per_step():
    """Keras 3's own accumulation would exchange at every pass: the fix is Horovod's argument."""
    with pytest.raises(ValueError, match="pass backward_passes_per_step=4 to DistributedOptimizer"):
        hs_keras.DistributedOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), compression=TOPK)


def test_a_loss_scale_optimizer_inside_the_keras_3_wrapper_lends_it_its_scale():
    """``DistributedOptimizer(LossScaleOptimizer(opt))``: still a LossScaleOptimizer (model.compile
    under mixed_float16 takes it as it is), the exchange reads its dynamic scale, and the
    scaler, not the nonfinite policy, skips an abandoned step (so nonfinite=None is refused)."""
    optimizer = hs_keras.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                                                  initial_scale=8.0), compression=TOPK)
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and optimizer.exchanger.reports_in is None
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.optimizer is optimizer
    optimizer.build(model.trainable_variables)
    assert float(optimizer.exchanger.loss_scale()) == 8.0
    with pytest.raises(ValueError, match="nonfinite=None with loss_scaler"):
        hs_keras.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
                                      compression=TOPK, nonfinite=None)


def test_a_loss_scale_optimizer_around_the_keras_3_wrapper_is_refused_naming_the_order():
    """It would check each rank's gradients before the exchange (a rank that overflowed would
    skip the exchange the others wait in): refused when built, by hand or by model.compile
    under the mixed_float16 policy."""
    refusal = r"Wrap the other way round: DistributedOptimizer\(keras.optimizers.LossScaleOptimizer\(opt\)"
    with pytest.raises(TypeError, match=refusal):
        keras.optimizers.LossScaleOptimizer(hs_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=TOPK))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        with pytest.raises(TypeError, match=refusal):
            model.compile(optimizer=hs_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=TOPK),
                          loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_an_xla_compiled_keras_3_step_is_refused_naming_jit_compile_false():
    """Horovod's collectives and the host exchanges are no XLA ops: the traced ``apply`` refuses
    before any collective (no Horovod job needed)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=hs_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=TOPK), loss="mse",
                  jit_compile=True)
    with pytest.raises(RuntimeError, match="compile the model with jit_compile=False"):
        model.fit(np.zeros((4, 3), np.float32), np.zeros((4, 1), np.float32), verbose=0)


def test_a_keras_3_loss_scaler_for_the_tape_is_refused_naming_the_fixes():
    """The tape's loss_scaler is Keras 2's (get_scaled_loss, loss_scale); with Keras 3 the fix is
    the optimizer wrapper around the LossScaleOptimizer, or tf-keras for the tape."""
    scaler = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match=KERAS_3):
        hs.DistributedGradientTape(tf.GradientTape(), compression=TOPK, loss_scaler=scaler)


#: Run under Keras 3 (no TF_USE_LEGACY_KERAS): the front end imports without Horovod's Keras
#: layer, wraps tf.keras' (Keras 3) optimizers, and refuses what is Keras 2 only, naming the fix.
UNDER_KERAS_3 = """
import sys
import keras, tensorflow as tf, tf_keras
import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hsk
from horovod_sparse.tensorflow import keras3_callbacks
assert tf.keras.__name__.startswith("keras."), tf.keras.__name__
assert not {"horovod._keras", "horovod.tensorflow.keras"} & set(sys.modules), sorted(sys.modules)
assert hsk.callbacks is keras3_callbacks
optimizer = hs.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=hs.Compression.topk(density=0.1))
assert isinstance(optimizer, keras.optimizers.SGD) and optimizer.exchanger.sparse
for refused, error in [(lambda: hsk.DistributedOptimizer(tf_keras.optimizers.SGD(0.1)), TypeError),
                       (lambda: hsk.load_model("model.h5"), NotImplementedError),
                       (lambda: hsk.callbacks.LearningRateWarmupCallback, AttributeError)]:
    try:
        refused()
    except error as refusal:
        print(type(refusal).__name__, refusal)
    else:
        raise AssertionError("not refused")
"""


def test_the_front_end_works_under_keras_3_and_refuses_what_is_keras_2_only():
    """Without TF_USE_LEGACY_KERAS=1, TensorFlow 2.21's tf.keras is Keras 3: importing works,
    Horovod's Keras layer stays unimported, and what only Keras 2 has says what to do instead."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    result = subprocess.run([sys.executable, "-c", UNDER_KERAS_3], env=env, capture_output=True, text=True,
                            timeout=HANG_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("TypeError optimizer=tf_keras.") and "TF_USE_LEGACY_KERAS=1" in lines[0], lines
    assert lines[1].startswith("NotImplementedError") and "keras.saving.load_model" in lines[1], lines
    assert lines[2].startswith("AttributeError") and "warmup_steps" in lines[2], lines
