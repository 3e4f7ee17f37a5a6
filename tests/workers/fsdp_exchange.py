"""Worker: ``horovod_sparse.fsdp`` on FSDP2 (``fully_shard``) under ``torchrun``, 4 processes as
a 2 x 2 mesh (``replicate`` x ``shard``): each FSDP unit's reduce-scattered shard is exchanged
across the replicate group ([0, 2] and [1, 3]).

The model's gradients are given (``loss = sum(p * g)``, ``g`` from the config's seed, the step
and the rank), so every rank knows every rank's gradient. Each unit's hook is wrapped: the shard
FSDP hands over is kept, then :meth:`horovod_sparse.fsdp.State.exchange` runs, then a reference
written from the definition runs: a fresh instance of the method driven over the replicate group
through the flat exchange, fed the same shard plus the reference's own residual, scaled by
``1 / R``. Per rank and config it writes every step's local gradient shards (after the
optimizer-free backward), the inputs, the residuals, the mismatches against the reference
(empty when bitwise), the independent average of the given gradients over all ranks (for the
density-1 check) and the statistics.

Config: {"name", "method", "options", "steps", "seed", "nan_at" ([step, rank]: that rank's
gradients hold a NaN at that step, nonfinite="skip"), "resume_at" (the state saved after that step,
with ``torch.save`` and with ``torch.distributed.checkpoint``, is loaded into a new model and state
each, which must continue bitwise as the first),
"accumulate" (each step is two backward passes, the first without gradient sync), "reshard"
(``reshard_after_forward``), "mixed" (``MixedPrecisionPolicy``: bfloat16 parameters, float32
reduction), "ddp_twin" (instead: :func:`ddp_twin`, FSDP2 against the DDP hook), "exponents"
(instead: :func:`scaled`, a loss scaler's units), "ddp_kept" (instead: :func:`ddp_kept`, the DDP
hook's ``dense=``), "reads" (the state's hooks on the accelerators' paths, their host reads
and operations counted per step: :meth:`Checked.count_reads`), "dense" (``compress_replicas``' argument) with
"kept_units" (the units it keeps dense, whose reference is the dense average over the replicate
group)}.
"""
import contextlib
import importlib
import io
import json
import math
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import horovod_sparse.ddp as hsd
import horovod_sparse.fsdp as hsf
from horovod_sparse.engine.flight import ExchangeFlight
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.distributed.communicator import Communicator
from horovod_sparse.distributed.process_group import ProcessGroup
from tests.support.host_reads import DispatchedOps, reads_on_accelerator_paths
from tests.workers.cli import configs_and_out
from tests.workers.ddp_exchange import GivenGradients

#: The DDP front end's hook module (``horovod_sparse.ddp.hook`` names the hook function itself).
ddp_hook_module = importlib.import_module("horovod_sparse.ddp.hook")

#: The units: two sharded layers and the root's own parameter.
SHAPES = {"a": [[12, 10], [12]], "b": [[10, 12], [10]], "root": [[5, 10]]}


class Given(torch.nn.Module):
    """Parameters whose gradient is the tensor passed in: ``sum(p * g)``."""

    def __init__(self, shapes, generator):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s, generator=generator))
                                              for s in shapes])

    def forward(self, grads):
        return sum((p * g).sum() for p, g in zip(self.params, grads))


