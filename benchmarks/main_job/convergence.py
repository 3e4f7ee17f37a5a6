"""Convergence on real data: every method against dense Horovod at equal epochs, on scikit-learn's
bundled digits (1797 8x8 images, no download), with 2 and 4 workers.

    python -m benchmarks.main_job.convergence --workers 2 4 --density 0.01 --epochs 20 --seeds 0 1 2 [--ddp]

For each worker count one ``horovodrun --gloo`` job trains the digits MLP once per (seed,
compressor): dense (``none``) and every method with a torch implementation at ``--density``, with
the same data split, per-worker batch, learning rate and epochs; the seed sets the initial weights
and the batch order. Test accuracy is taken after every epoch. Prints a table of final accuracy
(mean and spread over seeds) and its difference to dense in points; writes
``<out>/<name>.json`` and ``<out>/<name>.png`` (test-accuracy curves, one panel per worker
count). The target of the project: within 1 point of dense at density 0.01.

With ``--ddp`` a ``torchrun --standalone`` job (Gloo, this machine) follows each Horovod job and
trains the same runs (data, batches, learning rate, epochs, seeds, initial weights) as
``DistributedDataParallel``: ``ddp none`` (DDP's own allreduce), ``ddp powersgd:rank=R,start=S``
(PyTorch's PowerSGD hook, ``--powersgd-rank``, ``--powersgd-start``) and ``ddp <method spec>`` for
every method (horovod_sparse.ddp's hook; DDP's buckets are its groups, so the MLP, one bucket, is
one group where the Horovod optimizer takes each method's own grouping, and the first step is
dense). Their rows are also compared to ``ddp none`` ("vs dense DDP"). Bytes sent per step are
the payload a rank hands its collectives (:meth:`benchmarks.main_job.digits_training.DdpExchange.traffic`);
PowerSGD has no union density (blank).

``--worker`` is the mode the jobs run in (one rank of the job; with ``--ddp``, of the DDP job).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from benchmarks.main_job.digits_training import POWERSGD, DigitsJob, add_arguments, horovodrun, torchrun
from benchmarks.shared import plots
from benchmarks.shared.results import Progress, command_line, read_results, write_results

#: How the DDP job's rows name their configuration: ``ddp <spec>``.
DDP_PREFIX = "ddp "
#: How a rank-0 line announcing a finished run starts (the driver's progress).
TRAINED = "trained "


def train_curve(spec: str, seed: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Train the digits MLP with compressor ``spec`` (a DDP configuration with ``--ddp``) on this
    rank's shard; test accuracy per epoch."""
    job = DigitsJob(spec, hidden=args.hidden, lr=args.lr, batch_size=args.batch_size, model_seed=seed, split_seed=0,
                    ddp=args.ddp)
    accuracy, losses, sent, union = [], [], [], []
    epoch_loss = 0.0
    for step in job.steps(args.epochs, order_seed=seed * 1000 + job.rank):
        epoch_loss += float(step.loss)
        step_sent, step_union = job.traffic()
        sent.append(step_sent)
        union.append(step_union)
        if step.step == job.steps_per_epoch - 1:
            accuracy.append(job.test_accuracy())
            losses.append(epoch_loss / job.steps_per_epoch)
            epoch_loss = 0.0
    return {"compressor": DDP_PREFIX + spec if args.ddp else spec, "seed": seed, "workers": job.size,
            "accuracy": accuracy, "train_loss": losses, "bytes_sent_per_step": float(np.mean(sent)),
            "union_density": _mean(union)}


def run_worker(args: argparse.Namespace) -> None:
    """One rank of a job (``--ddp``: of a torchrun job, over Gloo): every (seed, compressor); rank
    0 writes the curves to ``--results``."""
    import torch

    torch.set_num_threads(1)
    if args.ddp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()
    rows = []
    for seed in args.seeds:
        for spec in args.compressors:
            rows.append(train_curve(spec, seed, args))
            if rank == 0:
                print(f"{TRAINED}{rows[-1]['compressor']} seed={seed}: accuracy {rows[-1]['accuracy'][-1]:.4f}",
                      flush=True)
    if rank == 0:
        write_results(args.results, "convergence-job", rows, command_line(None, "benchmarks.main_job.convergence"))
    if args.ddp:
        from horovod_sparse.ddp import exit_job

        exit_job()


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    """The mean of ``values``; None where any is None (a figure the configuration has not)."""
    return None if any(v is None for v in values) else float(np.mean(values))


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (workers, compressor): final accuracy over seeds, its difference to dense Horovod
    (``none``) and, for the DDP job's rows, to dense DDP (``ddp none``; None for the others)."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["workers"], row["compressor"]), []).append(row)
    summary = []
    for (workers, spec), runs in groups.items():
        final = [r["accuracy"][-1] for r in runs]
        summary.append({"workers": workers, "compressor": spec, "seeds": len(runs),
                        "accuracy_mean": float(np.mean(final)), "accuracy_std": float(np.std(final)),
                        "curve_mean": np.mean([r["accuracy"] for r in runs], axis=0).tolist(),
                        "bytes_sent_per_step": float(np.mean([r["bytes_sent_per_step"] for r in runs])),
                        "union_density": _mean([r["union_density"] for r in runs])})

    def points_over(row: Dict[str, Any], dense: str) -> float:
        base = next(s for s in summary if s["workers"] == row["workers"] and s["compressor"] == dense)
        return 100 * (row["accuracy_mean"] - base["accuracy_mean"])

    for row in summary:
        row["vs_dense_points"] = points_over(row, "none")
        row["vs_dense_ddp_points"] = (points_over(row, DDP_PREFIX + "none") if row["compressor"].startswith(DDP_PREFIX)
                                      else None)
    return summary


