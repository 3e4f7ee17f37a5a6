"""Worker: the wrapper where Horovod users rely on Horovod's own behaviour.

Scenarios (one JSON record per rank each, the test asserts on them):

* ``checkpoint``: Horovod's checkpoint idiom (also after a global swap of
  ``hvd.DistributedOptimizer`` for ours, ``swap``). N steps; rank 0 alone saves; fresh model and
  optimizer on every rank (different initial values per rank); rank 0 alone loads; then
  ``hvd.broadcast_parameters`` and ``hvd.broadcast_optimizer_state`` (or
  ``hs.broadcast_optimizer_state``); M more steps. The expected continuation is the original
  run's, with every rank but 0 emptied of its per-rank state at step N (residuals, DGC's
  velocity): what a rank-0 checkpoint cannot hold.
* ``embedding``: ``nn.Embedding(sparse=True)`` beside dense layers, against the stock optimizer.
* ``dynamic_requires_grad``: Horovod's GAN pattern (two optimizers, ``requires_grad`` toggled).
* ``optimizers``: every ``torch.optim`` optimizer, state broadcast after rank 0 alone loaded it,
  options given per rank (as numbers and as tensors).
* ``hooks``: ``backward_passes_per_step``, ``synchronize()`` + clipping + ``skip_synchronize()``,
  no names, ``_parameter_names``, process sets, against the stock optimizer.
* ``own_collectives``: a model making Horovod collectives of its own in both passes (a
  synchronised batch norm and an allreduce in its forward, tests/workers/own_collectives.py)
  trained with ``Compression.none``, and with the method at density 1 and 0.1.
* ``kept_dense``: ``dense="*.bias"`` beside a sparsifier: per step, which parameters' aggregated
  gradients are the ranks' average (Horovod's allreduce of their own gradients), the statistics'
  groups, and the errors of a misspelt name and of ranks choosing differently.
"""
import inspect
import io
import json

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hs
from horovod_sparse.common.mergecomp import MergeCompOptions
from tests.workers import own_collectives
from tests.workers.cli import configs_and_out


def compression(config):
    if config["method"] == "none":
        return hvd.Compression.none
    return hs.Compression.create(config["method"], **config.get("options", {}))


def flat_values(*params):
    """The values of ``params``, flattened into one list."""
    return torch.cat([p.detach().reshape(-1) for p in params]).tolist()


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.Tanh(), torch.nn.Linear(64, 6))


def batch(step, rank):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 12, generator=generator), torch.randn(16, 6, generator=generator)


def wrap(model, config, optimizer_class=torch.optim.SGD, stock=False, **options):
    """``model``'s optimizer wrapped by ours, or by the stock one (``stock``)."""
    options = options or {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
    base = optimizer_class(model.parameters(), **options)
    if stock:
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    groups = MergeCompOptions(warmup_steps=0, timed_steps=1) if config.get("groups") == "mergecomp" \
        else config.get("groups")
    make = hvd.DistributedOptimizer if config.get("swap") else hs.DistributedOptimizer
    return make(base, named_parameters=model.named_parameters(), compression=compression(config), groups=groups)


def train(model, opt, steps, first):
    """``steps`` steps from step ``first``; parameters after each step, as float64 lists."""
    history = []
    for step in range(first, first + steps):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().tolist())
    return history


def empty_per_rank_state(opt):
    """What rank 0's checkpoint cannot hold for another rank: its residuals and per-rank state."""
    for group in opt._groups:
        if group.residual is not None:
            group.residual.zero_()
    if getattr(opt._compression, "per_rank_state", False):
        opt._model.states.clear()


def scenario_checkpoint(config):
    """With ``config["swap"]`` the codebase was migrated by a global swap at start-up
    (``hvd.DistributedOptimizer = hs.DistributedOptimizer``), and the wrapper is built through
    ``hvd.DistributedOptimizer``."""
    stock = hvd.DistributedOptimizer
    if config.get("swap"):
        hvd.DistributedOptimizer = hs.DistributedOptimizer
    try:
        return checkpoint_idiom(config)
    finally:
        hvd.DistributedOptimizer = stock


