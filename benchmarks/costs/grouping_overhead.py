"""Compression overhead per step with per-tensor, merged, whole-model and MergeComp-chosen
grouping, side by side, on a model with many small layers.

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.costs.grouping_overhead \\
        --model resnet20 --compressors topk:density=0.01 micro:density=0.01

For every compressor, copies of the model (same seed, same synthetic batch) are trained with
``groups="tensor"``, ``"size:8192"`` (LAGS's merging), ``"model"`` and ``"mergecomp"``, and one
more copy is trained without any exchange (``local``: the compute-only step). The MergeComp copy
first runs its search (``--search-warmup`` + ``--search-timed`` steps per candidate, by default
the scheduler's own 5 + 20, as in the reference; with fewer timed steps a noisy machine can
mislead the choice) and its cost is reported: candidates, steps, seconds,
and the seconds beyond running the chosen grouping for as many steps. Then ``--rounds`` rounds
run every copy for ``--steps`` steps, in an order rotated every round so drifts of a shared
machine fall on all alike.

Figures per copy: median over rounds of the step time; *overhead* = step time - the local step
time of the same round (compression work plus communication not hidden under backward); the
compression work itself (flatten + select + apply, from the statistics) and the wait for
collectives. The last column is the median over rounds of the step-time ratio to the best fixed
grouping of that compressor: MergeComp's target is at most 1.00.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from benchmarks.shared.models import MODELS, count_parameters, model_spec
from benchmarks.shared.results import command_line, write_results
from horovod_sparse.common.registry import parse_spec

FIXED_GROUPINGS = ("tensor", "size:8192", "model")
#: Statistics phases that are the compressor's own work (the rest is waiting for collectives).
WORK_PHASES = ("flatten", "select", "apply")


@dataclass
class Trainer:
    """One model copy under one optimizer; ``step()`` runs a training step and records timings."""

    name: str
    step: Callable[[], None]
    optimizer: Any
    compression: Any
    parameters: int
    tensors: int
    phases: Dict[str, List[float]] = field(default_factory=dict)


def build_trainer(name: str, args: argparse.Namespace, compressor: Optional[str], groups: Any) -> Trainer:
    """A fresh copy of ``args.model`` (``args.size``, ``args.batch_size``, ``args.seed``) trained
    with ``compressor`` (a ``NAME:key=value`` spec, resolved by ``Compression.create``) and
    ``groups=``; ``compressor=None`` trains locally without any exchange."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import horovod_sparse.torch as hs

    spec = model_spec(args.model)
    size = args.size or spec.default_size
    torch.manual_seed(args.seed)
    model = spec.build(size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    compression = None
    if compressor is not None:
        method, options = parse_spec(compressor)
        compression = hs.Compression.create(method, **options)
        optimizer = hs.DistributedOptimizer(
            optimizer, named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()],
            compression=compression, groups=groups)
    data, target = spec.batch(args.batch_size, size, torch.Generator().manual_seed(args.seed + hvd.rank()))
    trainer = Trainer(name, lambda: None, optimizer, compression, count_parameters(model),
                      sum(1 for _ in model.parameters()))

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        stats = getattr(optimizer, "last_stats", None)
        if stats is not None:
            for phase, seconds in stats.summary()["seconds"].items():
                trainer.phases.setdefault(phase, []).append(seconds)

    trainer.step = step
    return trainer


def timed_rounds(trainers: Sequence[Trainer], rounds: int, steps: int) -> Dict[str, List[float]]:
    """Per-round mean wall seconds per step of every trainer; the order rotates every round."""
    import time

    times: Dict[str, List[float]] = {t.name: [] for t in trainers}
    for r in range(rounds):
        shift = r % len(trainers)
        for trainer in [*trainers[shift:], *trainers[:shift]]:
            start = time.perf_counter()
            for _ in range(steps):
                trainer.step()
            times[trainer.name].append((time.perf_counter() - start) / steps)
    return times


def run_search(trainer: Trainer, limit: int) -> Dict[str, Any]:
    """Train ``trainer`` (a MergeComp copy) until its search is done; return the result record."""
    scheduler = trainer.optimizer.mergecomp
    for _ in range(limit):
        if scheduler.result is not None:
            break
        trainer.step()
    if scheduler.result is None:
        raise RuntimeError(f"MergeComp did not finish its search in {limit} steps; raise --search-limit")
    return scheduler.result.as_dict()


