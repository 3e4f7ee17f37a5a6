"""Worker: the two-tier exchange (``hierarchical=True``) of the PyTorch optimizer on an emulated
cluster of 2 hosts x 2 workers, checked on every rank against its definition: the flat method run
on the ``cross_size`` ranks owning the same slice, fed the node sums of ``g + e`` split into the
slices, its updates gathered inside the node.

The reference here is written from that definition, not from horovod_sparse.common.tiers: it
splits a group as Horovod's reduce-scatter documents (``numel // L`` each, the first ``numel % L``
one more), sums the node's gradients itself from every rank's known gradient (a node of 2 adds
two numbers, whose sum does not depend on the order), drives a fresh instance of the method over
the optimizer's cross set through the flat exchange, and gathers the slices' updates.

A config with ``"parity": true`` is run by tests/workers/torch_exchange.py's ``run`` instead (the
Horovod side of the DDP front end's comparison, in one launch with the rest).

Each config: {"name", "method", "options", "shapes", "groups", "steps", "seed", "nan_at"
([step, rank]: that rank's gradient is NaN at that step, nonfinite="skip"), "resume_at" (a
checkpoint saved after that step is loaded into a new optimizer, which must continue bitwise as
the first), "flat_steps" (then the state is loaded into a flat optimizer, hierarchical=False,
which trains that many steps more: nothing may be lost), "diverge" ([step, rank]: that rank's
exchange takes one round more at that step, tests/workers/stalled.py; the job then ends in the
error every rank records, so such a config runs alone in its launch)}. Per rank it writes
{index}.rank{r}.json: every step's update and residual compared (``mismatches``: the first few,
empty when bitwise), the node and cross bytes of every group, its selection (union, target, the
histogram controller's rounds and per-rank counts), the replicas' comparison and the totals for
the conservation check. ``burst`` ([step, parameter, factor]): that parameter's gradient is
scaled on every rank at that step.
"""
import gc
import io
import json
from pathlib import Path

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hs
from horovod_sparse.engine.flight import ExchangeFlight
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.common.horovod_tiers import level_collectives
from horovod_sparse.torch.collectives import Communicator, pad_collectives
from horovod_sparse.torch.waiting import poll_until_done
from tests.workers.cli import configs_and_out
from tests.workers import torch_exchange
from tests.workers.stalled import record_stall, take_extra_round
from tests.workers.given_gradients import make_params, step_gradients


