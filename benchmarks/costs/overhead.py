"""Overhead of the wrapper: ``horovod_sparse.torch.DistributedOptimizer`` with Horovod's own
``Compression.none`` against the stock ``hvd.DistributedOptimizer``, in the same run.

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.costs.overhead --model resnet20

Four copies of the model (same seed, same synthetic batch) are trained in alternation, two by
each optimizer, built in the order stock, wrapper, wrapper, stock (a copy built later can run a
few percent slower whatever its optimizer; with one copy each, that went to the wrapper's
account): rounds of ``--steps`` steps per copy in ABBA order, so drifts of a shared, noisy
machine fall on both alike; an optimizer's time in a round is the mean of its two copies'.
Both take exactly the same dense allreduces (one per tensor, same fusion), so what differs is
the wrapper's own per-step work. The overhead is the median of the per-round
ratios (robust to the load spikes of a shared machine); the ratio of the total times and the
spread of the per-round ratios are printed beside it. Writes ``--results`` as JSON. The
project's target: at most 5% (``Overhead: ... target <= 5%``).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from benchmarks.shared.models import MODELS, count_parameters, model_spec
from benchmarks.shared.results import command_line, write_results


@dataclass
class Trainer:
    """One model copy under one optimizer: ``step()`` runs a training step."""

    step: Callable[[], None]
    parameters: int
    tensors: int


def make_trainer(name: str, args: argparse.Namespace) -> Trainer:
    """A fresh model copy ``name`` (``<kind>.<copy>``) trained by optimizer ``kind`` (``stock``
    or ``hs``); its parameters are named after the copy."""
    kind = name.split(".")[0]
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import horovod_sparse.torch as hs

    spec = model_spec(args.model)
    size = args.size or spec.default_size
    torch.manual_seed(args.seed)
    model = spec.build(size)
    base = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    wrap = hvd.DistributedOptimizer if kind == "stock" else hs.DistributedOptimizer
    optimizer = wrap(base, named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()],
                     compression=hvd.Compression.none)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data, target = spec.batch(args.batch_size, size, torch.Generator().manual_seed(args.seed + hvd.rank()))

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    return Trainer(step, count_parameters(model), sum(1 for _ in model.parameters()))


#: The clocks every round is measured with: wall time, and CPU time of the whole process (all
#: threads, Horovod's background thread included), which other processes' load barely moves.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(step: Callable[[], None], steps: int) -> Dict[str, float]:
    """Mean seconds per step over ``steps`` steps, on each clock."""
    start = {name: clock() for name, clock in CLOCKS.items()}
    for _ in range(steps):
        step()
    return {name: (clock() - start[name]) / steps for name, clock in CLOCKS.items()}


#: The copies, in the order they are built: ``<optimizer>.<copy>``.
COPIES = ("stock.0", "hs.0", "hs.1", "stock.1")


def measure(trainers: Dict[str, Trainer], rounds: int, steps: int) -> Dict[str, Dict[str, List[float]]]:
    """Per-round mean step time of each trainer on each clock (``times[clock][name]``), rounds
    alternating in the trainers' order and its reverse."""
    order = list(trainers)
    times: Dict[str, Dict[str, List[float]]] = {clock: {k: [] for k in order} for clock in CLOCKS}
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            for clock, seconds in timed(trainers[name].step, steps).items():
                times[clock][name].append(seconds)
    return times


def per_optimizer(times: Dict[str, List[float]]) -> Dict[str, List[float]]:
    """``{"stock": [...], "hs": [...]}``: per round, the mean over each optimizer's copies."""
    kinds = sorted({name.split(".")[0] for name in times})
    return {kind: np.mean([t for name, t in times.items() if name.split(".")[0] == kind], axis=0).tolist()
            for kind in kinds}


def compare(stock: Sequence[float], wrapped: Sequence[float]) -> Dict[str, float]:
    """Mean step times, the overhead (median of per-round ratios), the ratio of the totals and
    the central 95% of per-round ratios."""
    ratios = np.array(wrapped) / np.array(stock)
    return {"stock_step_seconds": float(np.mean(stock)), "hs_step_seconds": float(np.mean(wrapped)),
            "overhead": float(np.median(ratios) - 1), "total_ratio": float(np.sum(wrapped) / np.sum(stock)),
            "round_ratio_p2_5": float(np.percentile(ratios, 2.5)),
            "round_ratio_p97_5": float(np.percentile(ratios, 97.5))}


def report_line(clock: str, figures: Dict[str, float]) -> str:
    return (f"{clock:>4}: stock {1e3 * figures['stock_step_seconds']:8.2f} ms/step, horovod_sparse "
            f"{1e3 * figures['hs_step_seconds']:8.2f} ms/step; overhead {100 * figures['overhead']:+.1f}% "
            f"(median of per-round ratios; ratio of totals {100 * (figures['total_ratio'] - 1):+.1f}%; 95% of "
            f"rounds in [{100 * (figures['round_ratio_p2_5'] - 1):+.1f}%, "
            f"{100 * (figures['round_ratio_p97_5'] - 1):+.1f}%])")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet20", choices=sorted(MODELS))
    parser.add_argument("--batch-size", type=int, default=8, help="per worker (small: the wrapper's share shows)")
    parser.add_argument("--size", type=int, help="image side / sequence length (default: the model's)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per optimizer first")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=2, help="steps per optimizer per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, help="write the figures as JSON here (rank 0)")
    args = parser.parse_args(argv)

    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    trainers = {name: make_trainer(name, args) for name in COPIES}
    for trainer in trainers.values():
        timed(trainer.step, args.warmup)
    copies = measure(trainers, args.rounds, args.steps)
    times = {clock: per_optimizer(copies[clock]) for clock in CLOCKS}
    figures = {clock: compare(times[clock]["stock"], times[clock]["hs"]) for clock in CLOCKS}
    if hvd.rank() != 0:
        return
    stock = trainers["stock.0"]
    print(f"Model: {args.model} ({stock.parameters} parameters, {stock.tensors} tensors), "
          f"batch {args.batch_size} per worker, {hvd.size()} workers, "
          f"{args.rounds} rounds x {args.steps} steps per copy, two copies per optimizer (alternating order)")
    print("horovod_sparse.torch.DistributedOptimizer(compression=hvd.Compression.none) "
          "against hvd.DistributedOptimizer:")
    for clock in CLOCKS:
        print(report_line(clock, figures[clock]))
    print(f"Overhead: {100 * figures['wall']['overhead']:+.1f}% wall time, {100 * figures['cpu']['overhead']:+.1f}% "
          f"CPU time (target <= 5%)")
    if args.results:
        write_results(args.results, "overhead",
                      {"model": args.model, "batch_size": args.batch_size, "workers": hvd.size(),
                       "rounds": args.rounds, "steps": args.steps, **figures, "times": times, "copies": copies},
                      command_line(argv, "benchmarks.costs.overhead"))


if __name__ == "__main__":
    main()