class Net(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.a, self.b = Given(SHAPES["a"], generator), Given(SHAPES["b"], generator)
        self.c = torch.nn.Parameter(torch.randn(*SHAPES["root"][0], generator=generator))

    def forward(self, grads):
        return self.a(grads["a"]) + self.b(grads["b"]) + (self.c * grads["root"][0]).sum()


def given(seed, step, rank):
    """Rank ``rank``'s gradients at ``step``: normal, one scale per tensor."""
    generator = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    return {unit: [torch.randn(*s, generator=generator) * 10.0 ** (i % 3 - 1) for i, s in enumerate(shapes)]
            for unit, shapes in SHAPES.items()}


#: States built before ``init_process_group`` (configs with ``state_first``), by config name:
#: the first ``build`` of such a config attaches its state, as a trainer would.
EARLY_STATES = {}


def build(config, mesh, loss_scaler=None):
    """The model sharded as the config says (``reshard``: ``reshard_after_forward``; ``mixed``:
    bfloat16 parameters, float32 reduction) and its replica exchange."""
    model = Net(config.get("seed", 0))
    options = {"reshard_after_forward": config.get("reshard", True)}
    if config.get("mixed"):
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in (model.a, model.b, model):
        fully_shard(unit, mesh=mesh["shard"], **options)
    # The 2-D mesh names the replicas, or (the variants) the replicate group does.
    replicas = ({"replicate_group": mesh["replicate"].get_group()} if {"accumulate", "reshard", "mixed"} & set(config)
                else {"mesh": mesh})
    compression = EARLY_STATES.pop(config["name"], None) or hsf.Compression.create(config["method"],
                                                                                   **config.get("options", {}))
    state = hsf.compress_replicas(model, compression, nonfinite="skip" if "nan_at" in config else "default",
                                  loss_scaler=loss_scaler, dense=config.get("dense"), **replicas)
    return model, state


def refusals(mesh, out):
    """What each rank is told for replicas that are not replicas of one shard (the shard group,
    the whole job), for a 1-D mesh, for ``dense=`` choosing part of a unit, for a misspelt
    ``dense=`` and for a configuration differing on one rank (:func:`differing_configuration`):
    the messages, per rank."""
    told = {}
    cases = {"shard_group": {"replicate_group": mesh["shard"].get_group()},
             "world": {"replicate_group": dist.group.WORLD},
             "one_dimensional": {"mesh": mesh["shard"]},
             "unit_split_by_dense": {"mesh": mesh, "dense": "a.params.0"},
             "dense_misspelt": {"mesh": mesh, "dense": "b.param.*"}}
    for case, replicas in cases.items():
        model = Net(0)
        for unit in (model.a, model.b, model):
            fully_shard(unit, mesh=mesh["shard"])
        try:
            hsf.compress_replicas(model, hsf.Compression.topk(density=0.1), **replicas)
            told[case] = "not refused"
        except ValueError as error:
            told[case] = str(error)
    told["nonfinite_differs"] = differing_configuration(mesh)
    (out / f"refusals.rank{dist.get_rank()}.json").write_text(json.dumps(told))


def differing_configuration(mesh):
    """Rank 3 (in the other replicate group than rank 0) builds its state with ``nonfinite="skip"``,
    the others with the default: the first backward pass must raise the same ``ValueError`` on
    every rank (its message, or ``"not refused"``)."""
    model = Net(0)
    for unit in (model.a, model.b, model):
        fully_shard(unit, mesh=mesh["shard"])
    nonfinite = "skip" if dist.get_rank() == 3 else "default"
    hsf.compress_replicas(model, hsf.Compression.topk(density=0.1), mesh=mesh, nonfinite=nonfinite)
    try:
        model(given(0, 0, dist.get_rank())).backward()
    except ValueError as error:
        return str(error)
    return "not refused"


class Checked:
    """The wrapped hooks of one model: the shards handed over, the results and the reference."""

    def __init__(self, config, model, state, replicate):
        self.config, self.state = config, state
        self.replicate = ProcessGroup(replicate)
        self.reference = hsf.Compression.create(config["method"], **config.get("options", {}))
        self.residual, self.method_state = {}, {}
        self.inputs, self.mismatches = {}, []
        self.step = 0
        for name, module in (("root", model), ("a", model.a), ("b", model.b)):
            module.set_all_reduce_hook(self._wrap(name))

    def _wrap(self, name):
        def hook(shard):
            given_shard = shard.clone()
            self.inputs.setdefault(name, []).append(given_shard)
            with self.counted():
                self.state.exchange(name, shard)
            self._check(name, given_shard, shard)
        return hook

    def count_reads(self):
        """Run the state's exchanges and its end of step on the accelerators' paths with their
        host reads counted (:func:`tests.support.host_reads.reads_on_accelerator_paths`; the reference
        stays on the host paths), into :attr:`reads`, one list per step, and the operations they
        dispatch (:class:`tests.support.host_reads.DispatchedOps`) into :attr:`ops`, one count per step."""
        self.reads, self.ops = [[]], [0]
        finish_step = self.state._finish_step

        def counted_finish():
            with self.counted():
                finish_step()
            self.reads.append([])
            self.ops.append(0)

        self.state._finish_step = counted_finish

    @contextlib.contextmanager
    def counted(self):
        """Where :meth:`count_reads` was called, the block's host reads into this step's list and
        its operations into this step's count."""
        if not hasattr(self, "reads"):
            yield
            return
        with reads_on_accelerator_paths(self.reads[-1]), DispatchedOps() as dispatched:
            yield
        self.ops[-1] += dispatched.count

    def _check(self, name, given_shard, result):
        """The definition: the flat method over the replicate group fed this shard + residual."""
        size, rank = self.replicate.size(), self.replicate.rank()
        before = self.residual.get(name, torch.zeros_like(given_shard))
        x = given_shard + before
        if self.config.get("nan_at", [None])[0] == self.step:
            # Abandoned everywhere: a finite shard stays in the residual (e + g), a non-finite
            # one never enters it (e); nothing is exchanged.
            self.residual[name] = x if torch.isfinite(given_shard).all() else before.clone()
            return
        if name in self.config.get("kept_units", ()):  # kept dense: the replicas' average, no residual
            expected = given_shard / size
            dist.all_reduce(expected, group=self.replicate.group)
            if not torch.equal(expected, result) or self.state._groups[name].residual is not None:
                self.mismatches.append(f"step {self.step} unit {name}: not the dense average of the replicas")
            return
        if name not in self.method_state:
            self.method_state[name] = self.reference.new_state(x.numel(), size)
        comm = Communicator(self.replicate, name, GroupStats(name, x.numel(), 0), 1.0 / size, size, rank, x.device)
        flight = ExchangeFlight(self.reference.exchange(x, comm, self.method_state[name], self.step), comm, None)
        flight.advance()
        update, residual = flight.finish()
        self.residual[name] = residual.clone()
        group = self.state._groups[name]
        if not torch.equal(update, result):
            gap = float((update - result).abs().max())
            self.mismatches.append(f"step {self.step} unit {name}: update differs by {gap}")
        if not torch.equal(residual, group.residual):
            self.mismatches.append(f"step {self.step} unit {name}: residual differs")


def local_grads(model):
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()}