def split(numel, parts, index):
    """Horovod's reduce-scatter split of ``numel`` elements: ``[lo, hi)`` of part ``index``."""
    sizes = [numel // parts + (1 if i < numel % parts else 0) for i in range(parts)]
    lo = sum(sizes[:index])
    return lo, lo + sizes[index]


class Reference:
    """The definition of a two-tier step, for this rank's slice of every group."""

    def __init__(self, config, opt, groups, world):
        tiers = opt.tiers
        self.node_ranks = sorted(tiers.node_set.ranks)
        self.position = self.node_ranks.index(hvd.rank())
        self.cross_set, self.node_set = tiers.cross_set, tiers.node_set
        self.method = hs.Compression.create(config["method"], **config.get("options", {}))
        self.world = world
        self.groups = groups  # name -> parameter indices
        self.residual, self.state = {}, {}

    def step(self, name, step, grads):
        """The whole group's update and this rank's whole residual at ``step``, from every rank's
        gradients ``grads[rank][index]``; None for the update of a group the step abandons."""
        members = self.groups[name]
        flat = {r: torch.cat([grads[r][i].reshape(-1) for i in members]) for r in self.node_ranks}
        numel = flat[hvd.rank()].numel()
        lo, hi = split(numel, len(self.node_ranks), self.position)
        e = self.residual.setdefault(name, torch.zeros(hi - lo))
        x = flat[hvd.rank()][lo:hi] + e
        for r in self.node_ranks:
            if r != hvd.rank():
                x = x + flat[r][lo:hi]
        state = self.state.setdefault(name, self.method.new_state(hi - lo, self.cross_set.size()))
        comm = Communicator(self.cross_set, f"ref.{name}", GroupStats(name, hi - lo, 0), 1.0 / self.world)
        flight = ExchangeFlight(self.method.exchange(x, comm, state, step), comm, _Named(name))
        flight.advance()
        update, residual = flight.finish()
        # The cross sets took their own rounds: level the collectives, as the optimizer does, so
        # that the loop's unnamed collectives keep pairing up (horovod_sparse.common.horovod_tiers).
        launched = hvd.allgather(torch.tensor([comm.stats.collectives]), name=f"ref.{name}.{step}.launched")
        level_collectives(launched.tolist(), hvd.rank(),
                          lambda missing: pad_collectives(missing, self.cross_set, f"ref.{name}.{step}"))
        self.residual[name] = residual.clone()
        whole = hvd.allgather(update, name=f"ref.{name}.gather", process_set=self.node_set)
        mine = torch.zeros(numel)
        mine[lo:hi] = residual
        return whole, mine


class _Named:
    def __init__(self, name):
        self.name = name


def gradients(config, params, step, nan_at):
    """Every rank's gradient of every parameter at ``step`` (rank -> list), NaN where asked, one
    parameter's scaled at one step on every rank with ``burst = [step, parameter, factor]``."""
    out = {}
    burst_step, burst_index, factor = config.get("burst", (-1, -1, 1.0))
    for r in range(hvd.size()):
        grads = step_gradients(params, config["seed"], step, r)
        if nan_at == [step, r]:
            grads[0] = torch.full_like(grads[0], float("nan"))
        if step == burst_step:
            grads[burst_index] = grads[burst_index] * factor
        out[r] = grads
    return out


#: Seconds the loop's own collectives may take: a rank whose unnamed collective got another name
#: than the others' (issue 56) would wait for ever; here it fails the job instead.
LOOP_SECONDS = 60


def loop_collective(handle):
    """Wait for one of the loop's own collectives (as ``hvd.synchronize``, with a deadline)."""
    poll_until_done(handle, sleep=True, timeout=LOOP_SECONDS)
    return hvd.synchronize(handle)


def train_step(opt, params, grads):
    """One step, the loop running its own unnamed Horovod collectives on the global set as training
    loops do: an allreduce of a metric between backward and step, and after the step a broadcast of
    the parameters from rank 0 (``RuntimeError`` unless the replicas agree)."""
    opt.zero_grad()
    loss = sum((p * g).sum() for p, g in zip(params, grads))
    loss.backward()
    loop_collective(hvd.allreduce_async(loss.detach(), op=hvd.Average))
    opt.synchronize()
    update = [p.grad.detach().clone() for p in params]
    with opt.skip_synchronize():
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    if not torch.equal(loop_collective(hvd.broadcast_async_(flat.clone(), root_rank=0)), flat):
        raise RuntimeError(f"rank {hvd.rank()}: after step {opt.steps} the replicas differ from rank 0's")
    return update


def build(config, params, hierarchical=True, compression=None):
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    compression = compression or hs.Compression.create(config["method"], **config.get("options", {}))
    groups = config.get("groups", "tensor")
    if isinstance(groups, list):
        groups = [[params[i] for i in members] for members in groups]
    return hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.01), named_parameters=named,
                                   compression=compression, groups=groups, hierarchical=hierarchical,
                                   nonfinite="skip" if "nan_at" in config else "raise")


