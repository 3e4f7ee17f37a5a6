"""Worker (``torchrun``, run by the interpreter of a fresh virtual environment that holds only
PyTorch, NumPy and horovod_sparse's wheel): six steps of a small model under DDP with
horovod_sparse's comm hook (Top-k, density 0.1, one warm-up step), then one JSON record per rank
at ``sys.argv[1]/rank{r}.json``.

Self-contained on purpose: nothing from the repository is importable here (no ``tests``
helpers), so the ``horovod_sparse`` it imports is the installed wheel's.
"""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import horovod_sparse
import horovod_sparse.ddp as hsd

STEPS = 6


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
    initial = [p.detach().clone() for p in model.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = hsd.State(compression=hsd.Compression.topk(density=0.1, min_numel=0, warmup_steps=1))
    ddp.register_comm_hook(state, hsd.hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # every rank its own batches
    steps = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 20, generator=data), torch.randn(16, 5, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        steps.append([{"numel": g.numel, "target": g.target, "union": g.union, "dense": g.dense}
                      for g in state.last_stats.groups])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat)
    record = {
        "rank": rank,
        "replicas_identical": all(torch.equal(g, gathered[0]) for g in gathered),
        "moved": float(max((p.detach() - p0).abs().max() for p, p0 in zip(model.parameters(), initial))),
        "finite": bool(torch.isfinite(flat).all()),
        "steps": steps,
        "package_file": horovod_sparse.__file__,
        "version": horovod_sparse.__version__,
        "importable": {name: importlib.util.find_spec(name) is not None
                       for name in ("horovod", "tensorflow", "tests", "numpy")},
        "numpy": np.__version__,
    }
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(record))
    hsd.exit_job()


if __name__ == "__main__":
    main()