def run(config, mesh, out, index):
    rank, steps = dist.get_rank(), config.get("steps", 4)
    replicate = mesh["replicate"].get_group()
    model, state = build(config, mesh)
    checked = Checked(config, model, state, replicate)
    if config.get("reads"):
        checked.count_reads()
    arrays, abandoned, caught_warnings = {}, [], []
    resume_at = config.get("resume_at")
    saved = None
    for step in range(steps):
        checked.step = step
        grads = given(config.get("seed", 0), step, rank)
        if config.get("nan_at") == [step, rank]:
            grads["a"][0][0, 0] = math.nan
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if config.get("accumulate"):  # a micro-batch without gradient sync first
                model.set_requires_gradient_sync(False)
                model(given(config.get("seed", 0) + 7, step, rank)).backward()
                model.set_requires_gradient_sync(True)
            model(grads).backward()
        caught_warnings += [str(w.message) for w in caught if "non-finite" in str(w.message) or "NaN" in str(w.message)]
        abandoned.append(bool(state.last_stats.abandoned))
        for name, group in state._groups.items():
            if abandoned[-1] and not torch.equal(group.residual, checked.residual[name]):
                checked.mismatches.append(f"step {step} unit {name}: the abandoned step's residual differs")
        for name, g in local_grads(model).items():
            arrays[f"grad_{step}_{name}"] = g.numpy()
        for p in model.parameters():
            p.grad = None
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save(state.state_dict(), buffer)
            saved = buffer.getvalue()
            dcp.save({"replicas": state}, checkpoint_id=str(out / f"dcp_{config['name']}"))
    for name, inputs in checked.inputs.items():
        for step, x in enumerate(inputs):
            arrays[f"input_{step}_{name}"] = x.numpy()
        if state._groups[name].residual is not None:  # a unit kept dense has none
            arrays[f"residual_{name}"] = state._groups[name].residual.numpy()
    average = {}
    for step in range(steps):
        everyone = [given(config.get("seed", 0), step, r) for r in range(dist.get_world_size())]
        for unit, shapes in SHAPES.items():
            for i in range(len(shapes)):
                average[f"mean_{step}_{unit}_{i}"] = torch.stack([g[unit][i] for g in everyone]).mean(0).numpy()
    arrays.update(average)
    resumed_mismatches, dcp_mismatches = [], []
    if saved is not None:
        resumed_mismatches = resume(config, mesh, lambda state: state.load_state_dict(
            torch.load(io.BytesIO(saved), weights_only=True)), resume_at, arrays)
        dcp_mismatches = resume(config, mesh, lambda state: dcp.load(
            {"replicas": state}, checkpoint_id=str(out / f"dcp_{config['name']}")), resume_at, arrays)
    stats = [{"name": g.name, "numel": g.numel, "target": g.target, "union": g.union, "dense": g.dense,
              "kept_dense": g.kept_dense} for g in state.last_stats.groups]
    record = {"mismatches": checked.mismatches, "abandoned": abandoned, "warnings": caught_warnings,
              "stats": stats, "resumed_mismatches": resumed_mismatches, "dcp_resumed_mismatches": dcp_mismatches,
              "steps": state.steps, "reads": getattr(checked, "reads", [])[:-1],
              "ops": getattr(checked, "ops", [])[:-1],
              "replicate_ranks": dist.get_process_group_ranks(replicate)}
    np.savez(out / f"{config['name']}.rank{rank}.npz", **arrays)
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps(record))