def run(index, config, out: Path):
    rank, world = hvd.rank(), hvd.size()
    params = make_params(config["shapes"], config["seed"], torch.float32)
    opt = build(config, params)
    assert opt.tiers is not None, "a 2 x 2 job must run two-tier"
    groups = {name: [int(n[1:]) for n in names] for name, names in zip(opt.residuals(), opt.groups)}
    ref = Reference(config, opt, groups, world)
    nan_at = config.get("nan_at")
    mismatches, node_bytes, cross_bytes, selections, abandoned, after_resume = [], [], [], [], [], []
    checkpoint = None
    # Conservation: every finite gradient given = what the updates delivered + what the residuals hold.
    given = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    delivered = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]

    def account(step, grads, update, abandoned):
        # A rank's non-finite gradient never enters (its whole group's, that step).
        dropped = next((members for members in groups.values() if 0 in members), []) if nan_at == [step, rank] else []
        for i in range(len(params)):
            mine = torch.zeros(params[i].numel(), dtype=torch.float64) if i in dropped else grads[rank][i].double()
            given[i] += hvd.allreduce(mine.reshape(-1), op=hvd.Sum, name=f"given.{config['name']}.{step}.{i}")
            if not abandoned:
                delivered[i] += world * update[i].double().reshape(-1)

    for step in range(config["steps"]):
        grads = gradients(config, params, step, nan_at)
        update = train_step(opt, params, grads[rank])
        stats = opt.last_stats
        abandoned.append(stats.abandoned)
        node_bytes.append({g.name: g.sent["node"] for g in stats.groups if not g.dense})
        selections.append({g.name: {"union": g.union, "target": g.target, "rounds": g.extra.get("histogram_rounds"),
                                    "counts": g.extra.get("counts")} for g in stats.groups if not g.dense})
        cross_bytes.append({g.name: g.sent["values"] + g.sent["indices"] for g in stats.groups if not g.dense})
        account(step, grads, update, stats.abandoned)
        residuals = opt.residuals()
        sparse = {g.name for g in stats.groups if not g.dense}
        for name, members in groups.items():
            if name not in sparse:
                continue
            got = torch.cat([update[i].reshape(-1) for i in members])
            if stats.abandoned:
                if not torch.isnan(got).all():
                    mismatches.append(f"step {step} group {name}: abandoned, yet the update is not all NaN")
                continue
            whole, mine = ref.step(name, step, grads)
            if not torch.equal(got, whole):
                mismatches.append(f"step {step} group {name}: update differs by {(got - whole).abs().max().item()}")
            if not torch.equal(residuals[name], mine):
                mismatches.append(f"step {step} group {name}: residual differs by "
                                  f"{(residuals[name] - mine).abs().max().item()}")
        if stats.abandoned:  # the reference goes on from the residuals the optimizer kept
            ref.residual = {name: r[slice(*split(r.numel(), len(ref.node_ranks), ref.position))].clone()
                            for name, r in residuals.items()}
        if config.get("resume_at") == step:
            buffer = io.BytesIO()
            torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in params]}, buffer)
            checkpoint = buffer.getvalue()
        elif checkpoint is not None:
            after_resume.append((step, update))
    if checkpoint is not None:
        saved = torch.load(io.BytesIO(checkpoint), weights_only=True)
        params2 = make_params(config["shapes"], config["seed"], torch.float32)
        with torch.no_grad():
            for p, v in zip(params2, saved["params"]):
                p.copy_(v)
        opt2 = build(config, params2)
        opt2.load_state_dict(saved["opt"])
        for step, expected in after_resume:
            update = train_step(opt2, params2, gradients(config, params2, step, nan_at)[rank])
            if not all(torch.equal(a, b) for a, b in zip(update, expected)):
                mismatches.append(f"after resume, step {step}: the update differs from the uninterrupted run")
    if config.get("flat_steps"):  # the two-tier state loaded into a flat optimizer goes on, losing nothing
        state = opt.state_dict()
        del opt
        gc.collect()  # its gradient hooks end with it
        opt = build(config, params, hierarchical=False)
        opt.load_state_dict(state)
        for step in range(config["steps"], config["steps"] + config["flat_steps"]):
            grads = gradients(config, params, step, nan_at)
            update = train_step(opt, params, grads[rank])
            assert opt.tiers is None and opt.last_stats.bytes_sent("node") == 0
            account(step, grads, update, opt.last_stats.abandoned)
    replicas = [hvd.allgather(p.detach().reshape(1, -1), name=f"replica.{config['name']}.{i}")
                for i, p in enumerate(params)]
    residuals = opt.residuals()
    lost = 0.0
    for name, members in groups.items():
        if name not in sparse:
            continue  # a dense group keeps no residual: an abandoned step's gradient is dropped there
        held = hvd.allreduce(residuals[name].double(), op=hvd.Sum, name=f"held.{config['name']}.{name}")
        total = torch.cat([given[i] for i in members])
        accounted = torch.cat([delivered[i] for i in members]) + held
        lost = max(lost, (accounted - total).abs().max().item() / total.abs().max().item())
    (out / f"{index}.rank{rank}.json").write_text(json.dumps(
        {"mismatches": mismatches[:10], "node_bytes": node_bytes, "cross_bytes": cross_bytes, "selections": selections,
         "numels": {name: int(r.numel()) for name, r in residuals.items()},
         "identical": all(bool((r == r[0]).all()) for r in replicas), "lost": lost, "abandoned": abandoned,
         "node_size": ref.node_set.size(), "cross_size": ref.cross_set.size(),
         "stall_limit": Communicator(ref.cross_set, "probe", GroupStats("probe", 1, 1), 1.0).stall_limit}))


def run_diverging(index, config, out: Path):
    """Train until the round one rank takes alone stalls the exchange (``diverge``)."""
    params = make_params(config["shapes"], config["seed"], torch.float32)
    compression = hs.Compression.create(config["method"], **config.get("options", {}))
    at_step, on_rank = config["diverge"]
    take_extra_round(compression, at_step, hvd.rank() == on_rank)
    opt = build(config, params, compression=compression)
    record_stall(out, str(index), hvd.rank(), hvd.size(), hvd.shutdown,
                 lambda step: train_step(opt, params, step_gradients(params, config["seed"], step, hvd.rank())),
                 config["steps"], groups=list(opt.residuals()))


def main():
    configs, out = configs_and_out()
    hvd.init(process_sets="dynamic")
    torch.set_num_threads(1)
    for index, config in enumerate(configs):
        if "diverge" in config:
            run_diverging(index, config, out)
        elif config.get("parity"):  # the DDP comparison's run, in tests/workers/torch_exchange.py's layout
            torch_exchange.run(config, out)
        else:
            run(index, config, out)


if __name__ == "__main__":
    main()
