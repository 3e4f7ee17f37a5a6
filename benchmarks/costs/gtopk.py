"""gTop-k against Top-k's allgather and dense Horovod: bytes per rank for n = 2, 4, 8, and the
recall of the global set on real gradients with its effect on accuracy.

    python -m benchmarks.costs.gtopk --workers 2 4 8 --density 0.01 --epochs 20

One ``horovodrun --gloo`` job per worker count (more workers than cores is fine: nothing here is
a timing). Every job measures:

1. **traffic**, on one flat parameter of ``--numel`` elements with random gradients, for dense
   (``none``), ``topk`` and ``gtopk`` at ``--density`` (both sparse methods on the same single
   group, so both send ``k`` coordinates per rank and differ only in the exchange):

   * *payload* bytes per step per rank, sent and received, from the optimizer's statistics (the
     sizes of the tensors handed to Horovod's collectives and returned by them);
   * *wire* bytes per step per rank: what the process wrote to its sockets during the step
     (``wchar`` of ``/proc/self/io``), so it includes what the transport forwards (a ring
     allgather relays the other ranks' chunks) and Horovod's coordination messages. Those are
     written every cycle, even idle (their rate, measured over ``--idle-seconds`` of sleep, is
     reported); the jobs run with ``HOROVOD_CYCLE_TIME`` = ``--cycle-time-ms`` (20 ms rather than
     1 ms) to keep them to a few hundred bytes per step;
   * the cost model of ALGORITHMS.md in bytes: dense ``2(n-1)/n * 4d``, allgather
     ``2(n-1) * 4k``, gTop-k ``2 * 4k * log2(n)`` (one float32 value and one int32 index per
     coordinate).

2. **recall and accuracy** on scikit-learn's digits (the MLP of the main job): dense, ``topk``
   (one group) and ``gtopk`` with ``recall_every=1`` (one extra dense allreduce per step, only in
   this benchmark) trained with the same split, per-worker batch, learning rate and epochs. Per
   method: final test accuracy (mean over ``--seeds``); for gTop-k the recall of the global set
   against the exact top-k of the sum over ranks of ``g + e`` (share of its coordinates) at the
   first step, over the first and the last epoch and over all steps, and the share of that
   top-k's magnitude the global set covers; the density that reached the model over the target
   (Top-k's build-up; gTop-k's is 1).

Writes ``<out>/<name>.json``. ``--worker`` is the mode the jobs run in (one rank of a job).
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from benchmarks.main_job.digits_training import DigitsJob, add_arguments, distributed_sgd
from benchmarks.shared.results import command_line, read_results, write_results

METHODS = ("none", "topk", "gtopk")


def specs(density: float, recall: bool) -> List[str]:
    """Compressor specs of the three methods at ``density`` (gTop-k measures recall if asked)."""
    return ["none", f"topk:density={density},min_numel=0",
            f"gtopk:density={density},min_numel=0" + (",recall_every=1" if recall else "")]


def model_bytes(method: str, workers: int, numel: int, k: int) -> float:
    """Bytes per rank per step on the wire under the cost model (float32 values, int32 indices)."""
    if method == "none":
        return 2 * (workers - 1) / workers * 4 * numel
    if method == "topk":
        return 2 * (workers - 1) * 4 * k
    return 2 * 4 * k * math.log2(workers)


# -- one rank of a job -------------------------------------------------------------------------------
def written_bytes() -> int:
    """Bytes this process has written so far (files and sockets): ``wchar`` of /proc/self/io."""
    with open("/proc/self/io", encoding="ascii") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


def groups_of(spec: str) -> Optional[str]:
    """Sparse methods take the model as one group; dense Horovod keeps its default."""
    from horovod_sparse.common.registry import parse_spec

    return None if parse_spec(spec)[0] == "none" else "model"


def measure_traffic(spec: str, args: argparse.Namespace) -> Dict[str, Any]:
    """Bytes per step on this rank for one method on a flat parameter with random gradients,
    and the idle coordination traffic (bytes/s written while sleeping)."""
    import horovod.torch as hvd
    import torch

    model = torch.nn.Linear(args.numel, 1, bias=False)
    opt = distributed_sgd(spec, model, lr=0.0, groups=groups_of(spec))
    generator = torch.Generator().manual_seed(hvd.rank())
    payload_sent, payload_received, wire = [], [], []
    for step in range(args.warmup_steps + args.traffic_steps):
        gradient = torch.randn(1, args.numel, generator=generator)
        if step == args.warmup_steps:
            start = written_bytes()
            time.sleep(args.idle_seconds)
            idle_rate = (written_bytes() - start) / args.idle_seconds
        opt.zero_grad()
        before = written_bytes()
        (model.weight * gradient).sum().backward()
        opt.step()
        if step >= args.warmup_steps:
            wire.append(written_bytes() - before)
            payload_sent.append(opt.last_stats.bytes_sent())
            payload_received.append(opt.last_stats.bytes_received())
    return {"compressor": spec, "method": spec.split(":")[0], "rank": hvd.rank(), "workers": hvd.size(),
            "numel": args.numel, "target": opt.last_stats.groups[0].target,
            "payload_sent": float(np.mean(payload_sent)), "payload_received": float(np.mean(payload_received)),
            "wire_sent": float(np.mean(wire)), "idle_bytes_per_s": idle_rate}


def train_digits(spec: str, seed: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Train the digits MLP with ``spec``; final test accuracy and per-step recall / build-up."""
    import horovod.torch as hvd

    job = DigitsJob(spec, hidden=args.hidden, lr=args.lr, batch_size=args.batch_size, model_seed=seed, split_seed=0,
                    groups=groups_of(spec))
    recall, recall_mass, build_up = [], [], []
    for _ in job.steps(args.epochs, order_seed=seed * 1000 + hvd.rank()):
        if spec != "none":
            (group,) = job.opt.last_stats.groups
            build_up.append(group.union / group.target)
            if "recall" in group.extra:
                recall.append(group.extra["recall"])
                recall_mass.append(group.extra["recall_mass"])
    return {"compressor": spec, "method": spec.split(":")[0], "seed": seed, "workers": hvd.size(),
            "accuracy": job.test_accuracy(), "steps_per_epoch": job.steps_per_epoch, "recall": recall,
            "recall_mass": recall_mass, "build_up": float(np.mean(build_up)) if build_up else 1.0}