def checkpoint_idiom(config):
    steps, more = config["steps"], config["more"]
    model = make_model(0)
    opt = wrap(model, config)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train(model, opt, steps, 0)
    if opt.mergecomp is not None:
        while opt.mergecomp.result is None:  # a grouping chosen by the search goes into the checkpoint
            train(model, opt, 1, opt.steps)
    saved_at = opt.steps
    blob = None
    if hvd.rank() == 0:
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
        blob = buffer.getvalue()

    fresh = make_model(1 + hvd.rank())  # every rank starts elsewhere: the broadcasts must matter
    fresh_opt = wrap(fresh, config)
    if hvd.rank() == 0:
        checkpoint = torch.load(io.BytesIO(blob), weights_only=True)  # torch.load's default since 2.6
        fresh.load_state_dict(checkpoint["model"])
        fresh_opt.load_state_dict(checkpoint["optimizer"])
    hvd.broadcast_parameters(fresh.state_dict(), root_rank=0)
    if config["broadcast"] == "hvd":
        hvd.broadcast_optimizer_state(fresh_opt, root_rank=0)
    else:
        hs.broadcast_optimizer_state(fresh_opt, root_rank=0)
    resumed = train(fresh, fresh_opt, more, saved_at)
    record = {"resumed": resumed, "steps": fresh_opt.steps, "groups": fresh_opt.groups,
              "residual_norms": [float(r.double().norm()) for r in fresh_opt.residuals().values()]}

    if hvd.rank() != 0:
        empty_per_rank_state(opt)
    record["expected"] = train(model, opt, more, saved_at)
    record["expected_groups"] = opt.groups
    return record


def scenario_embedding(config):
    """Sparse gradients (``nn.Embedding(sparse=True)`` with SparseAdam, beside a dense layer with
    SGD), by the stock optimizer and by ours: each step's local and aggregated embedding
    gradient, the gradient's layout, and the parameters."""
    results = {}
    for sparse_as_dense in (False, True):
        runs = {}
        for kind in ("stock", "ours"):
            torch.manual_seed(3)
            embedding = torch.nn.Embedding(11, 3, sparse=True)
            dense = torch.nn.Linear(3, 2)
            options = {"sparse_as_dense": sparse_as_dense}
            if kind == "stock":
                make = hvd.DistributedOptimizer
            else:
                make, options["compression"] = hs.DistributedOptimizer, compression(config)
            sparse_opt = make(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
                              named_parameters=[("embedding.weight", embedding.weight)], **options)
            dense_opt = make(torch.optim.SGD(dense.parameters(), lr=0.1),
                             named_parameters=[(f"dense.{n}", p) for n, p in dense.named_parameters()], **options)
            record = {"local": [], "aggregated": [], "layout_sparse": []}
            for step in range(3):
                rows = (torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if hvd.rank() == 0
                        else torch.tensor([[1, 3, 4], [4, 7, 9]]))
                sparse_opt.zero_grad()
                dense_opt.zero_grad()
                loss = dense(embedding(rows + step % 2)).sum()
                (local,) = torch.autograd.grad(loss, [embedding.weight], retain_graph=True)
                loss.backward()
                sparse_opt.synchronize()
                record["local"].append(local.to_dense().tolist())
                record["aggregated"].append(embedding.weight.grad.to_dense().tolist())
                record["layout_sparse"].append(embedding.weight.grad.is_sparse)
                with sparse_opt.skip_synchronize():
                    sparse_opt.step()
                dense_opt.step()
            record["params"] = flat_values(*embedding.parameters(), *dense.parameters())
            runs[kind] = record
        results[str(sparse_as_dense)] = runs
    return results


