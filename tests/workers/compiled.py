"""Worker (``horovodrun``): a model compiled with ``torch.compile`` (Inductor, the default) trains
through horovod_sparse beside the same model run eagerly (issue 43, item 5).

Each config: ``{"name", "front_end", "method", "steps", "optimize_ddp", "compiled_autograd"}``:

- ``front_end``: ``"horovod"``, ``hs.DistributedOptimizer`` (its post-accumulate-grad hooks) over
  ``torch.compile(model)``; ``"ddp"``, ``torch.compile(DDP(model))`` with the comm hook, over a
  Gloo process group of the same ranks (rank 0's TCP store, its port sent through Horovod);
- ``optimize_ddp``: Dynamo's DDP mode for the compiled run (``"ddp_optimizer"`` by default,
  ``"python_reducer"`` for the refusal);
- ``compiled_autograd``: the backward pass compiled too.

Both runs start from the same parameters and see the same per-rank batch at every step; each
writes its parameters after every step (``eager_{step}_{i}``, ``compiled_{step}_{i}``). The record
has each run's losses and per-step statistics (``(selected, union, dense)`` per group), or the
compiled run's error (type and message) where it raised.
"""
import socket
from typing import Any, Dict, List, Tuple

import horovod.torch as hvd
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import horovod_sparse.ddp as hsd
import horovod_sparse.torch as hs
from tests.workers.cli import configs_and_out, init_torch_worker, write_record

OPTIONS = {"density": 0.1, "min_numel": 0}
BATCH, FEATURES, CLASSES = 16, 20, 10


def model() -> torch.nn.Module:
    """The same three-layer network on every rank and in every run."""
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))


def batch() -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch, the same at every step (so that the loss falls within a few steps)."""
    generator = torch.Generator().manual_seed(hvd.rank())
    return (torch.randn(BATCH, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (BATCH,), generator=generator))


def group_stats(stats: Any) -> List[List[Any]]:
    return [[g.selected, g.union, g.dense] for g in stats.groups]


def train(config: Dict[str, Any], compiled: bool) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    """``config['steps']`` steps of one run: its parameters after each step and its record."""
    net = model()
    if config["front_end"] == "horovod":
        optimizer = hs.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                            named_parameters=net.named_parameters(),
                                            compression=hs.Compression.create(config["method"], **OPTIONS))
        front, engine = net, optimizer
    else:
        front = DistributedDataParallel(net)
        engine = hsd.State(compression=hsd.Compression.create(config["method"], **OPTIONS))
        front.register_comm_hook(engine, hsd.hook)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    run = torch.compile(front) if compiled else front
    arrays, losses, stats = {}, [], []
    prefix = "compiled" if compiled else "eager"
    inputs, targets = batch()
    for step in range(config["steps"]):
        loss = torch.nn.functional.cross_entropy(run(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        stats.append(group_stats(engine.last_stats))
        arrays.update({f"{prefix}_{step}_{i}": p.detach().numpy().copy() for i, p in enumerate(net.parameters())})
    return arrays, {"losses": losses, "stats": stats}


def observe(config: Dict[str, Any]) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    arrays, eager = train(config, compiled=False)
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = config.get("optimize_ddp", "ddp_optimizer")
    torch._dynamo.config.compiled_autograd = config.get("compiled_autograd", False)
    try:
        compiled_arrays, compiled = train(config, compiled=True)
        arrays.update(compiled_arrays)
    except Exception as error:  # the record says what was raised; the test decides
        compiled = {"error": [type(error).__name__, str(error)]}
    finally:
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
        torch._dynamo.config.compiled_autograd = False
    return arrays, {"eager": eager, "compiled": compiled}


def main() -> None:
    configs, out = configs_and_out()
    init_torch_worker()
    port = hvd.broadcast_object(_free_port() if hvd.rank() == 0 else None, root_rank=0, name="port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=hvd.size())
    for config in configs:
        arrays, record = observe(config)
        write_record(out, config["name"], hvd.rank(), arrays, record)
    hsd.exit_job()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