def run_worker(args: argparse.Namespace) -> None:
    """One rank: traffic of every method, then the digits runs; rank 0 writes ``--results``."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    traffic = [measure_traffic(spec, args) for spec in specs(args.density, recall=False)]
    traffic = [row for rows in hvd.allgather_object(traffic, name="gtopk.traffic") for row in rows]
    training = []
    for seed in args.seeds:
        for spec in specs(args.density, recall=True):
            training.append(train_digits(spec, seed, args))
            if hvd.rank() == 0:
                print(f"trained {spec} seed={seed}: accuracy {training[-1]['accuracy']:.4f}", flush=True)
    if hvd.rank() == 0:
        write_results(args.results, "gtopk-job", {"traffic": traffic, "training": training},
                      command_line(None, "benchmarks.costs.gtopk"))


# -- the driver ----------------------------------------------------------------------------------------
def launch(workers: int, args: argparse.Namespace, results: Path) -> Dict[str, Any]:
    """One ``horovodrun --gloo`` job of ``workers`` ranks running this module with ``--worker``."""
    horovodrun = str(Path(sys.executable).with_name("horovodrun"))
    argv = [horovodrun, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo",
            sys.executable, "-m", "benchmarks.costs.gtopk", "--worker", "--results", str(results),
            "--density", str(args.density), "--numel", str(args.numel), "--epochs", str(args.epochs),
            "--seeds", *map(str, args.seeds), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
            "--hidden", str(args.hidden), "--traffic-steps", str(args.traffic_steps),
            "--warmup-steps", str(args.warmup_steps), "--idle-seconds", str(args.idle_seconds)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               HOROVOD_CYCLE_TIME=str(args.cycle_time_ms),
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH")])))
    result = subprocess.run(argv, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout[-4000:]}"
                           f"\n{result.stderr[-4000:]}")
    return read_results(results)


def summarize_traffic(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (workers, method): bytes per step per rank, mean and max over ranks, and the model."""
    summary = []
    for workers in sorted({r["workers"] for r in rows}):
        for method in METHODS:
            ranks = [r for r in rows if r["workers"] == workers and r["method"] == method]
            k = ranks[0]["target"]
            summary.append({
                "workers": workers, "method": method, "numel": ranks[0]["numel"], "k": k,
                "payload_sent": float(np.mean([r["payload_sent"] for r in ranks])),
                "payload_received": float(np.mean([r["payload_received"] for r in ranks])),
                "wire_sent_mean": float(np.mean([r["wire_sent"] for r in ranks])),
                "wire_sent_max": float(np.max([r["wire_sent"] for r in ranks])),
                "idle_bytes_per_s": float(np.mean([r["idle_bytes_per_s"] for r in ranks])),
                "model": model_bytes(method, workers, ranks[0]["numel"], k)})
    return summary


