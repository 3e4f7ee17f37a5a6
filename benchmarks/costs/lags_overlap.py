"""LAGS-SGD against whole-model Top-k and dense Horovod: the communication left exposed after
backward, and the step time, side by side, with the alpha-beta model measured on the running
cluster.

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.costs.lags_overlap --model resnet20
    python -m benchmarks.costs.lags_overlap --emulate 1gbit --workers 2 --model resnet20   # root

``--emulate RATE`` runs the same measurement as a Horovod job across an emulated cluster whose
links are shaped to ``RATE`` (:mod:`benchmarks.emulated.netem`: network namespaces, needs root), the
communication-bound setting; without it the job runs where it is launched.

Copies of the model (same seed and synthetic batch) are trained without exchange (``local``),
with Horovod's dense allreduce per tensor (``dense``), whole-model Top-k (``topk``), LAGS with
its adaptive rule (``lags``, groups of 8192 elements) and LAGS with the rule off
(``lags-uniform``, the reference's default), all at ``--density``, and LAGS with the rule off at
each fixed density of ``--sweep`` (multiples of ``--density``: ``lags-fixed-D``), the densities
the rule may choose between; ``--rounds`` rounds run every copy ``--steps`` steps in a rotating
order. Per copy, medians over the timed steps:

* *step*: wall time of a training step;
* *exposed*: from the last gradient of backward to the end of the exchange (``synchronize()``),
  i.e. communication and compression not hidden under backward, from the optimizer's timeline;
* *predicted*: the same from the alpha-beta model (:func:`~horovod_sparse.common.cost_model.exposed_time`
  over the groups' measured launch times and modelled exchange times, exchanges queued behind a
  busy link fused as Horovod does); it leaves out the compression work and the ranks' skew;
* *projected*: the prediction on the network of ``--project-alpha``/``--project-beta`` (default
  a 1 Gbit/s link, 50 us latency), with LAGS's densities chosen again for that network from
  the same measured ``t_comp``.

Then the model (alpha, beta), LAGS's measured local costs, and its measured ``t_comp`` and chosen
``rho`` per group.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks.costs.grouping_overhead import Trainer, build_trainer
from benchmarks.shared.models import MODELS
from benchmarks.shared.results import command_line, write_results
from horovod_sparse.common.cost_model import AlphaBeta, exposed_time
from horovod_sparse.methods.lags.rule import LagsGroup, lags_counts

#: name -> (compressor spec with {density}, groups)
COPIES = {
    "dense": ("none", "tensor"),
    "topk": ("topk:density={density},min_numel=0", "model"),
    "lags": ("lags:density={density}", None),
    "lags-uniform": ("lags:density={density},adaptive=false", None),
}


def exchange_seconds(model: AlphaBeta, numel: int, count: int, dense: bool) -> Tuple[float, float]:
    """Modelled ``(latency, transfer)`` seconds of one group's exchange: a dense allreduce of
    ``numel`` elements, or an allgather of ``count`` (value, index) pairs."""
    cost = model.dense_allreduce if dense else model.sparse_allgather
    latency = cost(0)
    return latency, cost(numel if dense else count) - latency


def step_figures(trainer: Trainer, model: AlphaBeta, project: AlphaBeta) -> Dict[str, float]:
    """Exposed communication of the trainer's last step: measured, predicted, projected."""
    record = trainer.optimizer.timeline.last
    groups = {g.name: g for g in trainer.optimizer.last_stats.groups}
    lags = trainer.compression if getattr(trainer.compression, "method_name", "") == "lags" else None

    chosen: Dict[str, int] = {}
    if lags is not None and lags.local_cost is not None and lags.launch_order:
        plan = [LagsGroup(name, numel, lags.t_comp[name]) for name, numel in lags.launch_order]
        options = lags.options
        counts = lags_counts(plan, project, lags.local_cost, options.density, options.max_density, options.slack)
        chosen = {g.name: count for g, count in zip(plan, counts)}

    def projected_count(name: str) -> int:
        return chosen.get(name, groups[name].target)

    def predicted(on: AlphaBeta, count: Any) -> float:
        jobs = [(record.group_ready[n], *exchange_seconds(on, groups[n].numel, count(n), groups[n].dense))
                for n in record.launch_order]
        return exposed_time(jobs, record.backward_end)

    return {"exposed": record.step_end - record.backward_end,
            "predicted": predicted(model, lambda n: groups[n].target),
            "projected": predicted(project, projected_count)}


def lags_report(trainer: Trainer) -> List[Dict[str, Any]]:
    """Per LAGS group (launch order): size, measured t_comp and the chosen density."""
    record = trainer.optimizer.timeline.last
    groups = {g.name: g for g in trainer.optimizer.last_stats.groups}
    return [{"group": n, "numel": groups[n].numel, "t_comp": groups[n].extra.get("t_comp"),
             "rho": groups[n].extra.get("rho"), "dense": groups[n].dense} for n in record.launch_order]


