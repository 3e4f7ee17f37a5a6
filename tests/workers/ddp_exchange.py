"""Worker (``torchrun``): trains a parameter set on known per-rank gradients through DDP with
horovod_sparse's comm hook and writes what it observed, in the layout of
``tests/workers/torch_exchange.py`` (same parameters, same gradients), so ``tests.support.checks`` reads
both and the two front ends compare bitwise.

Each config: {"name", "method", "options", "steps", "seed", "shapes", "dtype", "stream",
"bucket_cap_mb", "passes", "resume_at", "nan_at", "nonfinite", "options_of_rank", "hierarchical",
"node_size", "reads", "forward_order"} (``hierarchical`` and ``node_size``: ``State``'s arguments):

- ``forward_order``: the parameter indices in the order the forward pass takes them (default
  descending, so that backward readies the gradients in ascending order, DDP's first layout):
  another order makes DDP rebuild its buckets in another order after its first step;

- ``passes``: each step's gradient arrives over that many backward passes, all but the last
  under ``ddp.no_sync()`` (parts 1:2:..., as torch_exchange's ``backward_passes``);
- ``resume_at``: after that many steps this rank's ``State.state_dict()``, the parameters and the
  optimizer's state go through ``torch.save`` / ``torch.load(weights_only=True)`` into a fresh
  model, DDP and State (DDP's first iteration again; with ``resume_bucket_cap_mb``, other
  buckets from then on), and training goes on;
- ``nan_at``: ``[step, rank]``: that rank's gradient is NaN at that step (the policy is
  ``nonfinite``); the step's error, if any, is recorded and ``optimizer.step()`` is skipped
  when ``state.last_stats.abandoned``;
- ``reads``: an empty list: the hook runs on the accelerators' paths and counts its host reads
  (:func:`counting`); the record's ``reads`` has each step's (the names, in order), its ``ops``
  each step's operations dispatched, per bucket;
- ``options_of_rank``: ``{rank: options}`` replacing ``options`` on that rank (a configuration
  that differs between ranks: the first exchange must raise everywhere).

Each step's statistics also go to ``State(stats_log=)``, a ``.jsonl`` file. The JSON record has
the groups (lists of parameter indices), per-step statistics and errors, and whether Horovod was
imported (it must not be).
"""
import functools
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import horovod_sparse.ddp as hsd
from tests.support.host_reads import DispatchedOps, reads_on_accelerator_paths
from tests.workers.cli import torchrun_main
from tests.workers.given_gradients import make_params, part_weights, step_gradients


class GivenGradients(torch.nn.Module):
    """A model whose gradient is what the caller passes: ``loss = weight * sum(p * g)``. The
    parameters are registered last first, so that DDP's buckets, which take them in reverse,
    hold them in ascending order, as the Horovod optimizer's groups do (their flat layout
    decides partitions and ties)."""

    def __init__(self, params, order=None):
        super().__init__()
        self.reversed = torch.nn.ParameterList(params[::-1])
        #: The order of the terms in the forward pass (parameter indices; default descending),
        #: whose reverse is the order backward readies their gradients in.
        self.order = list(range(len(params)))[::-1] if order is None else order

    def forward(self, grads, weight):
        params = self.reversed[::-1]
        return sum((params[i] * grads[i]).sum() for i in self.order) * weight


def build(config, params, rank, stats_log=None):
    """DDP over ``params`` with horovod_sparse's hook, its State and an optimizer."""
    options = config.get("options_of_rank", {}).get(str(rank), config.get("options", {}))
    state = hsd.State(compression=hsd.Compression.create(config["method"], **options),
                      nonfinite=config.get("nonfinite", "default"), stats_log=stats_log,
                      hierarchical=config.get("hierarchical"), node_size=config.get("node_size"))
    ddp = torch.nn.parallel.DistributedDataParallel(GivenGradients(params, config.get("forward_order")),
                                                    bucket_cap_mb=config.get("bucket_cap_mb", 25))
    ddp.register_comm_hook(state, counting(hsd.hook, config["reads"], config.setdefault("ops", []),
                                           config.setdefault("results", []))
                           if "reads" in config else hsd.hook)
    return ddp, state, torch.optim.SGD(params, lr=0.01, momentum=0.9)


