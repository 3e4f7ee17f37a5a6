"""Worker (``torchrun``, or ``horovodrun``: Horovod's outer steps, ``horovod_sparse.torch.OuterSteps``):
outer steps (``horovod_sparse.outer``) on known per-rank gradients, with what every round did
written out for ``tests/outer``'s written-out references.

The model's gradient is what the worker passes (``loss = sum(p * g)``, with
``tests.workers.given_gradients``); each rank starts from its own parameters (seeded by rank), so
taking rank 0's at construction is seen. The inner optimizer is SGD (lr 0.1, momentum 0.9 unless
``inner_momentum`` says) recording the parameters after each of its steps, so the reference knows
each rank's parameters at the end of every round.

Each config: {"name", "method", "options", "every", "steps" (inner steps), "seed", "shapes",
"outer" ("diloco": the default outer optimizer; "sgd1": SGD lr 1, no momentum, whose step is an
exact subtraction), "resume_at", "resume_via" ("torch" or "dcp"), "nan_at", "nonfinite",
"every_of_rank", "namespace", "sync_at_end", "overlap", "fragments", "offload", "flush_at_end",
"hierarchical", "node_size", "hierarchical_of_rank", "node_size_of_rank", "local_world_size_of_rank",
"subgroup", "ddp", "other_layouts", "keep", "loop_collective", "burst", "fsdp", "fsdp_group"}:

- ``resume_at``: after that many inner steps (mid-round) this rank's ``state_dict()`` goes through
  ``torch.save``/``torch.load(weights_only=True)``, or ``torch.distributed.checkpoint``'s save and
  load of ``{"outer": outer}`` (a ``Stateful``) in a shared folder, into a fresh model, inner optimizer and
  ``OuterSteps`` (built from other parameters), and training goes on;
- ``nan_at``: ``[step, rank]``: that rank's gradient is NaN at that inner step;
- ``every_of_rank``: ``{rank: every}`` replacing ``every`` on that rank (construction must raise
  the same error everywhere);
- ``namespace``: ``"outer"``: the method built by ``horovod_sparse.outer.Compression`` whatever
  the launcher (under ``horovodrun``, construction must refuse it everywhere);
- ``sync_at_end``: an extra :meth:`OuterSteps.sync` after the last inner step;
- ``overlap``, ``fragments``, ``offload``: :class:`OuterSteps`'s options of those names;
- ``flush_at_end``: :meth:`OuterSteps.flush` at the very end;
- ``hierarchical``, ``node_size``: the two tiers (under ``horovodrun`` the hosts are the nodes:
  ``node_size`` is dropped unless ``keep`` lists it); ``hierarchical_of_rank``,
  ``node_size_of_rank`` and ``local_world_size_of_rank`` (``{rank: value}``) replacing
  ``hierarchical``, ``node_size`` or ``LOCAL_WORLD_SIZE`` on that rank; ``subgroup``:
  ``process_group`` a new group of every rank (not the default);
- ``ddp``: the model wrapped in DDP over the node's group (``outer.node_group``) after
  construction, its forward and backward through DDP (the inner steps' dense exchange); under
  ``horovodrun`` the inner optimizer is Horovod's over ``node_process_set()`` instead;
- ``loop_collective``: an unnamed Horovod broadcast after every inner step (``horovodrun``);
- ``burst``: ``[step, parameter, factor]``: on every rank the first half of that parameter's
  gradient scaled by ``factor`` at that inner step (in two tiers the node sums' slice 0 only);
- ``other_layouts``: before training, this rank's state loaded into outer steps of the other
  layout (flat for two tiers) and theirs into these: the refusals are recorded as errors at step -2;
- ``fsdp``: 4 ranks as a 2 x 2 mesh (``replicate`` x ``shard``), the model ``fully_shard``-ed over
  ``mesh["shard"]`` (each replica's parameters seeded by the replica, not the rank), outer steps
  across ``mesh["replicate"]``; everything recorded is this rank's local shard, and ``nan_at``'s NaN
  is the first element of the first parameter only (it reaches the rank holding that shard);
  ``fsdp_group``: ``"world"`` (every rank as the process group), ``"shard"`` (the shard group) or
  ``"hsdp"`` (the model sharded over the 2-D mesh) instead, refused at construction.

Records per round boundary ``j`` (an inner step where a fragment's round ends, by the object's
``offsets``): ``theta_{j}_{i}`` (this rank's parameter i after the inner step, before the
boundary), ``agg_{j}_{i}`` (the averaged pseudo-gradient, sparse groups, without ``overlap``),
``param_{j}_{i}`` (after the boundary), ``residual_{j}_{i}``; ``start_{i}`` (the parameters
after construction); ``final_{i}`` and ``final_residual_{i}`` after the flush; the JSON record:
each boundary's inner step, fragment, exchanges closed and last statistics, the object's
``fragments`` and ``offsets``, its tiers' ``[node_size, cross_size]`` (``tiers``, None: flat),
whether its outer optimizer steps tensors in the anchor's memory (``steps_the_anchor``), whether
its state's tensors are all DTensors (``outer_state_sharded``), errors.
"""
import io
import json
import os
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import horovod_sparse.outer as hso
from tests.workers.cli import configs_and_out, init_torch_worker, torchrun_main
from tests.workers.given_gradients import make_params, step_gradients


