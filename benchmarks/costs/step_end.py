"""What the agreement on non-finite gradients adds to a Horovod step, side by side in one job.

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.costs.step_end \\
        [--methods topk micro] [--density 0.01] [--rounds 5] [--steps 100] [--results FILE]

Per method, three copies of the digits MLP (85,002 parameters, a batch of 32 of random inputs per
worker) trained in turn: Horovod's own ``DistributedOptimizer`` (dense), and
``hs.DistributedOptimizer`` with the method under its default ``nonfinite`` policy and without one
(``nonfinite=None``: no agreement). The copies run ``--steps`` steps each per round, in an order
that rotates between rounds so that a shared machine's drifts fall on all alike. Rank 0 prints
per copy the median over rounds of the milliseconds per step, and per method the step with the
policy over the step without it: the agreement's cost. The agreement is one tiny Horovod
allgather; launched after the exchange finished it takes a Horovod cycle of its own every step,
launched with the exchange (when the step's finiteness is known on the host) it shares its cycle.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["topk", "micro"])
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="steps per copy and round")
    p.add_argument("--results", type=Path, help="also write the figures to this JSON file")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    import horovod.torch as hvd
    import torch

    import horovod_sparse.torch as hs
    from benchmarks.shared.models import digits_mlp
    from benchmarks.shared.results import command_line, write_results

    args = parser().parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())
    inputs, labels = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def copy(method: Optional[str], **options: Any) -> Callable[[], None]:
        torch.manual_seed(0)
        net = digits_mlp()
        sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        opt = (hvd.DistributedOptimizer(sgd, named_parameters=net.named_parameters()) if method is None else
               hs.DistributedOptimizer(sgd, named_parameters=net.named_parameters(),
                                       compression=hs.Compression.create(method, density=args.density), **options))

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(inputs), labels).backward()
            opt.step()
        return step

    copies: Dict[str, Callable[[], None]] = {"dense": copy(None)}
    for method in args.methods:
        copies[f"{method}"] = copy(method)
        copies[f"{method} nonfinite=None"] = copy(method, nonfinite=None)
    measured: Dict[str, List[float]] = {name: [] for name in copies}
    names = list(copies)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            copies[name]()  # a step outside the timing: the first after another copy's
            start = time.perf_counter()
            for _ in range(args.steps):
                copies[name]()
            measured[name].append((time.perf_counter() - start) / args.steps)
    if hvd.rank() != 0:
        return
    rows = [{"copy": name, "seconds": statistics.median(runs)} for name, runs in measured.items()]
    seconds = {row["copy"]: row["seconds"] for row in rows}
    print(f"{hvd.size()} ranks, {args.rounds} rounds x {args.steps} steps per copy; medians over rounds")
    print(f"{'copy':28} {'ms/step':>8} {'policy / none':>14}")
    for row in rows:
        without = seconds.get(f"{row['copy']} nonfinite=None")
        if without is not None:
            row["policy_over_none"] = row["seconds"] / without
        ratio = f"{row['policy_over_none']:14.3f}" if "policy_over_none" in row else ""
        print(f"{row['copy']:28} {row['seconds'] * 1e3:8.3f} {ratio}")
    if args.results:
        write_results(args.results, "step_end", {"ranks": hvd.size(), "density": args.density, "rows": rows},
                      command_line(argv, "benchmarks.costs.step_end"))


if __name__ == "__main__":
    main()
