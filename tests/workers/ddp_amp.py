"""Worker (``torchrun``): mixed precision through the DDP comm hook (issue 29).

Scenarios (one JSON record and one ``.npz`` per config and rank):

* ``recipe``: DDP's usual AMP loop (``scaler.scale(loss).backward()``, ``scaler.step(opt)``,
  ``scaler.update()``) with float16 autocast on CPU and a ``GradScaler`` whose first steps
  overflow, with DDP's own allreduce (``stock``) and with the method's hook given the scaler
  (``ours``); the records of :func:`tests.support.amp_loop.train`.
* ``units``: the given gradients ``G_t`` of ``tests/workers/given_gradients.py`` enter as
  ``S_t * G_t`` through a scaler set to a changing power of two ``S_t`` (``scaled``), or as
  ``G_t`` without one (``plain``); every step's unscaled aggregate, the residuals and the
  parameters.
"""
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist

import horovod_sparse.ddp as hsd
from tests.support.amp_loop import regression_model, train
from tests.workers.cli import configs_and_out, write_record
from tests.workers.ddp_exchange import GivenGradients
from tests.workers.given_gradients import make_params, step_gradients


def recipe(config: Dict[str, Any], stock: bool) -> Dict[str, Any]:
    model = regression_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** config["init_exponent"], growth_interval=4)
    groups: List[Any] = []
    if not stock:
        state = hsd.State(compression=hsd.Compression.create(config["method"], **config.get("options", {})),
                          loss_scaler=scaler)
        ddp.register_comm_hook(state, hsd.hook)
        groups = state.buckets.groups
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(loss: torch.Tensor) -> None:
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return train(ddp, scaler, config["steps"], dist.get_rank(), step,
                 lambda: [g.residual for g in groups if g.residual is not None])


def units(config: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
    rank = dist.get_rank()
    for run in ("scaled", "plain"):
        params = make_params(config["shapes"], config["seed"], torch.float32)
        exponents = config["exponents"]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** exponents[0]) if run == "scaled" else None
        state = hsd.State(compression=hsd.Compression.create(config["method"], **config.get("options", {})),
                          loss_scaler=scaler)
        ddp = torch.nn.parallel.DistributedDataParallel(GivenGradients(params), bucket_cap_mb=config["bucket_cap_mb"])
        ddp.register_comm_hook(state, hsd.hook)
        opt = torch.optim.SGD(params, lr=0.1)
        for step in range(len(exponents)):
            opt.zero_grad()
            loss = ddp(step_gradients(params, config["seed"], step, rank, "normal"), 1.0)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update(2.0 ** exponents[(step + 1) % len(exponents)])  # the next step's scale
            for i, p in enumerate(params):
                arrays[f"{run}_agg_{step}_{i}"] = p.grad.numpy().copy()
                arrays[f"{run}_param_{step}_{i}"] = p.detach().numpy().copy()
            for j, group in enumerate(state.buckets.groups):
                if group.residual is not None:
                    arrays[f"{run}_residual_{step}_{j}"] = group.residual.numpy().copy()


def main() -> None:
    configs, out = configs_and_out()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for config in configs:
        arrays: Dict[str, np.ndarray] = {}
        record: Dict[str, Any] = {}
        if config["scenario"] == "recipe":
            record = {"stock": recipe(config, stock=True), "ours": recipe(config, stock=False)}
        else:
            units(config, arrays)
        write_record(out, config["name"], dist.get_rank(), arrays, record)
    hsd.exit_job()


if __name__ == "__main__":
    main()
