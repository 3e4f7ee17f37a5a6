"""What the agreement on non-finite gradients adds to a Horovod step, side by side in one job.

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.costs.step_end \\
        [--methods topk micro] [--density 0.01] [--rounds 5] [--steps 100] [--results FILE]
    torchrun --nproc-per-node 2 -m benchmarks.costs.step_end --ddp [...]

Per method, three copies of the digits MLP (85,002 parameters, a batch of 32 of random inputs per
worker) trained in turn: Horovod's own ``DistributedOptimizer`` (dense), and
``hs.DistributedOptimizer`` with the method under its default ``nonfinite`` policy and without one
(``nonfinite=None``: no agreement); with ``--ddp`` (a ``torchrun`` job over Gloo) DDP with its own
allreduce (dense) and with the method's comm hook (``horovod_sparse.ddp.State``) under the default
policy and without one. The copies run ``--steps`` steps each per round, in an order
that rotates between rounds so that a shared machine's drifts fall on all alike. Rank 0 prints
per copy the median over rounds of the milliseconds per step, and per method the step with the
policy over the step without it: the agreement's cost. The agreement is one tiny Horovod
allgather; launched after the exchange finished it takes a Horovod cycle of its own every step,
launched with the exchange (when the step's finiteness is known on the host) it shares its cycle.
In DDP the agreement is a ``torch.distributed`` allgather at the step's end, in the last bucket's
hook.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["topk", "micro"])
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="steps per copy and round")
    p.add_argument("--ddp", action="store_true", help="DDP and the comm hook in a torchrun job, not Horovod")
    p.add_argument("--results", type=Path, help="also write the figures to this JSON file")
    return p


def horovod_copies(density: float) -> Tuple[int, int, Callable[..., Tuple[Any, Any]]]:
    """This rank, the job's size, and ``build(net, method, **options)``: the digits MLP ``net`` with
    Horovod's optimizer (``method`` None) or ``hs.DistributedOptimizer`` with ``method``."""
    import horovod.torch as hvd
    import torch

    import horovod_sparse.torch as hs

    hvd.init()

    def build(net: Any, method: Optional[str], **options: Any) -> Tuple[Any, Any]:
        sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        if method is None:
            return net, hvd.DistributedOptimizer(sgd, named_parameters=net.named_parameters())
        return net, hs.DistributedOptimizer(sgd, named_parameters=net.named_parameters(),
                                            compression=hs.Compression.create(method, density=density), **options)
    return hvd.rank(), hvd.size(), build


def ddp_copies(density: float) -> Tuple[int, int, Callable[..., Tuple[Any, Any]]]:
    """:func:`horovod_copies` for DDP in a ``torchrun`` job (Gloo): DDP's own allreduce, or the
    method's comm hook."""
    import torch
    import torch.distributed as dist

    import horovod_sparse.ddp as hsd

    dist.init_process_group("gloo")

    def build(net: Any, method: Optional[str], **options: Any) -> Tuple[Any, Any]:
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        if method is not None:
            ddp.register_comm_hook(hsd.State(compression=hsd.Compression.create(method, density=density), **options),
                                   hsd.hook)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    return dist.get_rank(), dist.get_world_size(), build


def main(argv: Optional[Sequence[str]] = None) -> None:
    import torch

    from benchmarks.shared.models import digits_mlp

    args = parser().parse_args(argv)
    rank, size, build = (ddp_copies if args.ddp else horovod_copies)(args.density)
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    inputs, labels = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def copy(method: Optional[str], **options: Any) -> Callable[[], None]:
        torch.manual_seed(0)
        net, opt = build(digits_mlp(), method, **options)

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
    if rank == 0:
        report(args, measured, size, argv)
    if args.ddp:  # a DDP job over Gloo can abort in the interpreter's finalization (horovod_sparse.ddp.exit_job)
        from horovod_sparse.ddp import exit_job

        exit_job()


def report(args: argparse.Namespace, measured: Dict[str, List[float]], size: int,
           argv: Optional[Sequence[str]]) -> None:
    """Print the medians of ``measured`` (seconds a step, per copy) with each policy's ratio to
    its copy without one, and write them to ``args.results`` when given."""
    from benchmarks.shared.results import command_line, write_results

    rows = [{"copy": name, "seconds": statistics.median(runs)} for name, runs in measured.items()]
    seconds = {row["copy"]: row["seconds"] for row in rows}
    print(f"{'DDP' if args.ddp else 'Horovod'}, {size} ranks, {args.rounds} rounds x {args.steps} steps per copy; "
          "medians over rounds")
    print(f"{'copy':28} {'ms/step':>8} {'policy / none':>14}")
    for row in rows:
        without = seconds.get(f"{row['copy']} nonfinite=None")
        if without is not None:
            row["policy_over_none"] = row["seconds"] / without
        ratio = f"{row['policy_over_none']:14.3f}" if "policy_over_none" in row else ""
        print(f"{row['copy']:28} {row['seconds'] * 1e3:8.3f} {ratio}")
    if args.results:
        write_results(args.results, "step_end", {"front_end": "ddp" if args.ddp else "horovod", "ranks": size,
                                                 "density": args.density, "rows": rows},
                      command_line(argv, "benchmarks.costs.step_end"))


if __name__ == "__main__":
    main()
