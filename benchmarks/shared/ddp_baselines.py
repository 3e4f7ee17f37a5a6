"""What users would pick instead of a sparsifier on DDP, as comm hooks: PyTorch's bfloat16
all-reduce hook and PowerSGD, for the benchmarks that time them beside the methods
(:mod:`benchmarks.gpu_check`, :mod:`benchmarks.costs.exchange_cost`)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

#: PowerSGD's matrix approximation rank.
POWERSGD_RANK = 4
#: PowerSGD's ``start_powerSGD_iter``: the smallest it accepts with error feedback (its first
#: steps are dense).
POWERSGD_START_ITER = 2


def _powersgd() -> Tuple[Any, Callable[..., Any]]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    return powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                  start_powerSGD_iter=POWERSGD_START_ITER), powersgd.powerSGD_hook


def _bf16() -> Tuple[Any, Callable[..., Any]]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return None, default_hooks.bf16_compress_hook


#: The baselines as ``(state, hook)`` factories: PyTorch's bfloat16 all-reduce hook (CUDA only:
#: DDP refuses it elsewhere) and PowerSGD at :data:`POWERSGD_RANK` (from step
#: :data:`POWERSGD_START_ITER` on).
BASELINE_HOOKS: Dict[str, Callable[[], Tuple[Any, Callable[..., Any]]]] = {"bf16_hook": _bf16,
                                                                            "powersgd": _powersgd}


def baselines(device: str) -> List[str]:
    """The :data:`BASELINE_HOOKS` that run on ``device``."""
    return [name for name in BASELINE_HOOKS if device.startswith("cuda") or name != "bf16_hook"]