class Given(torch.nn.Module):
    """``loss = sum(p * g)``: the gradient of every parameter is the ``g`` passed."""

    def __init__(self, params):
        super().__init__()
        self.params = torch.nn.ParameterList(params)

    def forward(self, grads):
        return sum((p * g).sum() for p, g in zip(self.params, grads))


class RecordingSGD(torch.optim.SGD):
    """SGD keeping the parameters after its last step (:attr:`last`)."""

    def step(self, closure=None):
        result = super().step(closure)
        self.last = [p.detach().clone() for group in self.param_groups for p in group["params"]]
        return result


#: Whether this worker runs under ``horovodrun`` (Horovod's outer steps) rather than ``torchrun``.
HOROVOD = "HOROVOD_RANK" in os.environ


def front_end():
    """The outer steps' module (its ``OuterSteps`` and ``Compression``) of this worker's launcher."""
    if HOROVOD:
        import horovod_sparse.torch as hst
        return hst
    return hso


def job_rank():
    if HOROVOD:
        import horovod.torch as hvd
        return hvd.rank()
    return dist.get_rank()


def shard_of(t):
    """This rank's shard of ``t`` (a DTensor: FSDP2's), or ``t``, detached."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


#: The 2 x 2 mesh of the ``fsdp`` configs, made by the first.
MESHES = []


def sharded(config, model):
    """``model`` sharded as an ``fsdp`` config says, and the process group its outer steps take."""
    if not MESHES:
        MESHES.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    mesh, how = MESHES[0], config.get("fsdp_group")
    fully_shard(model, mesh=mesh if how == "hsdp" else mesh["shard"])
    return {"world": None, "shard": mesh["shard"].get_group()}.get(how, mesh["replicate"].get_group())


def build(config, rank, seed):
    if config.get("fsdp"):  # each replica's ranks start alike (seeded by the replica rank // 2)
        seed -= rank % 2
    params = make_params(config["shapes"], seed, torch.float32)
    model = Given(params)
    group = sharded(config, model) if config.get("fsdp") else None
    inner = RecordingSGD(model.parameters(), lr=0.1, momentum=config.get("inner_momentum", 0.9))
    offload = config.get("offload", False)
    outer_opt = None
    if config.get("outer") == "sgd1":  # offloaded: a function of the anchor's tensors
        outer_opt = (lambda params: torch.optim.SGD(params, lr=1.0)) if offload else torch.optim.SGD(
            model.parameters(), lr=1.0)
    every = config.get("every_of_rank", {}).get(str(rank), config["every"])
    node_size = config.get("node_size_of_rank", {}).get(str(rank), config.get("node_size"))
    hierarchical = config.get("hierarchical_of_rank", {}).get(str(rank), config.get("hierarchical", False))
    tiers = {"hierarchical": hierarchical, "node_size": node_size} if config.get("hierarchical") else {}
    if HOROVOD and config.get("hierarchical") and "node_size" not in config.get("keep", []):
        tiers.pop("node_size")  # Horovod's nodes are its hosts
    if HOROVOD and config.get("ddp"):  # the inner steps' dense exchange inside the host
        import horovod.torch as hvd
        import horovod_sparse.torch as hst
        inner = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                         process_set=hst.node_process_set())
    if config.get("subgroup"):
        tiers["process_group"] = dist.new_group(list(range(dist.get_world_size())))
    if config.get("fsdp"):
        tiers["process_group"] = group
    hs = hso if config.get("namespace") == "outer" else front_end()
    compression = (hs.Compression.none if config["method"] == "none"
                   else hs.Compression.create(config["method"], **config.get("options", {})))
    outer = front_end().OuterSteps(model, inner, compression, every=every, outer_optimizer=outer_opt,
                           nonfinite=config.get("nonfinite", "default"), overlap=config.get("overlap", False),
                           fragments=config.get("fragments", 1), offload=offload, **tiers)
    return model, inner, outer


def forward(config, model, outer):
    """What the inner steps run forward and backward through: the model, or with ``ddp`` the
    model in DDP over the node's group."""
    if not config.get("ddp") or HOROVOD:  # under Horovod its optimizer exchanges in the node (build)
        return model
    return torch.nn.parallel.DistributedDataParallel(model, process_group=outer.node_group)


def other_layouts(config, outer, rank, errors):
    """This rank's state loaded into outer steps of the other layout, and theirs into ``outer``:
    each refusal recorded as ``[-2, message]``."""
    _, _, other = build({**config, "hierarchical": not config.get("hierarchical")}, rank, config["seed"] + rank)
    for source, target in ((outer, other), (other, outer)):
        try:
            target.load_state_dict(source.state_dict())
        except ValueError as error:
            errors.append([-2, str(error)])


