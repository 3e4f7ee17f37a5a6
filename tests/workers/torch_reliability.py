"""Worker: reliability scenarios (bad configuration across ranks, dtypes, parameters without
gradients, state broadcast), with one group per tensor (the records and the errors name
parameters). Each scenario writes a JSON record per rank; the test asserts on them. Scenarios
run one after another in the same launch, so a scenario that hung or left Horovod in a bad
state would also fail every later one.
"""
import json

import horovod.torch as hvd
import numpy as np
import torch

import horovod_sparse.torch as hs
from tests.support.mismatch import BASE_OPTIONS, wrapper_arguments
from tests.support.streams import raw_gradient

from tests.workers.cli import configs_and_out

SHAPES = [[40, 30], [30], [20, 9]]


def make_params(shapes=SHAPES, dtype=torch.float32, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=generator, dtype=torch.float64).to(dtype)) for s in shapes]


def wrap(params, method="topk", **options):
    options.setdefault("min_numel", 0)
    options.setdefault("density", 0.05)
    return hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9),
                                   named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                   compression=hs.Compression.create(method, **options), groups="tensor")


def backward(params, step, seed=5, skip=()):
    terms = []
    for i, p in enumerate(params):
        if i in skip:
            continue
        g = torch.from_numpy(raw_gradient(seed, step, hvd.rank(), p.shape, i)).to(p.dtype)
        terms.append((p * g).sum())
    sum(terms).backward()


def build(settings):
    """An optimizer from a mismatch case's settings (see ``tests/support/mismatch.py``): ``method`` (a
    registered one, or Horovod's ``none`` / ``fp16``), ``options`` over ``BASE_OPTIONS``,
    ``wrapper`` arguments (``op`` by name, ``groups`` with ``{"mergecomp": {...}}``), ``shapes``,
    ``dtype``."""
    params = make_params(settings.get("shapes", SHAPES), getattr(torch, settings.get("dtype", "float32")))
    method = settings.get("method", "topk")
    compression = (getattr(hvd.Compression, method) if method in ("none", "fp16")
                   else hs.Compression.create(method, **{**BASE_OPTIONS, **settings.get("options", {})}))
    wrapper = {"groups": "tensor", **wrapper_arguments(settings, hvd)}
    return hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.01),
                                   named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                   compression=compression, **wrapper)


def scenario_mismatches(config):
    """Each case: rank 1's settings differ in one field; every rank must raise ValueError."""
    results = {}
    for case in config["cases"]:
        settings = {**case["rank0"], **(case["rank1"] if hvd.rank() == 1 else {})}
        try:
            build(settings)
            results[case["name"]] = None
        except ValueError as err:
            results[case["name"]] = str(err)
    return results


def scenario_stock_refuses(config):
    """A sparsifier inside the stock hvd.DistributedOptimizer must refuse on every rank."""
    params = make_params()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.01),
                                   named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                   compression=hs.Compression.topk(density=0.1))
    try:
        backward(params, 0)
        opt.step()
    except TypeError as err:
        return {"raised": "TypeError", "message": str(err)}
    return {"raised": None}


def scenario_dtypes(config):
    """Train a few steps with parameters of one dtype; report parameters and conservation terms."""
    dtype = getattr(torch, config["dtype"])
    params = make_params(dtype=dtype)
    opt = wrap(params, fp16_values=config.get("fp16_values", False))
    delivered = [np.zeros(p.numel()) for p in params]
    for step in range(5):
        opt.zero_grad()
        backward(params, step)
        opt.synchronize()
        for total, p in zip(delivered, params):
            total += p.grad.detach().double().numpy().reshape(-1)
        with opt.skip_synchronize():
            opt.step()
    return {"params": [p.detach().double().numpy().tolist() for p in params],
            "delivered": [d.tolist() for d in delivered],
            "residuals": [r.double().numpy().tolist() for r in opt.residuals().values()],
            "grad_dtypes": [str(p.grad.dtype) for p in params]}


def scenario_odd_parameters(config):
    """Integer, bool, frozen and zero-size parameters are ignored; a non-contiguous gradient
    works; rank 0 skips parameter 1 on even steps (dynamic graph) and no rank ever computes a
    gradient for ``unused``: no hang, identical replicas, ``unused`` exchanged as zeros."""
    params = make_params()
    counter = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    empty = torch.nn.Parameter(torch.zeros(0))
    transposed = torch.nn.Parameter(torch.randn(6, 5, generator=torch.Generator().manual_seed(1)))
    flag = torch.nn.Parameter(torch.tensor([True, False]), requires_grad=False)
    unused = torch.nn.Parameter(torch.randn(7, generator=torch.Generator().manual_seed(2)))
    start = unused.detach().clone()
    everything = params + [counter, frozen, empty, transposed, flag, unused]
    opt = hs.DistributedOptimizer(torch.optim.SGD(everything, lr=0.01, momentum=0.9),
                                  named_parameters=[(f"q{i}", p) for i, p in enumerate(everything)],
                                  compression=hs.Compression.topk(density=0.1, min_numel=0), groups="tensor")
    unused_grads = []
    for step in range(6):
        opt.zero_grad()
        skip = (1,) if hvd.rank() == 0 and step % 2 == 0 else ()
        backward(params, step, skip=skip)
        (transposed.t() * torch.arange(30.0).view(5, 6)).sum().backward()  # grad of a transposed view
        opt.step()
        unused_grads.append(None if unused.grad is None else unused.grad.abs().max().item())
    return {"params": [p.detach().double().numpy().tolist() for p in params + [transposed, unused]],
            "groups": opt.groups, "unused_grads": unused_grads,
            "unused_unchanged": bool(torch.equal(unused.detach(), start)),
            "ignored_unchanged": [bool(torch.equal(counter, torch.zeros(3, dtype=torch.int64))),
                                  bool(torch.equal(flag, torch.tensor([True, False])))]}


def scenario_nothing_to_exchange(config):
    """An optimizer whose parameters carry no gradient to exchange (frozen, integer, bool): no
    group, no collective, steps still counted on every rank."""
    frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    counter = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    flag = torch.nn.Parameter(torch.tensor([True]), requires_grad=False)
    opt = hs.DistributedOptimizer(torch.optim.SGD([frozen, counter, flag], lr=0.01),
                                  named_parameters=[("frozen", frozen), ("counter", counter), ("flag", flag)],
                                  compression=hs.Compression.topk(density=0.1, min_numel=0))
    for _ in range(3):
        opt.zero_grad()
        opt.step()
    return {"groups": opt.groups, "steps": opt.steps, "residuals": len(opt.residuals()),
            "params": [frozen.tolist(), counter.tolist(), flag.tolist()]}


def scenario_broadcast_state(config):
    """hvd.broadcast_optimizer_state and hs.broadcast_optimizer_state on a fresh wrapper. Every
    rank starts from its own parameters (seeded by rank), so only the broadcast makes them equal."""
    params = make_params(seed=5 + hvd.rank())
    initial = [p.detach().double().numpy().tolist() for p in params]
    opt = wrap(params)
    hvd.broadcast_parameters({f"p{i}": p for i, p in enumerate(params)}, root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    hs.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(3):
        opt.zero_grad()
        backward(params, step)
        opt.step()
    return {"params": [p.detach().double().numpy().tolist() for p in params], "steps": opt.steps,
            "initial": initial}


def main():
    configs, out = configs_and_out()
    hvd.init()
    torch.set_num_threads(1)
    for config in configs:
        record = globals()[f"scenario_{config['scenario']}"](config)
        path = out / f"{config['name']}.rank{hvd.rank()}.json"
        path.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