def summarize_training(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (workers, method): accuracy over seeds, recall and build-up, difference to dense."""
    summary = []
    for workers in sorted({r["workers"] for r in rows}):
        dense = np.mean([r["accuracy"] for r in rows if r["workers"] == workers and r["method"] == "none"])
        for method in METHODS:
            runs = [r for r in rows if r["workers"] == workers and r["method"] == method]
            measured = [r for r in runs if r["recall"]]
            epoch = runs[0]["steps_per_epoch"]
            summary.append({
                "workers": workers, "method": method, "compressor": runs[0]["compressor"], "seeds": len(runs),
                "accuracy": float(np.mean([r["accuracy"] for r in runs])),
                "vs_dense_points": 100 * float(np.mean([r["accuracy"] for r in runs]) - dense),
                "recall_step0": _mean([r["recall"][0] for r in measured]),
                "recall_first_epoch": _mean([x for r in measured for x in r["recall"][:epoch]]),
                "recall_last_epoch": _mean([x for r in measured for x in r["recall"][-epoch:]]),
                "recall_mean": _mean([x for r in measured for x in r["recall"]]),
                "recall_mass_mean": _mean([x for r in measured for x in r["recall_mass"]]),
                "build_up": float(np.mean([r["build_up"] for r in runs]))})
    return summary


def _mean(values: Sequence[float]) -> Optional[float]:
    return float(np.mean(values)) if values else None


def traffic_table(summary: Sequence[Dict[str, Any]]) -> str:
    head = (f"{'workers':>7} {'method':7} {'k':>7} {'payload sent':>13} {'payload recv':>13} "
            f"{'wire sent (mean)':>17} {'wire sent (max)':>16} {'cost model':>11} {'idle B/s':>9}")
    lines = ["bytes per step per rank", head, "-" * len(head)]
    for s in summary:
        lines.append(f"{s['workers']:>7} {s['method']:7} {s['k']:>7} {s['payload_sent']:13.0f} "
                     f"{s['payload_received']:13.0f} {s['wire_sent_mean']:17.0f} {s['wire_sent_max']:16.0f} "
                     f"{s['model']:11.0f} {s['idle_bytes_per_s']:9.0f}")
    return "\n".join(lines)


RECALL_COLUMNS = ("recall_step0", "recall_first_epoch", "recall_last_epoch", "recall_mean", "recall_mass_mean")


def training_table(summary: Sequence[Dict[str, Any]]) -> str:
    head = (f"{'workers':>7} {'method':7} {'accuracy':>9} {'vs dense':>9} {'recall: step 0':>15} {'1st epoch':>10} "
            f"{'last epoch':>11} {'all steps':>10} {'magnitude':>10} {'union/k':>8}")
    lines = ["digits MLP: test accuracy (vs dense in points); gTop-k's recall of the exact top-k of the sum "
             "(share of coordinates; magnitude: share of its |sum| covered); density reaching the model / target",
             head, "-" * len(head)]
    for s in summary:
        recall = " ".join(f"{s[c]:{w}.3f}" if s[c] is not None else " " * w
                          for c, w in zip(RECALL_COLUMNS, (15, 10, 11, 10, 10)))
        lines.append(f"{s['workers']:>7} {s['method']:7} {100 * s['accuracy']:8.2f}% {s['vs_dense_points']:+9.2f} "
                     f"{recall} {s['build_up']:8.2f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--numel", type=int, default=1_000_000, help="elements of the traffic run's parameter")
    parser.add_argument("--traffic-steps", type=int, default=10, help="measured steps per method")
    parser.add_argument("--warmup-steps", type=int, default=3, help="unmeasured steps before them")
    parser.add_argument("--idle-seconds", type=float, default=1.0, help="window of the idle-traffic rate")
    parser.add_argument("--cycle-time-ms", type=float, default=20.0,
                        help="HOROVOD_CYCLE_TIME of the jobs: Horovod's coordination writes a few hundred "
                             "bytes per cycle even when idle (about 150 kB/s per rank at the default 1 ms), "
                             "which would swamp the wire figures")
    add_arguments(parser, seeds=[0], epochs=20, name="gtopk")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    traffic: List[Dict[str, Any]] = []
    training: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hs-gtopk-") as tmp:
        for workers in args.workers:
            started = time.monotonic()
            job = launch(workers, args, Path(tmp, f"np{workers}.json"))
            traffic += job["traffic"]
            training += job["training"]
            print(f"[gtopk] n={workers} done in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    results = {"density": args.density, "epochs": args.epochs, "seeds": args.seeds,
               "traffic": summarize_traffic(traffic), "training": summarize_training(training),
               "runs": {"traffic": traffic, "training": training}}
    print(traffic_table(results["traffic"]))
    print()
    print(training_table(results["training"]))
    path = write_results(args.out / f"{args.name}.json", "gtopk", results, command_line(argv, "benchmarks.costs.gtopk"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
