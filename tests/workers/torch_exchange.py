"""Worker: trains a parameter set on known per-rank gradients with horovod_sparse's optimizer and
writes what it observed (aggregated gradients, residuals, parameters, statistics) for the test.

Each config: {"name", "method", "options", "groups", "steps", "seed", "shapes", "dtype",
"compare_stock", "stream", "backward_passes", "backward_seconds", "step_seconds", "cost_model",
"local_cost", "hierarchical"}:

- ``stream``: see ``tests.support.streams.raw_gradient``;
- ``groups``: what ``groups=`` takes, with lists of parameter indices for lists of parameters
  and ``{"mergecomp": {options}}`` for ``MergeCompOptions``;
- ``backward_passes``: each step's gradient arrives over that many backward passes
  (``backward_passes_per_step`` of both optimizers);
- ``backward_seconds``, ``step_seconds``: given times instead of measured ones (see
  :class:`VirtualClock`), so what LAGS and MergeComp decide from times is a function of the
  config, not of the machine's speed: each gradient takes ``backward_seconds * (1 + rank)``
  seconds; each step ``step_seconds(spec, ...)`` seconds;
- ``cost_model``: ``{"alpha", "beta"}``, the alpha-beta model LAGS uses instead of timing
  allgathers at the end of step 0; ``local_cost``: the ``LocalCost`` fields LAGS uses instead
  of timing its selection and scatter-add there;
- ``hierarchical``: the optimizer's argument (the job starts Horovod with dynamic process sets
  when a config sets it);
- ``compare_stock``: a second copy of the parameters is trained by
  ``horovod.torch.DistributedOptimizer`` with the same compression and both results are written.
"""
import json
from pathlib import Path
from typing import Callable, List

import horovod.torch as hvd
import numpy as np
import torch

import horovod_sparse.torch as hs
from horovod_sparse.common.cost_model import AlphaBeta
from horovod_sparse.common.cost_model import LocalCost
from horovod_sparse.common.grouping import ReadyTimeline
from horovod_sparse.common.mergecomp import MergeCompOptions
from tests.workers.cli import configs_and_out
from tests.workers.given_gradients import make_params, part_weights, step_gradients
from tests.workers.virtual_time import VirtualClock, step_seconds


def backward(params, seed, step, rank, stream="normal", passes=1):
    """Accumulate the step's gradient over ``passes`` backward passes (:func:`part_weights`)."""
    grads = step_gradients(params, seed, step, rank, stream)
    for weight in part_weights(passes):
        loss = sum((p * g).sum() for p, g in zip(params, grads)) * weight
        loss.backward()


def grouping(spec, params):
    """``groups=`` from a config value (see the module docstring)."""
    if isinstance(spec, list):
        return [[params[i] for i in members] for members in spec]
    if isinstance(spec, dict):
        return MergeCompOptions(**spec["mergecomp"])
    return spec


def indices(groups: List[List[str]]) -> List[List[int]]:
    """The optimizer's groups (parameter names ``p<i>``) as lists of parameter indices."""
    return [[int(name[1:]) for name in names] for names in groups]


def run(config, out: Path):
    rank, dtype = hvd.rank(), getattr(torch, config.get("dtype", "float32"))
    seed, steps = config["seed"], config["steps"]
    params = make_params(config["shapes"], seed, dtype)
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    compression = hs.Compression.create(config["method"], **config.get("options", {}))
    if "cost_model" in config:
        compression.cost_model = AlphaBeta(workers=hvd.size(), **config["cost_model"])
    if "local_cost" in config:
        compression.local_cost = LocalCost(**config["local_cost"])
    passes = config.get("backward_passes", 1)
    opt = hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9), named_parameters=named,
                                  compression=compression, groups=grouping(config.get("groups"), params),
                                  backward_passes_per_step=passes, hierarchical=config.get("hierarchical"))
    clock = None
    if "backward_seconds" in config or "step_seconds" in config:
        clock = VirtualClock()
        opt.timeline = ReadyTimeline(clock)
        for p in params if "backward_seconds" in config else []:
            p.register_hook(clock.after(config["backward_seconds"] * (1 + rank)))
    sizes = {f"p{i}": p.numel() for i, p in enumerate(params)}
    stock = None
    if config.get("compare_stock"):
        stock_params = make_params(config["shapes"], seed, dtype)
        stock = (stock_params, hvd.DistributedOptimizer(
            torch.optim.SGD(stock_params, lr=0.01, momentum=0.9),
            named_parameters=[(f"p{i}", p) for i, p in enumerate(stock_params)], compression=compression,
            groups=grouping(config.get("groups"), stock_params), backward_passes_per_step=passes))
    aggregated, stats, launch_order, step_groups = [], [], [], []
    for step in range(steps):
        opt.zero_grad()
        backward(params, seed, step, rank, config.get("stream", "normal"), passes)
        step_groups.append(indices(opt.groups))  # launched: synchronize() may regroup for the next step
        if "step_seconds" in config:
            clock.advance(step_seconds(config["step_seconds"], [sum(sizes[n] for n in g) for g in opt.groups],
                                       step, rank))
        opt.synchronize()
        launch_order.append(opt.timeline.last.launch_order)
        aggregated.append([p.grad.detach().double().numpy().copy() for p in params])
        with opt.skip_synchronize():
            opt.step()
        stats.append(opt.last_stats.as_dict())
        if stock is not None:
            stock[1].zero_grad()
            backward(stock[0], seed, step, rank, config.get("stream", "normal"), passes)
            stock[1].step()
    arrays = {f"agg_{t}_{i}": a for t, grads in enumerate(aggregated) for i, a in enumerate(grads)}
    arrays.update({f"param_{i}": p.detach().double().numpy() for i, p in enumerate(params)})
    arrays.update({f"residual_{j}": r.double().numpy() for j, r in enumerate(opt.residuals().values())})
    if stock is not None:
        arrays.update({f"stock_{i}": p.detach().double().numpy() for i, p in enumerate(stock[0])})
    np.savez(out / f"{config['name']}.rank{rank}.npz", **arrays)
    groups = indices(opt.groups)
    mergecomp = None if opt.mergecomp is None or opt.mergecomp.result is None else opt.mergecomp.result.as_dict()
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps(
        {"groups": groups, "step_groups": step_groups, "stats": stats, "launch_order": launch_order,
         "mergecomp": mergecomp}))


def main(run_config: Callable[[dict, Path], None] = run) -> None:
    """A worker's main: ``run_config(config, out)`` for every config of this launch (``--configs
    FILE --out DIR``), after ``hvd.init()``."""
    configs, out = configs_and_out()
    hvd.init(process_sets="dynamic" if any(c.get("hierarchical") for c in configs) else None)
    torch.set_num_threads(1)
    for config in configs:
        run_config(config, out)


if __name__ == "__main__":
    main()
