"""What users would pick instead of a sparsifier on DDP, as comm hooks: PyTorch's bfloat16
all-reduce hook and PowerSGD, for the benchmarks that time them beside the methods
(:mod:`benchmarks.gpu_check`, :mod:`benchmarks.costs.exchange_cost`,
:mod:`benchmarks.emulated.synthetic_ddp`, :mod:`benchmarks.main_job.digits_training`).

PowerSGD on Gloo runs one bucket after another (:func:`serial_powersgd_hook`): PyTorch's
``powerSGD_hook`` waits for its second and third allreduce inside callbacks that run on Gloo's
worker threads (two by default), so buckets ready at once can occupy every thread with a callback
waiting for an allreduce that no thread is left to run: backward() never returns (on one rank,
``tests/workers/powersgd_baseline.py``'s buckets within its 30 steps; ResNet-20's two buckets in
1 of 11 runs of ``python -m benchmarks.gpu_check --device cpu --quick``)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

#: PowerSGD's matrix approximation rank.
POWERSGD_RANK = 4
#: PowerSGD's ``start_powerSGD_iter``: the smallest it accepts with error feedback (its first
#: steps are dense).
POWERSGD_START_ITER = 2


class SerialPowerSGDState(powerSGD_hook.PowerSGDState):
    """``PowerSGDState`` plus the future of the bucket :func:`serial_powersgd_hook` started last."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.previous: Optional[torch.futures.Future] = None


def serial_powersgd_hook(state: SerialPowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``powerSGD_hook``, one bucket after another: a bucket's exchange starts once the
    previous bucket's has finished (the backward pass goes on meanwhile), so at most one of its
    callbacks waits on a Gloo thread at a time (see the module docstring), and every rank calls
    its collectives in the same order (the stock hook's callbacks race the next bucket's first
    allreduce differently on each rank). The compression is PyTorch's, unchanged: the same
    gradients as the stock hook where that one finishes."""
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def finish(future: torch.futures.Future[torch.Tensor]) -> None:
        try:
            result.set_result(future.value())
        except Exception as error:  # handed to DDP, which raises it from backward()
            result.set_exception(error)

    def start(_: Any) -> None:
        try:
            powerSGD_hook.powerSGD_hook(state, bucket).add_done_callback(finish)
        except Exception as error:
            result.set_exception(error)

    previous, state.previous = state.previous, result
    if previous is None:
        start(None)
    else:
        previous.add_done_callback(start)
    return result


# DDP compares the hook's annotations with the objects themselves, not with their names.
serial_powersgd_hook.__annotations__ = {"state": SerialPowerSGDState, "bucket": dist.GradBucket,
                                        "return": torch.futures.Future[torch.Tensor]}


def powersgd_baseline(device: str, rank: int = POWERSGD_RANK,
                      start: int = POWERSGD_START_ITER) -> Tuple[Any, Callable[..., Any]]:
    """PowerSGD at ``rank`` from step ``start`` as ``(state, hook)`` for a DDP model on ``device``:
    PyTorch's hook on CUDA (NCCL), :func:`serial_powersgd_hook` elsewhere (Gloo)."""
    if device.startswith("cuda"):
        return (powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=start), powerSGD_hook.powerSGD_hook)
    return (SerialPowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start),
            serial_powersgd_hook)


def _bf16(device: str) -> Tuple[Any, Callable[..., Any]]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return None, default_hooks.bf16_compress_hook


#: The baselines as ``(state, hook)`` factories of the device: PyTorch's bfloat16 all-reduce hook
#: (CUDA only: DDP refuses it elsewhere) and PowerSGD at :data:`POWERSGD_RANK` (from step
#: :data:`POWERSGD_START_ITER` on; :func:`powersgd_baseline`).
BASELINE_HOOKS: Dict[str, Callable[[str], Tuple[Any, Callable[..., Any]]]] = {"bf16_hook": _bf16,
                                                                              "powersgd": powersgd_baseline}


def baselines(device: str) -> List[str]:
    """The :data:`BASELINE_HOOKS` that run on ``device``."""
    return [name for name in BASELINE_HOOKS if device.startswith("cuda") or name != "bf16_hook"]
