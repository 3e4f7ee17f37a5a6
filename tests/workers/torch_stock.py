"""Worker: horovod_sparse's PyTorch wrapper with Horovod's own compressions against the stock
``hvd.DistributedOptimizer``, one wrapper argument at a time (tests/engine/test_stock.py).

Scenarios (one JSON record per rank each, the test asserts on them):

* ``torch``: a config names a compression (``none`` / ``fp16``) and the ``wrapper`` arguments
  both optimizers get (``op``, ``gradient_predivide_factor``, ``num_groups``, ``groups`` as an int
  or lists of parameter names, ``sparse_as_dense``, ``backward_passes_per_step``,
  ``process_set`` as a list of ranks); ``stock`` overrides some of them for the stock optimizer
  only. Both train the same model (an embedding, sparse when ``sparse_embedding``, and two dense
  layers) from the same initial values on the same rank-dependent batches; the record holds, per
  kind, its groups, every step's aggregated gradients and parameters, or the
  error the construction or a step raised.
* ``set_passes``: ``set_backward_passes_per_step`` with bad values (refused as by the
  constructor) and a good one.
* ``mismatch``: rank 1 builds its model with one parameter of another shape (as many elements)
  or dtype; every rank records the ``ValueError`` its wrapper raised (None: it went on).
"""
import json

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hs
from tests.workers.cli import compression as shared_compression
from tests.workers.cli import configs_and_out

STEPS = 3
#: Process sets by their ranks, created at ``hvd.init`` (see :func:`main`).
PROCESS_SETS = {}


def compression(name):
    return shared_compression(hvd, hs, name)


def make_model(sparse_embedding=False, shape=(16, 8), dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "embedding": torch.nn.Embedding(10, 4, sparse=sparse_embedding),
        "hidden": torch.nn.Linear(8, 16),
        "out": torch.nn.Linear(16, 3),
        "scale": torch.nn.Linear(*shape, bias=False).to(dtype)})


def loss_of(model, step, micro):
    """This rank's loss on its batch of ``step`` (``micro``: the backward pass within it)."""
    generator = torch.Generator().manual_seed(1000 * step + 100 * micro + hvd.rank())
    ids = torch.randint(0, 10, (6, 2), generator=generator)
    y = torch.randn(6, 3, generator=generator)
    h = torch.tanh(model["hidden"](model["embedding"](ids).reshape(6, 8)))
    h = h + (model["scale"].weight.sum() * 1e-3).to(h.dtype)
    return torch.nn.functional.mse_loss(model["out"](h), y)


def wrapper_arguments(config, kind, model):
    """The config's wrapper arguments for ``kind`` (stock or ours) as the optimizers take them."""
    arguments = dict(config["wrapper"], **(config.get("stock", {}) if kind == "stock" else {}))
    if "op" in arguments:
        arguments["op"] = getattr(hvd, arguments["op"])
    if isinstance(arguments.get("groups"), list):
        params = dict(model.named_parameters())
        arguments["groups"] = [[params[name] for name in members] for members in arguments["groups"]]
    if "process_set" in arguments:
        arguments["process_set"] = PROCESS_SETS[tuple(arguments["process_set"])]
    return arguments


def dense(tensor):
    return (tensor.to_dense() if tensor.is_sparse else tensor).double().reshape(-1).tolist()


def groups_of(opt):
    """The parameter names of every group, sorted: ours, the stock optimizer's (empty when it
    does not group), None for Horovod's Adasum optimizer."""
    if hasattr(opt, "_p_to_group"):
        groups = [[opt._parameter_names[p] for p in group] for group in set(opt._p_to_group.values())]
    elif hasattr(opt, "groups"):
        groups = opt.groups
    else:
        return None
    return sorted(sorted(name.split(":", 1)[1] for name in group) for group in groups)


def run(config, kind):
    """Train with one wrapper (``kind``: stock or ours); what it did, or the error it raised."""
    model = make_model(config.get("sparse_embedding", False))
    arguments = wrapper_arguments(config, kind, model)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    make = hvd.DistributedOptimizer if kind == "stock" else hs.DistributedOptimizer
    record = {"grads": [], "params": []}
    try:
        # Collective names of their own per run: a failed collective (Adasum under Gloo) stays
        # pending in Horovod under its name.
        named = [(f"{kind}{config['index']}:{name}", p) for name, p in model.named_parameters()]
        opt = make(base, named_parameters=named, compression=compression(config["compression"]), **arguments)
        record["groups"] = groups_of(opt)
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(arguments.get("backward_passes_per_step", 1)):
                loss_of(model, step, micro).backward()
            opt.step()
            record["grads"].append({name: dense(p.grad) for name, p in model.named_parameters()})
            record["params"].append({name: dense(p.detach()) for name, p in model.named_parameters()})
    except Exception as error:  # noqa: BLE001  (the test compares what each wrapper raised)
        record["error"] = f"{type(error).__name__}: {error}"
    return record


def scenario_torch(config):
    return {kind: run(config, kind) for kind in ("stock", "ours")}


def scenario_mismatch(config):
    """Rank 1's ``scale`` parameter has ``config['shape']`` / ``config['dtype']`` instead of
    16 x 8 float32; every rank records the error its wrapper raised (one group per tensor, so
    that the error names the parameter: in a bucket it names the bucket)."""
    rank1 = config["rank1"] if hvd.rank() == 1 else {}
    model = make_model(shape=tuple(rank1.get("shape", (16, 8))), dtype=getattr(torch, rank1.get("dtype", "float32")))
    try:
        opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      compression=compression(config["compression"]), groups="tensor")
        loss_of(model, 0, 0).backward()
        opt.step()
    except ValueError as error:
        return {config["name"]: str(error)}
    return {config["name"]: None}


def scenario_set_passes(config):
    """``set_backward_passes_per_step`` with each of ``config['values']``: the error it raised
    (None: accepted) and the value the optimizer keeps."""
    model = make_model()
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), compression=compression("topk"))
    record = {}
    for value in config["values"]:
        try:
            opt.set_backward_passes_per_step(value)
            record[repr(value)] = [None, opt.backward_passes_per_step]
        except (TypeError, ValueError) as error:
            record[repr(value)] = [f"{type(error).__name__}: {error}", opt.backward_passes_per_step]
    return record


def main():
    configs, out = configs_and_out()
    ranks = {tuple(c["wrapper"]["process_set"]) for c in configs if "process_set" in c.get("wrapper", {})}
    sets = [hvd.ProcessSet(list(r)) for r in sorted(ranks)]
    hvd.init(process_sets=sets)
    PROCESS_SETS.update(zip(sorted(ranks), sets))
    torch.set_num_threads(1)
    for index, config in enumerate(configs):
        config["index"] = index
        record = globals()[f"scenario_{config['scenario']}"](config)
        (out / f"{index}.rank{hvd.rank()}.json").write_text(json.dumps(record))
    hvd.barrier()  # a rank outside a process set finishes first; its shutdown would stop the others


if __name__ == "__main__":
    main()
