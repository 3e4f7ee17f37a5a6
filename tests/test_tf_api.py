"""The TensorFlow front end's arguments, in one process (no Horovod job needed): what is refused
before any collective runs, and with which message."""
from __future__ import annotations

import horovod.tensorflow as hvd
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from horovod_sparse.methods.topk import TopK


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