def resumed(config, outer, rank, out: Path):
    """A fresh model, inner optimizer and OuterSteps continuing from ``outer``'s saved state."""
    if config.get("resume_via") == "dcp":
        folder = out / f"{config['name']}.dcp"
        dcp.save({"outer": outer}, checkpoint_id=str(folder))
        model, inner, fresh = build(config, rank, config["seed"] + 100 + rank)
        dcp.load({"outer": fresh}, checkpoint_id=str(folder))
        return model, inner, fresh
    buffer = io.BytesIO()
    torch.save(outer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model, inner, fresh = build(config, rank, config["seed"] + 100 + rank)
    fresh.load_state_dict(saved)
    return model, inner, fresh


def run(config, out: Path):
    rank = job_rank()
    arrays, rounds, errors = {}, [], []
    local = config.get("local_world_size_of_rank", {}).get(str(rank))
    try:
        with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": str(local)} if local else {}):
            model, inner, outer = build(config, rank, config["seed"] + rank)
    except ValueError as error:
        errors.append([-1, str(error)])
        write(out, config, rank, arrays, rounds, errors, {})
        return
    if config.get("other_layouts"):
        other_layouts(config, outer, rank, errors)
    net = forward(config, model, outer)
    arrays.update({f"start_{i}": shard_of(p).double().numpy().copy() for i, p in enumerate(model.params)})

    def record_round(step, theta, fragment):
        j = len(rounds)
        for i, (group, p) in enumerate(zip(outer.groups, model.params)):
            arrays[f"theta_{j}_{i}"] = shard_of(theta[i]).double().numpy()
            arrays[f"param_{j}_{i}"] = shard_of(p).double().numpy().copy()
            if group.output is not None and not outer.overlap:
                arrays[f"agg_{j}_{i}"] = group.output.double().numpy().copy()
            if group.residual is not None:
                arrays[f"residual_{j}_{i}"] = group.residual.double().numpy().copy()
        rounds.append({"step": step, "fragment": fragment, "steps": outer.steps,
                       "stats": None if outer.last_stats is None else outer.last_stats.as_dict()})

    for step in range(config["steps"]):
        if step == config.get("resume_at"):
            model, inner, outer = resumed(config, outer, rank, out)
            net = forward(config, model, outer)
        grads = step_gradients(list(model.params), config["seed"], step, rank)
        if config.get("nan_at") == [step, rank] and config.get("fsdp"):
            grads[0].view(-1)[0] = float("nan")
        elif config.get("nan_at") == [step, rank]:
            grads[0] = grads[0] * float("nan")
        if config.get("burst", [None])[0] == step:  # [step, parameter, factor]: its first half scaled
            _, index, factor = config["burst"]
            grads[index].view(-1)[:grads[index].numel() // 2] *= factor
        net(grads).backward()
        try:
            outer.step()
        except FloatingPointError as error:
            errors.append([step, str(error)])
        outer.zero_grad()
        if config.get("loop_collective"):
            loop_collective()
        for fragment in [f for f, offset in enumerate(outer.offsets) if offset == outer.position]:
            record_round(step, inner.last, fragment)
    if config.get("sync_at_end"):
        theta = [p.detach().clone() for p in model.params]
        outer.sync()
        record_round(config["steps"], theta, 0)
    if config.get("flush_at_end"):
        outer.flush()
        for i, (group, p) in enumerate(zip(outer.groups, model.params)):
            arrays[f"final_{i}"] = shard_of(p).double().numpy().copy()
            if group.residual is not None:
                arrays[f"final_residual_{i}"] = group.residual.double().numpy().copy()
    anchors = {f.untyped_storage().data_ptr() for f in outer.anchor.flat}
    stepped = [p for group in outer.outer_optimizer.param_groups for p in group["params"]]
    write(out, config, rank, arrays, rounds, errors, {
        "fragments": outer.fragments, "offsets": outer.offsets,
        "tiers": None if outer.tiers is None else [outer.tiers.node_size, outer.tiers.cross_size],
        "steps_the_anchor": all(shard_of(p).untyped_storage().data_ptr() in anchors for p in stepped),
        "outer_state_sharded": all(isinstance(v, DTensor) for state in outer.outer_optimizer.state.values()
                                   for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)})


def loop_collective():
    """The training loop's own unnamed Horovod collective after an inner step (a broadcast of a
    scratch tensor: Horovod names it by its handle's number, so every rank must have launched as
    many collectives before it)."""
    import horovod.torch as hvd
    hvd.broadcast_(torch.zeros(1), 0)


def write(out, config, rank, arrays, rounds, errors, layout):
    np.savez(out / f"{config['name']}.rank{rank}.npz", **arrays)
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps(
        {"rounds": rounds, "errors": errors, "horovod_imported": "horovod" in sys.modules, **layout}))


def horovod_main():
    """A ``horovodrun`` worker's main: every config in turn, Horovod's tensor fusion off."""
    configs, out = configs_and_out()
    init_torch_worker(reproducible_sums=True)
    for config in configs:
        run(config, out)


if __name__ == "__main__":
    horovod_main() if HOROVOD else torchrun_main(run)