def scenario_dynamic_requires_grad(config):
    """Horovod's GAN pattern: after backward() a trained parameter's .grad holds its gradient and
    a frozen one's is None; both optimizers step in turn; compared with the stock optimizer."""
    runs = {}
    for kind in ("stock", "ours"):
        torch.manual_seed(4)
        gen, disc = torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)
        inp = torch.rand([1, 1, 8, 8], generator=torch.Generator().manual_seed(hvd.rank()))
        opts = []
        for module in (gen, disc):
            base = torch.optim.SGD(module.parameters(), lr=0.01)
            opts.append(hvd.DistributedOptimizer(base, named_parameters=module.named_parameters())
                        if kind == "stock" else
                        hs.DistributedOptimizer(base, named_parameters=module.named_parameters(),
                                                compression=compression(config)))
        violations = []
        for it in range(6):
            for train_gen in (True, False):
                for p in gen.parameters():
                    p.requires_grad_(train_gen)
                for p in disc.parameters():
                    p.requires_grad_(not train_gen)
                for opt in opts:
                    opt.zero_grad()
                loss = disc(gen(inp)).sum()
                loss.backward()
                for module, expect in ((gen, train_gen), (disc, not train_gen)):
                    for p in module.parameters():
                        if expect != (p.grad is not None and bool(p.grad.abs().max() > 0)):
                            violations.append([it, train_gen])
                opts[0 if train_gen else 1].step()
        runs[kind] = {"violations": violations,
                      "params": flat_values(*gen.parameters(), *disc.parameters())}
    return runs


def optimizer_classes():
    """Every torch.optim optimizer Horovod's own tests loop over (not LBFGS, SparseAdam, Muon)."""
    excluded = {"LBFGS", "SparseAdam", "Muon"}
    return sorted((c for c in torch.optim.Optimizer.__subclasses__()
                   if c.__module__.startswith("torch.optim") and c.__name__ not in excluded),
                  key=lambda c: c.__name__)


def accepted(cls, options):
    return {k: v for k, v in options.items() if k in inspect.signature(cls.__init__).parameters}


def state_values(opt):
    state = opt.state_dict()["state"]
    values = []
    for key in sorted(state):
        for name, value in sorted(state[key].items()):
            values.append([name, value.double().reshape(-1).tolist() if torch.is_tensor(value) else value])
    return values


def scenario_optimizers(config):
    """For every optimizer, with this rank's options (rank 0's differ; lr also as a tensor): one
    step; rank 0 alone saves; a fresh model and optimizer on every rank; rank 0 alone loads;
    hvd.broadcast_parameters and hvd.broadcast_optimizer_state; one more step. Records the state
    and options right after the broadcast and the parameters after the next step, by the stock
    optimizer and by ours."""
    rank0 = dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999),
                 etas=(0.8, 2.4), step_sizes=(1e-5, 100))
    others = dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9),
                  etas=(0.25, 1.75), step_sizes=(1e-7, 5))
    records = {}
    for cls in optimizer_classes():
        for as_tensor in (False, True):
            for kind in ("stock", "ours"):
                options = accepted(cls, rank0 if hvd.rank() == 0 else others)
                if as_tensor:
                    options["lr"] = torch.tensor(options["lr"])
                model = make_model(0)
                opt = wrap(model, config, cls, stock=kind == "stock", **options)
                train(model, opt, 1, 0)
                blob = None
                if hvd.rank() == 0:
                    buffer = io.BytesIO()
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
                    blob = buffer.getvalue()
                del opt
                model = make_model(1 + hvd.rank())
                fresh = wrap(model, config, cls, stock=kind == "stock", **options)
                if hvd.rank() == 0:
                    checkpoint = torch.load(io.BytesIO(blob), weights_only=True)
                    model.load_state_dict(checkpoint["model"])
                    fresh.load_state_dict(checkpoint["optimizer"])
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                hvd.broadcast_optimizer_state(fresh, root_rank=0)
                group = fresh.param_groups[0]
                records[f"{cls.__name__}/{'tensor' if as_tensor else 'number'}/{kind}"] = {
                    "state": state_values(fresh),
                    "options": {k: float(group[k]) if torch.is_tensor(group[k]) else group[k]
                                for k in accepted(cls, rank0)},
                    "option_types": {k: type(group[k]).__name__ for k in accepted(cls, rank0)},
                    "after": train(model, fresh, 1, 1)[-1]}
    return records


