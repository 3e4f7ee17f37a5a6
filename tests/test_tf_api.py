"""The TensorFlow front end's arguments, in one process (no Horovod job needed): what is refused
before any collective runs, and with which message."""
from __future__ import annotations

import os
import subprocess
import sys

import horovod.tensorflow as hvd
import keras
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from horovod_sparse.methods.topk import TopK
from tests.launch import HANG_TIMEOUT

#: What every Keras 3 refusal names: the problem and the fix.
KERAS_3 = r"Keras 3.*TF_USE_LEGACY_KERAS=1.*tf-keras"


def test_a_tf1_optimizer_is_refused_with_a_sparsifier():
    with pytest.raises(TypeError, match="use a Keras optimizer"):
        hs.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                compression=hs.Compression.topk(density=0.1))


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
    """The refusals below are tested against a real Keras 3 (TensorFlow >= 2.16 depends on it),
    while tf.keras is Keras 2 (tests/conftest.py sets TF_USE_LEGACY_KERAS=1)."""
    assert keras.__version__.split(".")[0] == "3", keras.__version__
    assert tf.keras.__name__.startswith("tf_keras."), tf.keras.__name__


@pytest.mark.parametrize("wrapper", [hs_keras.DistributedOptimizer, hs.DistributedOptimizer], ids=["keras", "dispatch"])
@pytest.mark.parametrize("compression", [hvd.Compression.none, hs.Compression.topk(density=0.1)], ids=["dense", "topk"])
def test_a_keras_3_optimizer_is_refused_naming_tf_keras(wrapper, compression):
    """Horovod's wrapper would build around it and train with no exchange at all (Keras 3 calls
    apply_gradients directly): refused at construction, dense or sparse."""
    with pytest.raises(TypeError, match=KERAS_3):
        wrapper(keras.optimizers.SGD(0.1), compression=compression)
    assert hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=compression).exchanger


def test_a_keras_3_loss_scaler_is_refused_naming_tf_keras():
    scaler = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match=KERAS_3):
        hs.DistributedGradientTape(tf.GradientTape(), compression=hs.Compression.topk(density=0.1),
                                   loss_scaler=scaler)


def test_importing_the_front_end_under_keras_3_says_how_to_get_keras_2():
    """Without TF_USE_LEGACY_KERAS=1, TensorFlow 2.21's tf.keras is Keras 3: the import fails
    up front with the fix, instead of Horovod's Keras layer failing later and obscurely."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    result = subprocess.run([sys.executable, "-c", "import horovod_sparse.tensorflow"], env=env,
                            capture_output=True, text=True, timeout=HANG_TIMEOUT)
    assert result.returncode != 0
    assert "ImportError: horovod_sparse.tensorflow needs Keras 2 as tf.keras" in result.stderr, result.stderr[-2000:]
    assert "TF_USE_LEGACY_KERAS=1" in result.stderr