def compare(compressor: str, trainers: Dict[str, Trainer], times: Dict[str, List[float]],
            local: List[float]) -> List[Dict[str, Any]]:
    """One row per grouping of ``compressor``: median figures and the ratio to the best fixed one."""
    best_fixed = min(FIXED_GROUPINGS, key=lambda g: np.median(times[trainers[g].name]))
    def layout(trainer: Trainer) -> List[List[str]]:  # groups as parameter names without the copy's prefix
        return [[n[len(trainer.name) + 1:] for n in group] for group in trainer.optimizer.groups]

    rows = []
    for grouping, trainer in trainers.items():
        own = np.array(times[trainer.name])
        same = [g for g in FIXED_GROUPINGS if g != grouping and layout(trainers[g]) == layout(trainer)]
        work = sum(np.array(trainer.phases.get(p, [0.0])) for p in WORK_PHASES)
        rows.append({"compressor": compressor, "grouping": grouping, "groups": len(trainer.optimizer.groups),
                     "step_seconds": float(np.median(own)),
                     "overhead_seconds": float(np.median(own - np.array(local))),
                     "work_seconds": float(np.median(work)),
                     "wait_seconds": float(np.median(trainer.phases.get("communicate", [0.0]))),
                     "ratio_to_best_fixed": float(np.median(own / np.array(times[trainers[best_fixed].name]))),
                     "best_fixed": best_fixed, "same_groups_as": same[0] if same else None})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet20", choices=sorted(MODELS))
    parser.add_argument("--compressors", nargs="+", default=["topk:density=0.01", "micro:density=0.01"],
                        help="compressor specs (NAME:key=value,...); unknown names are skipped")
    parser.add_argument("--batch-size", type=int, default=8, help="per worker")
    parser.add_argument("--size", type=int, help="image side (default: the model's)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per copy before the rounds")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3, help="steps per copy per round")
    parser.add_argument("--search-warmup", type=int, default=5, help="MergeComp: untimed steps per candidate")
    parser.add_argument("--search-timed", type=int, default=20, help="MergeComp: timed steps per candidate")
    parser.add_argument("--search-limit", type=int, default=800, help="MergeComp: most steps the search may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, help="write the figures as JSON here (rank 0)")
    args = parser.parse_args(argv)

    import horovod.torch as hvd
    import torch

    import horovod_sparse.torch as hs
    from horovod_sparse.common.mergecomp import MergeCompOptions

    hvd.init()
    torch.set_num_threads(1)
    known = set(hs.Compression.names())
    compressors = [c for c in args.compressors if parse_spec(c)[0] in known]
    search = MergeCompOptions(warmup_steps=args.search_warmup, timed_steps=args.search_timed)
    local = build_trainer("local", args, None, None)
    copies: Dict[str, Dict[str, Trainer]] = {}
    searches: Dict[str, Dict[str, Any]] = {}
    for i, compressor in enumerate(compressors):
        copies[compressor] = {g: build_trainer(f"c{i}.{g}", args, compressor, g) for g in FIXED_GROUPINGS}
        copies[compressor]["mergecomp"] = build_trainer(f"c{i}.mergecomp", args, compressor, search)
        searches[compressor] = run_search(copies[compressor]["mergecomp"], args.search_limit)
    every = [local, *(t for per in copies.values() for t in per.values())]
    for trainer in every:
        for _ in range(args.warmup):
            trainer.step()
        trainer.phases.clear()
    times = timed_rounds(every, args.rounds, args.steps)
    rows = [row for c in compressors for row in compare(c, copies[c], times, times["local"])]
    if hvd.rank() != 0:
        return
    print(f"Model: {args.model} ({local.parameters} parameters, {local.tensors} tensors), batch "
          f"{args.batch_size} per worker, {hvd.size()} workers, {args.rounds} rounds x {args.steps} steps "
          f"per copy; local (no exchange) step {1e3 * np.median(times['local']):.1f} ms")
    print(f"{'compressor':22s} {'grouping':10s} {'groups':>6s} {'step ms':>8s} {'overhead ms':>11s} "
          f"{'work ms':>8s} {'wait ms':>8s} {'vs best fixed':>13s}")
    for row in rows:
        print(f"{row['compressor']:22s} {row['grouping']:10s} {row['groups']:6d} {1e3 * row['step_seconds']:8.1f} "
              f"{1e3 * row['overhead_seconds']:11.1f} {1e3 * row['work_seconds']:8.2f} "
              f"{1e3 * row['wait_seconds']:8.2f} {row['ratio_to_best_fixed']:13.3f}"
              + (f"  (same groups as {row['same_groups_as']})" if row["same_groups_as"] else ""))
    for compressor, result in searches.items():
        print(f"MergeComp search ({compressor}): {len(result['trials'])} candidates, {result['search_steps']} "
              f"steps, {result['search_seconds']:.1f} s ({result['search_overhead_seconds']:.1f} s beyond "
              f"running the chosen grouping); chose {len(result['groups'])} groups, split points "
              f"{result['splits']}")
    if args.results:
        write_results(args.results, "grouping_overhead",
                      {"model": args.model, "batch_size": args.batch_size, "workers": hvd.size(),
                       "rounds": args.rounds, "steps": args.steps, "rows": rows, "searches": searches,
                       "times": times},
                      command_line(argv, "benchmarks.costs.grouping_overhead"))


if __name__ == "__main__":
    main()