def emulate(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Run this benchmark as a Horovod job across an emulated cluster (root)."""
    from benchmarks.emulated.netem import EmulatedCluster, inner_argv, measure_link, run_horovod

    inner = inner_argv(argv)
    with EmulatedCluster(workers=args.workers, rate=args.emulate) as cluster:
        link = measure_link(cluster)
        print(f"Emulated cluster: {args.workers} workers, links shaped to {args.emulate}; measured link: "
              f"{link.as_dict()}", flush=True)
        run_horovod(cluster, [sys.executable, "-m", "benchmarks.costs.lags_overlap", *inner], on_line=print)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet20", choices=sorted(MODELS))
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--sweep", type=float, nargs="*", default=[2.0, 5.0, 10.0],
                        help="fixed LAGS densities to compare, as multiples of --density")
    parser.add_argument("--batch-size", type=int, default=8, help="per worker")
    parser.add_argument("--size", type=int, help="image side / sequence length (default: the model's)")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps per copy (LAGS measures then)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per copy per round")
    parser.add_argument("--project-alpha", type=float, default=50e-6, help="projection: latency (s)")
    parser.add_argument("--project-beta", type=float, default=8e-9, help="projection: s per byte (8e-9: 1 Gbit/s)")
    parser.add_argument("--emulate", metavar="RATE", help="run on an emulated cluster with links of RATE (root)")
    parser.add_argument("--workers", type=int, default=2, help="with --emulate: number of workers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, help="write the figures as JSON here (rank 0)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.emulate:
        emulate(args, argv)
        return

    import time

    import horovod.torch as hvd
    import torch

    from horovod_sparse.common.measurements import measure_cost_model
    from horovod_sparse.torch import backend

    hvd.init()
    torch.set_num_threads(1)
    model, samples = measure_cost_model(backend, hvd.global_process_set)
    project = AlphaBeta(args.project_alpha, args.project_beta, hvd.size())
    local = build_trainer("local", args, None, None)
    specs = dict(COPIES)
    for factor in args.sweep:
        specs[f"lags-fixed-{factor * args.density:g}"] = (f"lags:density={factor * args.density:g},adaptive=false",
                                                         None)
    copies = {name: build_trainer(name, args, spec.format(density=args.density), groups)
              for name, (spec, groups) in specs.items()}
    every = [local, *copies.values()]
    for trainer in every:
        for _ in range(args.warmup):
            trainer.step()
    steps: Dict[str, List[float]] = {t.name: [] for t in every}
    figures: Dict[str, List[Dict[str, float]]] = {name: [] for name in copies}
    for r in range(args.rounds):
        shift = r % len(every)
        for trainer in [*every[shift:], *every[:shift]]:
            for _ in range(args.steps):
                start = time.perf_counter()
                trainer.step()
                steps[trainer.name].append(time.perf_counter() - start)
                if trainer.name in figures:
                    figures[trainer.name].append(step_figures(trainer, model, project))
    if hvd.rank() != 0:
        return
    rows = [{"copy": name, "step_seconds": float(np.median(steps[name])),
             **{k: float(np.median([f[k] for f in figures[name]])) for k in ("exposed", "predicted", "projected")},
             "bytes_sent": copies[name].optimizer.last_stats.bytes_sent(),
             "groups": len(copies[name].optimizer.groups)} for name in copies]
    print(f"Model: {args.model} ({local.parameters} parameters, {local.tensors} tensors), batch "
          f"{args.batch_size} per worker, {hvd.size()} workers, density {args.density}, "
          f"{args.rounds} rounds x {args.steps} steps per copy")
    print(f"Measured alpha-beta model: alpha {1e6 * model.alpha:.1f} us, beta {1e9 * model.beta:.3f} ns/byte "
          f"({8 / max(model.beta, 1e-30) / 1e9:.2f} Gbit/s); projection: alpha {1e6 * project.alpha:.1f} us, "
          f"beta {1e9 * project.beta:.3f} ns/byte")
    print(f"local (no exchange) step {1e3 * np.median(steps['local']):.1f} ms")
    print(f"{'copy':13s} {'groups':>6s} {'step ms':>8s} {'exposed ms':>10s} {'predicted ms':>12s} "
          f"{'projected ms':>12s} {'bytes sent':>10s}")
    for row in rows:
        print(f"{row['copy']:13s} {row['groups']:6d} {1e3 * row['step_seconds']:8.1f} {1e3 * row['exposed']:10.2f} "
              f"{1e3 * row['predicted']:12.2f} {1e3 * row['projected']:12.2f} {row['bytes_sent']:10d}")
    report = lags_report(copies["lags"])
    own, local_cost = copies["lags"].compression.cost_model, copies["lags"].compression.local_cost
    print(f"LAGS's own start-up model: alpha {1e6 * own.alpha:.1f} us, beta {1e9 * own.beta:.3f} ns/byte; "
          f"local costs: selection {1e9 * local_cost.select_element:.3f} ns per element + "
          f"{1e9 * local_cost.select_pair:.1f} ns per pair, scatter-add {1e9 * local_cost.apply_pair:.1f} ns per "
          f"received pair; groups in launch order (t_comp measured, rho chosen):")
    for g in report:
        t_comp = "-" if g["t_comp"] is None else f"{1e3 * g['t_comp']:.2f} ms"
        print(f"  {g['group']:40s} {g['numel']:8d} elements  t_comp {t_comp:>10s}  rho {g['rho']}")
    if args.results:
        write_results(args.results, "lags_overlap",
                      {"model": args.model, "density": args.density, "workers": hvd.size(),
                       "alpha_beta": model.as_dict(), "calibration": samples, "projection": project.as_dict(),
                       "lags_alpha_beta": own.as_dict(), "lags_local_cost": dataclasses.asdict(local_cost),
                       "local_step_seconds": float(np.median(steps["local"])), "rows": rows, "lags_groups": report},
                      command_line(argv, "benchmarks.costs.lags_overlap"))


if __name__ == "__main__":
    main()
