"""MiCRO/ExDyna's threshold controllers and partition balancers on real and smooth gradient streams.

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.costs.controllers
    horovodrun -np 4 -H localhost:4 --gloo python -m benchmarks.costs.controllers

Every run trains a 64-1024-1024-10 MLP (the model the MiCRO/ExDyna authors' trainer was measured
on) with ``horovod_sparse.torch.DistributedOptimizer`` (SGD, momentum 0.9, 32 samples per worker
per step) on one of two streams: ``digits`` (scikit-learn's digits, real data, cross-entropy)
or ``smooth`` (a synthetic regression, inputs N(0, 1), unit-variance targets from a fixed linear
teacher plus noise: gradients that change smoothly). Rank 0 prints three tables:

1. **density tracking**, ExDyna with ``controller="histogram"`` (default) and ``"paper"``, at each
   ``--densities``: mean ``|union / k - 1|`` over the second half of the run, the lock-in step
   (first step after which the ratio stays within ±10%; ``never`` if it does not), the number
   of steps outside ±10% over the whole run, the metadata bytes per step (histogram and counts)
   and the values and indices the controller sent beyond ``k`` (``over-send``), and the result
   (test accuracy on digits, last training loss on smooth), with Top-k's result at the same
   density for comparison (``diverged`` when a non-finite gradient stopped the run);
2. **balancing**, on digits with the default controller: mean ``load_inc`` over the second
   half for MiCRO's static partitions, ExDyna with the paper's pairwise rule and ExDyna with the
   default rule;
3. **drain**: after ``--drain-after`` steps of digits at ``--drain-density``, the gradients are
   zero; the number of steps until every rank's residual is exactly zero, in units of ``d / k``.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import horovod.torch as hvd
import numpy as np
import torch
from torch import nn

import horovod_sparse.torch as hs
from benchmarks.shared.data import digits_split, shard
from benchmarks.shared.models import count_parameters, digits_mlp, seeded
from benchmarks.shared.results import Progress, command_line, write_results
from horovod_sparse.common.registry import parse_spec

STREAMS = ("digits", "smooth")


@dataclass
class Task:
    """A model, its local training data and how to judge it."""

    model: nn.Module
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    inputs: torch.Tensor
    targets: torch.Tensor
    evaluate: Callable[[nn.Module], float]


def make_task(stream: str, hidden: int, seed: int) -> Task:
    """This rank's share of ``stream`` and a freshly seeded model (identical on every rank)."""
    model = seeded(digits_mlp, seed, hidden)
    if stream == "digits":
        x_train, y_train, x_test, y_test = digits_split(seed=seed)

        def accuracy(trained: nn.Module) -> float:
            with torch.no_grad():
                return float((trained(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())

        return Task(model, nn.CrossEntropyLoss(), torch.from_numpy(shard(x_train, hvd.rank(), hvd.size())),
                    torch.from_numpy(shard(y_train, hvd.rank(), hvd.size())), accuracy)
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(64, 10, generator=generator) / 8.0  # unit-variance targets
    inputs = torch.randn(4096, 64, generator=generator)
    targets = inputs @ teacher + 0.1 * torch.randn(4096, 10, generator=generator)
    loss = nn.MSELoss()

    def training_loss(trained: nn.Module) -> float:
        with torch.no_grad():
            return float(loss(trained(inputs), targets))

    return Task(model, loss, inputs[hvd.rank()::hvd.size()], targets[hvd.rank()::hvd.size()], training_loss)


def run(spec: str, stream: str, steps: int, args: argparse.Namespace,
        drain_after: Optional[int] = None) -> Dict[str, Any]:
    """Train with compressor ``spec``; per step the union density ratio and ``load_inc``. With
    ``drain_after``, gradients are zero from that step on and the run stops once every rank's
    residual is zero."""
    if args.progress:
        args.progress.starting(f"{spec} on {stream}")
    name, options = parse_spec(spec)
    task = make_task(stream, args.hidden, args.seed)
    base = torch.optim.SGD(task.model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    opt = hs.DistributedOptimizer(base, named_parameters=task.model.named_parameters(),
                                  compression=hs.Compression.create(name, **options), nonfinite="raise")
    generator = torch.Generator().manual_seed(args.seed + hvd.rank())
    ratios: List[float] = []
    load_incs: List[float] = []
    meta_bytes: List[int] = []
    result = {"spec": spec, "stream": stream, "workers": hvd.size(), "parameters": count_parameters(task.model),
              "diverged": False, "drain_steps": None}
    for step in range(steps):
        opt.zero_grad()
        if drain_after is None or step < drain_after:
            batch = torch.randint(0, len(task.inputs), (args.batch_size,), generator=generator)
            task.loss(task.model(task.inputs[batch]), task.targets[batch]).backward()
        try:
            opt.step()
        except FloatingPointError:
            result["diverged"] = True
            break
        stats = opt.last_stats
        ratios.append(stats.density_ratio)
        load_incs.append(float(np.mean([group.extra.get("load_inc", 0.0) for group in stats.groups])))
        meta_bytes.append(stats.bytes_sent("meta"))
        if drain_after is not None and step >= drain_after and residual_is_empty(opt):
            result["drain_steps"] = step + 1 - drain_after
            break
    result.update(tracking(ratios), mean_load_inc=second_half_mean(load_incs),
                  meta_bytes_per_step=float(np.mean(meta_bytes)) if meta_bytes else 0.0,
                  result=task.evaluate(task.model))
    if args.progress:
        args.progress.done(f"{spec} on {stream}", f"mean |ratio - 1| {result['mean_deviation']:.4f}")
    return result


def residual_is_empty(opt: Any) -> bool:
    """True when no rank holds a non-zero residual coordinate."""
    local = sum(int(torch.count_nonzero(r)) for r in opt.residuals().values())
    return int(hvd.allreduce(torch.tensor([local]), op=hvd.Sum, name="bench.residual")) == 0


def second_half_mean(values: List[float]) -> float:
    return float(np.mean(values[len(values) // 2:])) if values else math.nan


def tracking(ratios: List[float]) -> Dict[str, Any]:
    """Mean |ratio - 1| over the second half, lock-in step (None: never), over-send fraction."""
    deviation = np.abs(np.asarray(ratios) - 1.0)
    outside = np.flatnonzero(deviation > 0.1)
    lock_in = 0 if outside.size == 0 else (int(outside[-1]) + 1 if outside[-1] + 1 < len(ratios) else None)
    return {"mean_deviation": second_half_mean(deviation.tolist()), "lock_in": lock_in,
            "steps_outside": int(outside.size),
            "over_send": float(np.mean(np.maximum(np.asarray(ratios) - 1.0, 0.0))) if ratios else math.nan}


def density_table(args: argparse.Namespace) -> List[Dict[str, Any]]:
    rows = []
    for stream in args.streams:
        for density in args.densities:
            baseline = run(f"topk:density={density}", stream, args.steps, args)
            for controller in ("histogram", "paper"):
                row = run(f"exdyna:density={density},controller={controller}", stream, args.steps, args)
                row.update(density=density, controller=controller, topk_result=baseline["result"],
                           topk_diverged=baseline["diverged"], k=max(1, int(density * row["parameters"])))
                rows.append(row)
    return rows


def balance_table(args: argparse.Namespace, tracked: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    density = min(args.densities)
    same = [r for r in tracked
            if r["stream"] == "digits" and r["density"] == density and r["controller"] == "histogram"]
    rows = [run(f"micro:density={density}", "digits", args.steps, args),
            run(f"exdyna:density={density},balancer=paper", "digits", args.steps, args)]
    rows.append(same[0] if same else run(f"exdyna:density={density}", "digits", args.steps, args))
    for row, label in zip(rows, ("MiCRO static partitions", "ExDyna, paper's pairwise rule",
                                 "ExDyna, default (prefix) rule")):
        row["label"] = label
    return rows


def drain_table(args: argparse.Namespace) -> List[Dict[str, Any]]:
    rows = []
    for controller in ("histogram", "paper"):
        d_over_k = 1.0 / args.drain_density
        cap = args.drain_after + int(args.drain_cap * d_over_k)
        row = run(f"exdyna:density={args.drain_density},controller={controller}", "digits", cap, args,
                  drain_after=args.drain_after)
        row.update(controller=controller, d_over_k=d_over_k, cap=cap - args.drain_after)
        rows.append(row)
    return rows


def print_tables(tracked: List[Dict[str, Any]], balanced: List[Dict[str, Any]], drained: List[Dict[str, Any]],
                 args: argparse.Namespace) -> None:
    workers, parameters = tracked[0]["workers"], tracked[0]["parameters"]
    print(f"\n1. density tracking: ExDyna, {workers} workers, {parameters} parameters, {args.steps} steps")
    print(f"{'stream':7s} {'density':>8s} {'controller':>10s} {'mean|r-1|':>10s} {'lock-in':>8s} {'outside':>8s} "
          f"{'meta B/step':>11s} {'over-send B/step':>16s} {'result':>8s} {'top-k':>8s}")
    for row in tracked:
        lock = "never" if row["lock_in"] is None else str(row["lock_in"])
        over = row["over_send"] * row["k"] * 8
        result = "diverged" if row["diverged"] else f"{row['result']:.4f}"
        topk = "diverged" if row["topk_diverged"] else f"{row['topk_result']:.4f}"
        print(f"{row['stream']:7s} {row['density']:8g} {row['controller']:>10s} {row['mean_deviation']:10.4f} "
              f"{lock:>8s} {row['steps_outside']:8d} {row['meta_bytes_per_step']:11.0f} {over:16.0f} "
              f"{result:>8s} {topk:>8s}")
    print(f"\n2. balancing: digits, density {min(args.densities)}, default controller: "
          "mean load_inc over the second half")
    for row in balanced:
        print(f"   {row['label']:32s} {row['mean_load_inc']:.4f}")
    print(f"\n3. drain: zero gradients after {args.drain_after} steps at density {args.drain_density}")
    for row in drained:
        steps = row["drain_steps"]
        took = f"{steps} steps = {steps / row['d_over_k']:.2f} d/k" if steps is not None else \
            f"not drained after {row['cap']} steps ({row['cap'] / row['d_over_k']:.1f} d/k)"
        print(f"   {row['controller']:10s} {took}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--streams", nargs="+", choices=STREAMS, default=list(STREAMS))
    parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.02, help="per worker; scaled by the worker count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drain-after", type=int, default=100)
    parser.add_argument("--drain-density", type=float, default=0.01)
    parser.add_argument("--drain-cap", type=float, default=10.0, help="give up after this many d/k steps")
    parser.add_argument("--results", type=Path, help="write every row as JSON here (rank 0)")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    runs = 3 * len(args.streams) * len(args.densities) + 2 + ("digits" not in args.streams) + 2
    args.progress = Progress(runs, "controllers") if hvd.rank() == 0 else None  # rank 0 reports each run
    tracked = density_table(args)
    balanced = balance_table(args, tracked)
    drained = drain_table(args)
    if hvd.rank() != 0:
        return
    print_tables(tracked, balanced, drained, args)
    if args.results:
        write_results(args.results, "controllers", {"tracking": tracked, "balancing": balanced, "drain": drained},
                      command_line(module="benchmarks.costs.controllers"))


if __name__ == "__main__":
    main()
