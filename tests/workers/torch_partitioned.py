"""Worker for the MiCRO/ExDyna tests: like ``torch_exchange.py``, with the
gradient streams of ``tests.support.reference_partitioned.stream_gradient`` (ranks that only produce
zeros, zero gradients from some step on).

Each config: {"name", "method", "options", "groups", "steps", "seed", "shapes", "zero_ranks",
"zero_after", "momentum"} (``momentum``: the wrapped SGD's, default 0.9). Writes the files that
``tests.support.checks.Observed`` reads.
"""
import json
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch

import horovod_sparse.torch as hs
from tests.support.reference_partitioned import stream_gradient
from tests.workers.torch_exchange import main, make_params


def run(config, out: Path):
    rank = hvd.rank()
    params = make_params(config["shapes"], config["seed"], torch.float32)
    compression = hs.Compression.create(config["method"], **config.get("options", {}))
    base = torch.optim.SGD(params, lr=0.01, momentum=config.get("momentum", 0.9))
    opt = hs.DistributedOptimizer(base, named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                  compression=compression, groups=config.get("groups"))
    arrays, stats = {}, []
    for step in range(config["steps"]):
        opt.zero_grad()
        loss = sum((p * torch.from_numpy(stream_gradient(config, step, rank, p.shape, i)).float()).sum()
                   for i, p in enumerate(params))
        loss.backward()
        opt.synchronize()
        arrays.update({f"agg_{step}_{i}": p.grad.detach().double().numpy().copy() for i, p in enumerate(params)})
        with opt.skip_synchronize():
            opt.step()
        stats.append(opt.last_stats.as_dict())
    arrays.update({f"param_{i}": p.detach().double().numpy() for i, p in enumerate(params)})
    arrays.update({f"residual_{j}": r.double().numpy() for j, r in enumerate(opt.residuals().values())})
    np.savez(out / f"{config['name']}.rank{rank}.npz", **arrays)
    groups = [[int(name[1:]) for name in names] for names in opt.groups]
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps({"groups": groups, "stats": stats}))


if __name__ == "__main__":
    main(run)