def scenario_hooks(config):
    """Horovod's optimizer behaviours, ours against stock on the same inputs."""
    runs = {}
    for kind in ("stock", "ours"):
        record = {}
        for name, passes in (("passes1", 1), ("passes2", 2)):
            model = make_model(0)
            base = torch.optim.SGD(model.parameters(), lr=0.05)
            opt = (hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                            backward_passes_per_step=passes) if kind == "stock" else
                   hs.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           backward_passes_per_step=passes, compression=compression(config)))
            history = []
            for step in range(3):
                opt.zero_grad()
                for micro in range(passes):
                    x, y = batch(10 * step + micro, hvd.rank())
                    torch.nn.functional.mse_loss(model(x), y).backward()
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                with opt.skip_synchronize():
                    opt.step()
                history.append(flat_values(*model.parameters()))
            record[name] = history
            record[f"{name}_names"] = sorted(opt._parameter_names.values())
        model = make_model(0)
        base = torch.optim.SGD(model.parameters(), lr=0.05)
        opt = (hvd.DistributedOptimizer(base) if kind == "stock"
               else hs.DistributedOptimizer(base, compression=compression(config)))
        record["noname"] = train(model, opt, 2, 0)
        record["noname_names"] = sorted(opt._parameter_names.values())
        runs[kind] = record
    return runs


def scenario_own_collectives(config):
    """Three steps beside the model's own collectives: parameters after each step, per run
    (``dense``, ``full``: density 1, ``sparse``), and whether every rank ended with the same."""
    collectives = (lambda t: hvd.allgather(t.unsqueeze(0)), lambda t: hvd.allreduce(t, op=hvd.Sum),
                   lambda t: hvd.allreduce(t, op=hvd.Average))
    runs = {}
    for run, method, density in (("dense", "none", None), ("full", config["method"], 1.0),
                                 ("sparse", config["method"], 0.1)):
        model = own_collectives.make_model(0, collectives)
        opt = wrap(model, {"method": method, "options": {"density": density, "min_numel": 0}}, lr=0.05)
        history = own_collectives.train(model, model, opt, 3, hvd.rank())
        mine = torch.tensor(history[-1])
        runs[run] = history
        runs[f"{run}_identical"] = bool((hvd.allgather(mine.unsqueeze(0), name=f"own.{run}") == mine).all())
    return runs


def scenario_kept_dense(config):
    """Three steps keeping the biases dense (see the module docstring)."""
    model = make_model(0)

    def optimizer(dense):
        return hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), compression=compression(config),
                                       groups=config.get("groups"), dense=dense)

    record = {"exact": []}
    for name, dense in (("typo", "0.bais"), ("mismatch", "0.bias" if hvd.rank() == 0 else "2.bias")):
        try:
            optimizer(dense)
        except ValueError as error:
            record[name] = str(error)
    opt = optimizer("*.bias")
    for step in range(3):
        x, y = batch(step, hvd.rank())
        own = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), list(model.parameters()))
        average = [hvd.allreduce(g, op=hvd.Average, name=f"kept.{step}.{i}") for i, g in enumerate(own)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        record["exact"].append({name: bool(torch.equal(p.grad, a))
                                for (name, p), a in zip(model.named_parameters(), average)})
        with opt.skip_synchronize():
            opt.step()
    record["groups"] = opt.groups
    record["stats"] = [{"dense": g.dense, "kept_dense": g.kept_dense} for g in opt.last_stats.groups]
    return record


def main():
    hvd.init()
    torch.set_num_threads(1)
    configs, out = configs_and_out()
    for index, config in enumerate(configs):
        record = globals()[f"scenario_{config['scenario']}"](config)
        (out / f"{index}.rank{hvd.rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
