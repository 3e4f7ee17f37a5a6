"""Worker: exact resume from per-rank checkpoints, and loading into another worker count or
grouping (see ``tests/torch/test_resume.py``).

Each config trains a parameter set on the known per-rank gradients of ``tests/support/streams.py`` with
one method (keys as in ``tests/workers/torch_exchange.py``: ``method``, ``options``, ``groups``,
``shapes``, ``seed``, given times ``backward_seconds`` / ``step_seconds`` / ``cost_model`` / ``local_cost``) and
``half`` = N, in one ``phase``:

- ``continuous``: 2N steps in one process;
- ``first``: N steps: its output file is every rank's checkpoint;
- ``second`` (a later launch: fresh processes): every rank loads its own file
  (``torch.load(weights_only=True)``) and trains steps N..2N-1;
- ``grow`` (a later launch on more workers): the ranks that have a file load theirs, then
  ``hvd.broadcast_parameters`` and ``hs.broadcast_optimizer_state`` from rank 0 (a new rank
  starts with empty residuals) and steps N..2N-1; records what conservation needs;
- ``regroup``: loads config ``source``'s checkpoint into an optimizer built with ``groups``
  and records the error (type and message).

Every training phase writes ``{name}.{phase}.rank{r}.pt`` (the parameters and the optimizer's
``state_dict()`` at the end, saved as Horovod's idiom saves them) and
``{name}.{phase}.rank{r}.json`` (per-step statistics and delivered gradients, residuals per
parameter).
"""
import json
from pathlib import Path

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hs
from horovod_sparse.common.cost_model import AlphaBeta
from horovod_sparse.common.cost_model import LocalCost
from horovod_sparse.common.grouping import ReadyTimeline
from tests.workers.torch_exchange import VirtualClock, backward, grouping, main, make_params, step_seconds


def build(config):
    """Parameters, the optimizer and the virtual clock (None without given times) of ``config``."""
    params = make_params(config["shapes"], config["seed"], torch.float32)
    compression = hs.Compression.create(config["method"], **config.get("options", {}))
    if "cost_model" in config:
        compression.cost_model = AlphaBeta(workers=hvd.size(), **config["cost_model"])
    if "local_cost" in config:
        compression.local_cost = LocalCost(**config["local_cost"])
    opt = hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9),
                                  named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                  compression=compression, groups=grouping(config.get("groups"), params))
    clock = None
    if "backward_seconds" in config or "step_seconds" in config:
        clock = VirtualClock()
        opt.timeline = ReadyTimeline(clock)
        for p in params if "backward_seconds" in config else []:
            p.register_hook(clock.after(config["backward_seconds"] * (1 + hvd.rank())))
    return params, opt, clock


def residuals_by_parameter(opt, params):
    """Each parameter's part of its group's residual, in parameter order."""
    sizes = {f"p{i}": p.numel() for i, p in enumerate(params)}
    parts = {}
    for names, flat in zip(opt.groups, opt.residuals().values()):
        parts.update(zip(names, flat.split([sizes[n] for n in names])))
    return [parts[f"p{i}"].double().numpy().copy() for i in range(len(params))]


def velocities(opt):
    """DGC's velocity per group (None where a group has none)."""
    groups = opt.state_dict()["horovod_sparse"]["groups"]
    return {name: None if not record.get("state") or record["state"]["state"] is None
            else record["state"]["state"]["velocity"].double().numpy().tolist()
            for name, record in groups.items()}


def train(config, params, opt, clock, steps, record):
    """Train ``steps``, appending each step's statistics and delivered gradients to ``record``."""
    rank = hvd.rank()
    for step in steps:
        opt.zero_grad()
        backward(params, config["seed"], step, rank)
        if "step_seconds" in config:
            sizes = {f"p{i}": p.numel() for i, p in enumerate(params)}
            clock.advance(step_seconds(config["step_seconds"], [sum(sizes[n] for n in g) for g in opt.groups],
                                       step, rank))
        opt.synchronize()
        record["delivered"].append([p.grad.detach().double().numpy().reshape(-1).tolist() for p in params])
        with opt.skip_synchronize():
            opt.step()
        record["stats"].append(opt.last_stats.as_dict())
        if step == steps.start and record.get("velocity_before") is not None:
            record["velocity_after"] = velocities(opt)


def run(config, out: Path):
    rank, half, phase = hvd.rank(), config["half"], config["phase"]
    params, opt, clock = build(config)
    checkpoint = out / f"{config.get('source', config['name'])}.first.rank{rank}.pt"
    record = {"stats": [], "delivered": []}
    if phase == "regroup":
        saved = torch.load(checkpoint, weights_only=True)
        try:
            opt.load_state_dict(saved["optimizer"])
            record["raised"] = [None, None]
        except Exception as err:  # noqa: BLE001  (the test says which error it expects)
            record["raised"] = [type(err).__name__, str(err)]
        (out / f"{config['name']}.{phase}.rank{rank}.json").write_text(json.dumps(record))
        return
    start = 0
    if phase in ("second", "grow"):
        start = half
        if checkpoint.exists():
            saved = torch.load(checkpoint, weights_only=True)
            for p, value in zip(params, saved["params"]):
                p.data.copy_(value)
            opt.load_state_dict(saved["optimizer"])
        if phase == "grow":
            hvd.broadcast_parameters({f"p{i}": p for i, p in enumerate(params)}, root_rank=0)
            hs.broadcast_optimizer_state(opt, root_rank=0)
            record["loaded"] = checkpoint.exists()
            record["start_residuals"] = [r.tolist() for r in residuals_by_parameter(opt, params)]
            record["velocity_before"] = velocities(opt) if config["method"] == "dgc" else None
    stop = half if phase == "first" else 2 * half
    train(config, params, opt, clock, range(start, stop), record)
    record["steps"] = opt.steps
    record["groups"] = opt.groups
    record["end_residuals"] = [r.tolist() for r in residuals_by_parameter(opt, params)]
    torch.save({"params": [p.detach().clone() for p in params], "optimizer": opt.state_dict()},
               out / f"{config['name']}.{phase}.rank{rank}.pt")
    (out / f"{config['name']}.{phase}.rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(run)