def resume(config, mesh, load, resume_at, arrays):
    """A new model and state, ``load(state)`` given the state saved after ``resume_at``, its parameters
    as the first run's (unchanged: no optimizer), continuing: its gradients must equal the first
    run's bitwise."""
    rank = dist.get_rank()
    model, state = build(config, mesh)
    load(state)
    mismatches = []
    for step in range(resume_at + 1, config.get("steps", 4)):
        model(given(config.get("seed", 0), step, rank)).backward()
        for name, g in local_grads(model).items():
            if not np.array_equal(g.numpy(), arrays[f"grad_{step}_{name}"]):
                mismatches.append(f"step {step} {name}")
        for p in model.parameters():
            p.grad = None
    return mismatches


def ddp_twin(config, out):
    """The FSDP2 front end against the DDP hook on the unsharded model, fed the same gradients:
    on a ``(world, 1)`` mesh (every rank a replica, shards of one rank: each holds the whole
    unit) with the model as one FSDP unit, and DDP with one bucket. DDP's first step is dense
    (its hook's first step is), so both take one warm-up step (``warmup_steps=1`` in the
    config) and the sparse steps follow; FSDP2 lays the unit out as the children's parameters,
    then the root's own; the DDP hook's group is DDP's bucket in the bucket's own order, and DDP
    built with ``find_unused_parameters=True`` keeps its first layout (without it, DDP rebuilds
    its buckets after its first iteration in the order backward readied the gradients), which
    holds the parameters in the reverse of their registration order, and ``GivenGradients``
    registers them reversed: it is given them in FSDP2's order reversed. Records whether the
    flat gradient FSDP2's hook exchanged and the one the DDP hook's group exchanged were equal at
    every sparse step (the layouts match), per step the parameters whose gradients on this rank
    differ, and the largest relative difference of the dense step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = Net(config["seed"])
    named = dict(model.named_parameters())
    order = [name for name in named if "." in name] + [name for name in named if "." not in name]
    params = {name: torch.nn.Parameter(named[name].detach().clone()) for name in order}
    fully_shard(model, mesh=flat["shard"])
    compression = hsf.Compression.create(config["method"], **config["options"])
    fsdp_state = hsf.compress_replicas(model, compression, mesh=flat)
    inputs = {"fsdp": [], "ddp": []}
    exchange = fsdp_state.exchange

    def fsdp_exchange(name, shard):
        inputs["fsdp"].append(shard.clone())
        exchange(name, shard)

    fsdp_state.exchange = fsdp_exchange
    state = hsd.State(compression=hsd.Compression.create(config["method"], **config["options"]))
    ddp = torch.nn.parallel.DistributedDataParallel(GivenGradients([params[name] for name in reversed(order)]),
                                                    find_unused_parameters=True)
    ddp.register_comm_hook(state, hsd.hook)
    split = ddp_hook_module.split

    def ddp_split(buffer, params, groups):
        flats = split(buffer, params, groups)
        inputs["ddp"].append(flats[0].clone())
        return flats

    ddp_hook_module.split = ddp_split
    places = {name: ("root", 0) if "." not in name else (name.split(".")[0], int(name.split(".")[-1]))
              for name in order}
    differ, dense_relative = [], 0.0
    for step in range(config["steps"]):
        grads = given(config["seed"], step, rank)
        model(grads).backward()
        ddp([grads[places[name][0]][places[name][1]] for name in reversed(order)], 1.0).backward()
        for name, sharded in model.named_parameters():
            mine, theirs = sharded.grad.to_local(), params[name].grad
            if step == 0:
                dense_relative = max(dense_relative, float((mine - theirs).abs().max() / theirs.abs().max()))
            elif not torch.equal(mine, theirs):
                differ.append(f"step {step} {name}")
            sharded.grad, params[name].grad = None, None
    ddp_hook_module.split = split
    same_input = all(torch.equal(a, b) for a, b in zip(inputs["fsdp"][1:], inputs["ddp"][1:]))
    record = {"differ": differ, "dense_relative": dense_relative, "buckets": len(state.last_stats.groups),
              "sparse": not state.last_stats.groups[0].dense,
              "same_input": same_input and len(inputs["fsdp"]) == len(inputs["ddp"]) == config["steps"]}
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps(record))


def scaled(config, out):
    """Loss-scale units: two models from one seed on the 2 x 2 mesh, one fed the given gradients
    (``nonfinite="skip"``), one fed them times the power of two ``2**e`` a ``GradScaler`` holds
    at that step (``config["exponents"]``: up, down, below 1), through ``loss_scaler=``. Records
    per step the scaled model's gradients divided by the scale against the plain model's, the
    residuals of both, and the warnings of the scaled model's backward passes; with
    ``nan_at``, both models get the NaN, and the scaled model's gradients of that step."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** config["exponents"][0])
    plain_model, plain = build({**config, "nan_at": config.get("nan_at", [])}, mesh)
    scaled_model, scaled_state = build(config, mesh, loss_scaler=scaler)
    differ, residuals_differ, warned, nan_step_grads = [], [], [], []
    for step, exponent in enumerate(config["exponents"]):
        if step:  # the scale exists from the first scale() on, at init_scale
            scaler.update(new_scale=2.0 ** exponent)
        grads = given(config["seed"], step, rank)
        if config.get("nan_at") == [step, rank]:
            grads["a"][0][0, 0] = math.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain_model(grads).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.scale(scaled_model(grads)).backward()
        warned += [str(w.message) for w in caught if "non-finite" in str(w.message)]
        for (name, p), q in zip(scaled_model.named_parameters(), plain_model.parameters()):
            mine, theirs = p.grad.to_local(), q.grad.to_local()
            if scaled_state.last_stats.abandoned:
                nan_step_grads.append(bool(torch.isnan(mine).all()))
            elif not torch.equal(mine / 2.0 ** exponent, theirs):
                differ.append(f"step {step} {name}")
            p.grad, q.grad = None, None
        for unit, group in scaled_state._groups.items():
            if not torch.equal(group.residual, plain._groups[unit].residual):
                residuals_differ.append(f"step {step} {unit}")
    record = {"differ": differ, "residuals_differ": residuals_differ, "warned": warned,
              "nan_step_grads": nan_step_grads}
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps(record))