def table(summary: Sequence[Dict[str, Any]]) -> str:
    """The printed table: one line per row of :func:`summarize`; a figure a row has not is blank."""
    def figure(value: Optional[float], form: str, width: int) -> str:
        return f"{value:{form}}" if value is not None else " " * width

    head = (f"{'workers':>7} {'compressor':30s} {'accuracy':>9} {'+-':>6} {'vs dense (points)':>18} "
            f"{'vs dense DDP':>12} {'bytes sent/step':>16} {'union density':>13}")
    lines = [head, "-" * len(head)]
    for s in summary:
        lines.append(f"{s['workers']:>7} {s['compressor'][:30]:30s} {100 * s['accuracy_mean']:8.2f}% "
                     f"{100 * s['accuracy_std']:6.2f} {s['vs_dense_points']:+18.2f} "
                     f"{figure(s['vs_dense_ddp_points'], '+12.2f', 12)} {s['bytes_sent_per_step']:16.0f} "
                     f"{figure(s['union_density'], '13.5f', 13)}")
    return "\n".join(lines)


def launch(workers: int, compressors: Sequence[str], ddp: bool, args: argparse.Namespace, results: Path,
           progress: Progress) -> List[Dict[str, Any]]:
    """One job of ``workers`` ranks training ``compressors`` (``ddp``: a ``torchrun`` job of DDP
    configurations, else a ``horovodrun`` one); progress follows rank 0's lines."""
    argv = [sys.executable, "-m", "benchmarks.main_job.convergence", "--worker", "--results", str(results),
            "--compressors", *compressors, "--seeds", *map(str, args.seeds), "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--hidden", str(args.hidden),
            *(["--ddp"] if ddp else [])]

    def follow(line: str) -> None:
        if line.startswith(TRAINED):
            progress.done(f"n={workers}", line[len(TRAINED):])

    (torchrun if ddp else horovodrun)(workers, argv, follow)
    return read_results(results)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--methods", nargs="+", help="methods (default: every one with a torch implementation)")
    parser.add_argument("--compressors", nargs="+", help="explicit compressor specs (overrides --methods/--density)")
    parser.add_argument("--ddp", action="store_true",
                        help="also train dense DDP, PyTorch's PowerSGD hook and the methods through "
                             "horovod_sparse.ddp, in a torchrun job after each Horovod job")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD's matrix_approximation_rank")
    parser.add_argument("--powersgd-start", type=int, default=2,
                        help="PowerSGD's start_powerSGD_iter: dense allreduce before that step (at least 2)")
    add_arguments(parser, seeds=[0, 1, 2], epochs=20, name="convergence")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    if args.compressors is None:
        from benchmarks.emulated.synthetic import available_methods

        args.compressors = ["none"] + [f"{m}:density={args.density}" for m in args.methods or available_methods()]
    elif "none" not in args.compressors:
        args.compressors = ["none", *args.compressors]
    jobs = [(False, args.compressors)]
    if args.ddp:
        powersgd = f"{POWERSGD}:rank={args.powersgd_rank},start={args.powersgd_start}"
        jobs.append((True, ["none", powersgd, *(c for c in args.compressors if c != "none")]))
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hs-convergence-") as tmp, \
            Progress(len(args.workers) * len(args.seeds) * sum(len(c) for _, c in jobs), "convergence") as progress:
        for workers in args.workers:
            for ddp, compressors in jobs:
                results = Path(tmp, f"np{workers}{'-ddp' if ddp else ''}.json")
                rows += launch(workers, compressors, ddp, args, results, progress)
    summary = summarize(rows)
    print(table(summary))
    command = command_line(argv, "benchmarks.main_job.convergence")
    path = write_results(args.out / f"{args.name}.json", "convergence",
                         {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "summary": summary,
                          "runs": rows}, command)
    panels = {f"{n} workers": {s["compressor"]: (range(1, args.epochs + 1), [100 * a for a in s["curve_mean"]])
                               for s in summary if s["workers"] == n} for n in args.workers}
    figure = plots.curves(args.out / f"{args.name}.png",
                          f"digits MLP, test accuracy (mean of {len(args.seeds)} seeds)", panels, "epoch",
                          "test accuracy (%)")
    print(f"wrote {path}\nwrote {figure}")


if __name__ == "__main__":
    main()
