"""Worker: trains a parameter set on known per-rank gradients with horovod_sparse's optimizer and
writes what it observed (aggregated gradients, residuals, parameters, statistics) for the test.

Each config: {"name", "method", "options", "groups", "steps", "seed", "shapes", "dtype",
"compare_stock"}. With ``compare_stock`` a second copy of the parameters is trained by
``horovod.torch.DistributedOptimizer`` with the same compression and both results are written.
"""
import argparse
import json
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch

import horovod_sparse.torch as hs
from tests.streams import raw_gradient


def make_params(shapes, seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=generator, dtype=dtype)) for s in shapes]


def backward(params, seed, step, rank):
    loss = sum((p * torch.from_numpy(raw_gradient(seed, step, rank, p.shape, i)).to(p.dtype)).sum()
               for i, p in enumerate(params))
    loss.backward()


def run(config, out: Path):
    rank, dtype = hvd.rank(), getattr(torch, config.get("dtype", "float32"))
    seed, steps = config["seed"], config["steps"]
    params = make_params(config["shapes"], seed, dtype)
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    compression = hs.Compression.create(config["method"], **config.get("options", {}))
    opt = hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9), named_parameters=named,
                                  compression=compression, groups=config.get("groups"))
    stock = None
    if config.get("compare_stock"):
        stock_params = make_params(config["shapes"], seed, dtype)
        stock = (stock_params, hvd.DistributedOptimizer(
            torch.optim.SGD(stock_params, lr=0.01, momentum=0.9),
            named_parameters=[(f"p{i}", p) for i, p in enumerate(stock_params)], compression=compression))
    aggregated, stats = [], []
    for step in range(steps):
        opt.zero_grad()
        backward(params, seed, step, rank)
        opt.synchronize()
        aggregated.append([p.grad.detach().double().numpy().copy() for p in params])
        with opt.skip_synchronize():
            opt.step()
        stats.append(opt.last_stats.as_dict())
        if stock is not None:
            stock[1].zero_grad()
            backward(stock[0], seed, step, rank)
            stock[1].step()
    arrays = {f"agg_{t}_{i}": a for t, grads in enumerate(aggregated) for i, a in enumerate(grads)}
    arrays.update({f"param_{i}": p.detach().double().numpy() for i, p in enumerate(params)})
    arrays.update({f"residual_{j}": r.double().numpy() for j, r in enumerate(opt.residuals().values())})
    if stock is not None:
        arrays.update({f"stock_{i}": p.detach().double().numpy() for i, p in enumerate(stock[0])})
    np.savez(out / f"{config['name']}.rank{rank}.npz", **arrays)
    groups = [[int(n[1:]) for n in names] for names in opt.groups]
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps({"groups": groups, "stats": stats}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    for config in json.loads(Path(args.configs).read_text()):
        run(config, Path(args.out))


if __name__ == "__main__":
    main()