def ddp_kept(config, out):
    """The DDP hook with ``dense="*.bias"`` on a two-layer net over ranks 0 and 1 (two ranks: a
    sum has one order whatever the buffer's layout; its one bucket mixes weights and biases),
    3 steps: per step, which parameters' aggregated gradients are the ranks' average (each rank's
    own gradient halved, summed by an allreduce); the groups (parameter numbers) and the last
    step's statistics; what a misspelt name and ranks choosing differently raise."""
    pair = dist.new_group([0, 1])
    rank = dist.get_rank()
    if rank > 1:
        return
    compression = hsd.Compression.create(config["method"], **config["options"])

    def hooked(dense):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 6))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pair)
        state = hsd.State(compression=compression, process_group=pair, dense=dense)
        state.attach(ddp)
        ddp.register_comm_hook(state, hsd.hook)
        return model, ddp, state

    def batch(step):
        generator = torch.Generator().manual_seed(100 * step + rank)
        return torch.randn(8, 12, generator=generator), torch.randn(8, 6, generator=generator)

    record = {"exact": []}
    try:
        hooked("0.bais")
    except ValueError as error:
        record["misspelt"] = str(error)
    _, ddp, _ = hooked("0.bias" if rank == 0 else "2.bias")
    try:
        torch.nn.functional.mse_loss(ddp(batch(0)[0]), batch(0)[1]).backward()
    except (RuntimeError, ValueError) as error:
        record["mismatch"] = str(error)
    model, ddp, state = hooked("*.bias")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        x, y = batch(step)
        average = [g / 2 for g in torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y),
                                                      list(model.parameters()))]
        for g in average:
            dist.all_reduce(g, group=pair)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        record["exact"].append({name: bool(torch.equal(p.grad, a))
                                for (name, p), a in zip(model.named_parameters(), average)})
        opt.step()
    record["groups"] = [[int(n) for n in g.names] for g in state.buckets.groups]
    record["stats"] = [{"dense": g.dense, "kept_dense": g.kept_dense} for g in state.last_stats.groups]
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps(record))


def main():
    configs, out = configs_and_out()
    for config in configs:
        if config.get("state_first"):
            EARLY_STATES[config["name"]] = hsf.State(hsf.Compression.create(config["method"], **config["options"]))
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for index, config in enumerate(configs):
        if config.get("ddp_twin"):
            ddp_twin(config, out)
        elif config.get("exponents"):
            scaled(config, out)
        elif config.get("ddp_kept"):
            ddp_kept(config, out)
        else:
            run(config, mesh, out, index)
    refusals(mesh, out)
    hsd.exit_job()


if __name__ == "__main__":
    main()
