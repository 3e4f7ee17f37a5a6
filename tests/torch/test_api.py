"""The PyTorch wrapper's arguments, in one process (no Horovod job needed): what is refused
before any collective runs, and with which message."""
from __future__ import annotations

import pytest
import horovod.torch as hvd
import torch

import horovod_sparse.torch as hs


def wrap(**arguments):
    p = torch.nn.Parameter(torch.randn(5))
    return hs.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)],
                                   compression=hs.Compression.topk(density=0.5, min_numel=0), **arguments)


@pytest.mark.parametrize("passes", [0, -1])
def test_backward_passes_per_step_below_one_is_refused(passes):
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        wrap(backward_passes_per_step=passes)


@pytest.mark.parametrize("passes", [1.5, True])
def test_backward_passes_per_step_must_be_an_integer(passes):
    with pytest.raises(TypeError, match="backward_passes_per_step"):
        wrap(backward_passes_per_step=passes)


@pytest.mark.parametrize("nonfinite", ["bogus", "", 1, True])
def test_an_unknown_nonfinite_policy_is_refused_naming_the_choices(nonfinite):
    with pytest.raises(ValueError, match=r"nonfinite must be one of 'raise', 'skip', got"):
        wrap(nonfinite=nonfinite)


def test_a_loss_scaler_needs_the_nonfinite_check_and_must_be_a_grad_scaler():
    with pytest.raises(ValueError, match="nonfinite=None with loss_scaler.*keep the default"):
        wrap(nonfinite=None, loss_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="loss_scaler=.*torch.amp.GradScaler"):
        wrap(loss_scaler=torch.optim.SGD)


def test_a_bool_parameter_cannot_ask_for_a_gradient():
    """So a bool parameter is always frozen, and the wrapper ignores it (the reliability job
    trains with one)."""
    with pytest.raises(RuntimeError, match="floating point and complex dtype can require gradients"):
        torch.nn.Parameter(torch.zeros(3, dtype=torch.bool))


def test_an_empty_parameter_list_is_refused_by_the_wrapped_optimizer():
    with pytest.raises(ValueError, match="empty parameter list"):
        hs.DistributedOptimizer(torch.optim.SGD([], lr=0.1), compression=hs.Compression.topk(density=0.5))


@pytest.mark.parametrize("op", [hvd.Min, hvd.Max, hvd.Product])
def test_a_sparsifier_sums_so_other_reductions_are_refused(op):
    """As in TensorFlow: the selected values are summed, so Min/Max/Product would silently
    become a sum."""
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum"):
        wrap(op=op)



def test_a_sparsifier_built_for_tensorflow_is_refused_naming_the_right_namespace():
    """Methods are written once; each instance runs on its framework's tensors, so one built by
    the TensorFlow namespace must not reach the PyTorch optimizer."""
    import horovod_sparse.tensorflow as htf

    p = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(TypeError, match=r"built by horovod_sparse\.tensorflow\.Compression .* "
                                        r"horovod_sparse\.torch\.Compression\.gtopk\(\.\.\.\) instead"):
        hs.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)],
                                compression=htf.Compression.gtopk(density=0.5))
