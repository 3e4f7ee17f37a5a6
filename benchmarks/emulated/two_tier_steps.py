"""Two tiers against flat on the job of issues 46 and 56, side by side in one job: a regression of
an MLP onto a fixed random teacher (every rank its own batches, plain SGD), each method flat and
two-tier, on 2 hosts of 2 workers emulated on this machine.

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python -m benchmarks.emulated.two_tier_steps \\
        [--methods micro exdyna] [--steps 300] [--rounds 3] [--between broadcast]

With ``--between broadcast`` the loop runs its own unnamed Horovod collectives on the global set
after every step, as training loops do (issue 56's): it broadcasts a copy of the flat parameters
from rank 0 (``hvd.broadcast_``), checks that the replicas agree, and averages the loss
(``hvd.allreduce``). Issue 56's model is ``--inputs 64 --hidden 1024 1024 --outputs 16
--activation tanh --no-bias --lr 1``.

Per method, ``--rounds`` rounds of ``--steps`` steps each way, the order of flat and two-tier
alternating between rounds so that drifts of a shared machine fall on both alike; every round
starts from the same weights. Rank 0 prints per method and way the median seconds per step over
the rounds, two-tier over flat, the histogram rounds the controllers took (MiCRO, ExDyna) and
whether the replicas ended identical; ``--results`` also writes them as JSON. The model has
``--hidden`` units in each of its two hidden layers (1024 and 768: 1.1 M parameters), ``--inputs``
inputs and ``--outputs`` outputs.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

BATCH = 32


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["micro", "exdyna"], help="methods, each flat and two-tier")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=300, help="steps per round and way")
    p.add_argument("--rounds", type=int, default=3, help="rounds per method, the order alternating")
    p.add_argument("--hidden", type=int, nargs=2, default=[1024, 768], help="units of the two hidden layers")
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--outputs", type=int, default=64)
    p.add_argument("--activation", choices=["relu", "tanh"], default="relu")
    p.add_argument("--no-bias", dest="bias", action="store_false", help="layers without biases")
    p.add_argument("--lr", type=float, default=0.01, help="SGD's learning rate")
    p.add_argument("--between", choices=["nothing", "broadcast"], default="nothing",
                   help="what the loop runs between steps (the module docstring)")
    p.add_argument("--results", type=Path, help="also write the figures to this JSON file")
    return p


def mlp(args: argparse.Namespace) -> Any:
    import torch

    (first, second), bias = args.hidden, args.bias
    activation = torch.nn.ReLU if args.activation == "relu" else torch.nn.Tanh
    return torch.nn.Sequential(torch.nn.Linear(args.inputs, first, bias=bias), activation(),
                               torch.nn.Linear(first, second, bias=bias), activation(),
                               torch.nn.Linear(second, args.outputs, bias=bias))


def between_steps(model: Any, loss: Any) -> bool:
    """What the loop runs after a step with ``--between broadcast``: the flat parameters broadcast
    from rank 0 and the loss averaged, by Horovod collectives without names. Whether this rank's
    parameters equal rank 0's."""
    import horovod.torch as hvd
    import torch

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copy = flat.clone()
    hvd.broadcast_(copy, root_rank=0)
    hvd.allreduce(loss.detach())
    return bool(torch.equal(copy, flat))


def train(method: str, hierarchical: bool, args: argparse.Namespace, start: Dict[str, Any],
          teacher: Any) -> Dict[str, Any]:
    """``args.steps`` steps of ``method`` from the weights ``start``: seconds per step, the
    histogram rounds taken (their counts) and whether the replicas ended identical."""
    import horovod.torch as hvd
    import torch

    import horovod_sparse.torch as hs

    model = mlp(args)
    model.load_state_dict(start)
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                  named_parameters=model.named_parameters(), hierarchical=hierarchical,
                                  compression=hs.Compression.create(method, density=args.density))
    assert (opt.tiers is not None) == hierarchical, "two-tier needs several hosts of several workers"
    data = torch.Generator().manual_seed(1000 + hvd.rank())
    rounds: Counter = Counter()
    agreed = True
    began = time.perf_counter()
    for _ in range(args.steps):
        x = torch.randn(BATCH, args.inputs, generator=data)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        for group in opt.last_stats.groups:
            rounds.update(group.extra.get("histogram_rounds", []))
        if args.between == "broadcast":
            agreed &= between_steps(model, loss)
    seconds = (time.perf_counter() - began) / args.steps
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    identical = bool((hvd.allgather(flat.reshape(1, -1), name=f"replicas.{method}.{hierarchical}") == flat).all())
    return {"seconds_per_step": seconds, "rounds": dict(rounds), "identical": identical and agreed}


def main(argv: Optional[Sequence[str]] = None) -> None:
    import horovod.torch as hvd
    import torch

    from benchmarks.shared.results import command_line, write_results

    args = parser().parse_args(argv)
    hvd.init(process_sets="dynamic")  # the two-tier exchange adds its process sets
    torch.set_num_threads(1)
    torch.manual_seed(0)
    teacher, start = mlp(args), mlp(args).state_dict()
    rows: List[Dict[str, Any]] = []
    for method in args.methods:
        runs: Dict[bool, List[Dict[str, Any]]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for hierarchical in (False, True) if round_ % 2 == 0 else (True, False):
                runs[hierarchical].append(train(method, hierarchical, args, start, teacher))
        for hierarchical, done in runs.items():
            rows.append({"method": method, "two_tier": hierarchical,
                         "seconds_per_step": statistics.median(r["seconds_per_step"] for r in done),
                         "rounds": dict(sum((Counter(r["rounds"]) for r in done), Counter())),
                         "identical": all(r["identical"] for r in done)})
    if hvd.rank() != 0:
        return
    parameters = sum(p.numel() for p in teacher.parameters())
    print(f"{hvd.size()} workers on {hvd.cross_size()} hosts, {parameters:,} parameters, {args.steps} steps per round, "
          f"medians of {args.rounds} rounds, the loop's collectives between steps: {args.between}")
    print(f"{'method':10} {'exchange':9} {'s/step':>8} {'/ flat':>7}  identical  histogram rounds")
    for row in rows:
        flat = next(r for r in rows if r["method"] == row["method"] and not r["two_tier"])
        row["over_flat"] = row["seconds_per_step"] / flat["seconds_per_step"]
        rounds = ", ".join(f"{tag} {count}" for tag, count in sorted(row["rounds"].items())) or "-"
        print(f"{row['method']:10} {'two-tier' if row['two_tier'] else 'flat':9} {row['seconds_per_step']:8.4f} "
              f"{row['over_flat']:7.2f}  {str(row['identical']):9}  {rounds}")
    if args.results:
        write_results(args.results, "two_tier_steps", {"workers": hvd.size(), "hosts": hvd.cross_size(),
                                                       "parameters": parameters, "steps": args.steps,
                                                       "rounds": args.rounds, "between": args.between,
                                                       "rows": rows},
                      command_line(argv, "benchmarks.emulated.two_tier_steps"))


if __name__ == "__main__":
    main()
