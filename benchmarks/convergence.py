"""Convergence on real data: every method against dense Horovod at equal epochs, on scikit-learn's
bundled digits (1797 8x8 images, no download), with 2 and 4 workers.

    python -m benchmarks.convergence --workers 2 4 --density 0.01 --epochs 20 --seeds 0 1 2

For each worker count one ``horovodrun --gloo`` job trains the digits MLP once per (seed,
compressor): dense (``none``) and every method with a torch implementation at ``--density``, with
the same data split, per-worker batch, learning rate and epochs; the seed sets the initial weights
and the batch order. Test accuracy is taken after every epoch. Prints a table of final accuracy
(mean and spread over seeds) and its difference to dense in points; writes
``<out>/<name>.json`` and ``<out>/<name>.png`` (test-accuracy curves, one panel per worker
count). The target of the project: within 1 point of dense at density 0.01.

``--worker`` is the mode the jobs run in (one rank of the job).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from benchmarks import plots
from benchmarks.digits_training import DigitsJob, add_arguments
from benchmarks.results import Progress, command_line, read_results, write_results


def train_curve(spec: str, seed: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Train the digits MLP with compressor ``spec`` on this rank's shard; test accuracy per epoch."""
    import horovod.torch as hvd

    job = DigitsJob(spec, hidden=args.hidden, lr=args.lr, batch_size=args.batch_size, model_seed=seed, split_seed=0)
    accuracy, losses, sent, union = [], [], [], []
    epoch_loss = 0.0
    for step in job.steps(args.epochs, order_seed=seed * 1000 + hvd.rank()):
        epoch_loss += float(step.loss)
        sent.append(job.opt.last_stats.bytes_sent())
        union.append(job.opt.last_stats.union_density)
        if step.step == job.steps_per_epoch - 1:
            accuracy.append(job.test_accuracy())
            losses.append(epoch_loss / job.steps_per_epoch)
            epoch_loss = 0.0
    return {"compressor": spec, "seed": seed, "workers": hvd.size(), "accuracy": accuracy, "train_loss": losses,
            "bytes_sent_per_step": float(np.mean(sent)), "union_density": float(np.mean(union))}


def run_worker(args: argparse.Namespace) -> None:
    """One rank of a job: every (seed, compressor); rank 0 writes the curves to ``--results``."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    rows = []
    for seed in args.seeds:
        for spec in args.compressors:
            rows.append(train_curve(spec, seed, args))
            if hvd.rank() == 0:
                print(f"trained {spec} seed={seed}: accuracy {rows[-1]['accuracy'][-1]:.4f}", flush=True)
    if hvd.rank() == 0:
        write_results(args.results, "convergence-job", rows, command_line(None, "benchmarks.convergence"))


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (workers, compressor): final accuracy over seeds and the difference to dense."""
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
                        "union_density": float(np.mean([r["union_density"] for r in runs]))})
    for row in summary:
        dense = next(s for s in summary if s["workers"] == row["workers"] and s["compressor"] == "none")
        row["vs_dense_points"] = 100 * (row["accuracy_mean"] - dense["accuracy_mean"])
    return summary


def table(summary: Sequence[Dict[str, Any]]) -> str:
    head = (f"{'workers':>7} {'compressor':30s} {'accuracy':>9} {'+-':>6} {'vs dense (points)':>18} "
            f"{'bytes sent/step':>16} {'union density':>13}")
    lines = [head, "-" * len(head)]
    for s in summary:
        lines.append(f"{s['workers']:>7} {s['compressor'][:30]:30s} {100 * s['accuracy_mean']:8.2f}% "
                     f"{100 * s['accuracy_std']:6.2f} {s['vs_dense_points']:+18.2f} {s['bytes_sent_per_step']:16.0f} "
                     f"{s['union_density']:13.5f}")
    return "\n".join(lines)


def launch(workers: int, compressors: Sequence[str], args: argparse.Namespace, results: Path,
           progress: Progress) -> List[Dict[str, Any]]:
    """One ``horovodrun`` job for ``workers`` ranks; progress follows rank 0's lines."""
    horovodrun = str(Path(sys.executable).with_name("horovodrun"))
    argv = [horovodrun, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo",
            sys.executable, "-m", "benchmarks.convergence", "--worker", "--results", str(results),
            "--compressors", *compressors, "--seeds", *map(str, args.seeds), "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--hidden", str(args.hidden)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                         os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    assert process.stdout is not None
    for line in process.stdout:
        output.append(line)
        if "trained " in line:
            progress.done(f"n={workers}", line.split("trained ", 1)[1].strip())
    if process.wait() != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {process.returncode}:\n{''.join(output[-60:])}")
    return read_results(results)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--methods", nargs="+", help="methods (default: every one with a torch implementation)")
    parser.add_argument("--compressors", nargs="+", help="explicit compressor specs (overrides --methods/--density)")
    add_arguments(parser, seeds=[0, 1, 2], epochs=20, name="convergence")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    if args.compressors is None:
        from benchmarks.synthetic import available_methods

        args.compressors = ["none"] + [f"{m}:density={args.density}" for m in args.methods or available_methods()]
    elif "none" not in args.compressors:
        args.compressors = ["none", *args.compressors]
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hs-convergence-") as tmp, \
            Progress(len(args.workers) * len(args.seeds) * len(args.compressors), "convergence") as progress:
        for workers in args.workers:
            rows += launch(workers, args.compressors, args, Path(tmp, f"np{workers}.json"), progress)
    summary = summarize(rows)
    print(table(summary))
    command = command_line(argv, "benchmarks.convergence")
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