def counting(hook, reads, ops, results):
    """``hook`` run on the accelerators' paths with its host reads counted
    (:func:`tests.support.host_reads.reads_on_accelerator_paths`) into ``reads``: the exchange, and the
    end of the step in the last bucket's hook; the operations it dispatched
    (:class:`tests.support.host_reads.DispatchedOps`) appended to ``ops``, one count per bucket; and
    each bucket's buffer with the future returned, appended to ``results``."""
    @functools.wraps(hook)
    def counted(state, bucket):
        with reads_on_accelerator_paths(reads), DispatchedOps() as dispatched:
            result = hook(state, bucket)
        ops.append(dispatched.count)
        results.append((bucket.buffer(), result))
        return result

    return counted


def resumed(config, params, state, opt, rank):
    """A fresh model, DDP, State and optimizer continuing from this one's saved state."""
    buffer = io.BytesIO()
    torch.save({"state": state.state_dict(), "params": [p.detach() for p in params],
                "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    fresh = make_params(config["shapes"], config["seed"] + 1, params[0].dtype)
    with torch.no_grad():
        for p, value in zip(fresh, saved["params"]):
            p.copy_(value)
    buckets = config.get("resume_bucket_cap_mb", config.get("bucket_cap_mb", 25))
    ddp, state, opt = build({**config, "bucket_cap_mb": buckets}, fresh, rank)
    state.load_state_dict(saved["state"])
    opt.load_state_dict(saved["opt"])
    return fresh, ddp, state, opt


def run(config, out: Path):
    rank, dtype = dist.get_rank(), getattr(torch, config.get("dtype", "float32"))
    seed, passes = config["seed"], config.get("passes", 1)
    params = make_params(config["shapes"], seed, dtype)
    log = (out / f"{config['name']}.rank{rank}.jsonl").open("w")
    ddp, state, opt = build(config, params, rank, log)
    aggregated, stats, errors, reads, ops, over = [], [], [], [], [], []
    for step in range(config["steps"]):
        if "reads" in config:
            config["reads"].clear()
            config["ops"].clear()
            config["results"].clear()
        if step == config.get("resume_at"):
            params, ddp, state, opt = resumed(config, params, state, opt, rank)
        opt.zero_grad()
        grads = step_gradients(params, seed, step, rank, config.get("stream", "normal"))
        if config.get("nan_at") == [step, rank]:
            grads[0] = grads[0] * float("nan")
        try:
            for part, weight in enumerate(part_weights(passes), start=1):
                if part < passes:
                    with ddp.no_sync():
                        ddp(grads, weight).backward()
                else:
                    ddp(grads, weight).backward()
        except RuntimeError as error:  # the nonfinite policy "raise", through DDP
            errors.append([step, str(error)])
        except ValueError as error:  # a configuration error: DDP's reducer is left mid-step
            errors.append([step, str(error)])
            break
        aggregated.append([p.grad.detach().double().numpy().copy() for p in params])
        reads.append(list(config.get("reads", [])))
        ops.append(list(config.get("ops", [])))
        # Whether each bucket's aggregate was written over the bucket's own buffer.
        over.append([future.value().data_ptr() == buffer.data_ptr() for buffer, future in config.get("results", [])])
        stats.append(state.last_stats.as_dict())
        if not state.last_stats.abandoned:
            opt.step()
    log.close()
    index = {id(p): i for i, p in enumerate(params)}
    groups = state.buckets.groups
    arrays = {f"agg_{t}_{i}": a for t, grads in enumerate(aggregated) for i, a in enumerate(grads)}
    arrays.update({f"param_{i}": p.detach().double().numpy() for i, p in enumerate(params)})
    arrays.update({f"residual_{j}": (np.zeros(g.numel) if g.residual is None else g.residual.double().numpy())
                   for j, g in enumerate(groups)})
    np.savez(out / f"{config['name']}.rank{rank}.npz", **arrays)
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps(
        {"groups": [[index[id(p)] for p in g.params] for g in groups], "stats": stats, "errors": errors,
         "reads": reads, "ops": ops, "written_over_buckets": over, "horovod_imported": "horovod" in sys.modules}))


if __name__ == "__main__":
    torchrun_main(run)
