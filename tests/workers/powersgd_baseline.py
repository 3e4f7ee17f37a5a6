"""One rank on a one-rank Gloo group: the benchmarks' PowerSGD baseline on the CPU
(:func:`benchmarks.shared.ddp_baselines.powersgd_baseline`) trains a model of several DDP buckets,
and PyTorch's stock ``powerSGD_hook`` the same steps, each bucket waited for inside the hook (the
backward pass stops until its exchange has finished); prints ``same`` when every step's gradients
are bitwise equal. Called as it comes, the stock hook hangs here within a few steps: the test's
timeout catches a baseline that falls back to it."""
import sys
from typing import Any, Callable, List

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from benchmarks.shared.ddp_baselines import POWERSGD_RANK, POWERSGD_START_ITER, powersgd_baseline

STEPS = 30
LAYERS = 8
WIDTH = 256
#: About one Linear layer (256 x 256 floats) per bucket.
BUCKET_MB = 0.3


def waited_powersgd_hook(state: powerSGD_hook.PowerSGDState,
                         bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's hook, its future waited for before DDP gets it: one bucket's callbacks at a time."""
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    future.wait()
    return future


waited_powersgd_hook.__annotations__ = {"state": powerSGD_hook.PowerSGDState, "bucket": dist.GradBucket,
                                        "return": torch.futures.Future[torch.Tensor]}


def trained(state: Any, hook: Callable[..., Any]) -> List[List[torch.Tensor]]:
    """Every step's gradients of the seeded model trained through DDP with ``hook``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(state, hook)
    inputs = torch.randn(STEPS, 16, WIDTH, generator=torch.Generator().manual_seed(1))
    grads = []
    for batch in inputs:
        ddp.zero_grad()
        ddp(batch).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def main() -> int:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    baseline = trained(*powersgd_baseline("cpu"))
    stock = trained(powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                                start_powerSGD_iter=POWERSGD_START_ITER), waited_powersgd_hook)
    same = all(torch.equal(a, b) for x, y in zip(baseline, stock, strict=True) for a, b in zip(x, y, strict=True))
    print("same" if same else "differ")
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
