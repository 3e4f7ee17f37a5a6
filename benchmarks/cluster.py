"""Throughput and scaling efficiency of dense Horovod and every sparse method on an emulated slow
cluster: workers in network namespaces joined by links shaped with ``tc tbf`` (see
:mod:`benchmarks.netem`; needs root).

    python -m benchmarks.cluster --model vgg --batch-size 16 --workers 2 4 \\
        --rates 1gbit 10gbit --densities 0.001 0.01

For every (rate, worker count) the cluster is built, one link is measured (bulk TCP bandwidth and
ping-pong latency), and one Horovod job over Gloo runs :mod:`benchmarks.synthetic` through:
``local`` (each worker trains without any exchange), dense (``none``) and each method at each
density, one after the other in the same job, so every figure of a row of the table is measured
side by side with its baselines (``--repeats R`` runs the whole sweep R times in turn and keeps
the median throughput of each configuration, so a load spike of a shared machine does not
decide a ratio). Then the namespaces are removed.

Columns: images/s per worker and in total (Horovod's figures), *speed-up* = throughput / dense
throughput of the same job, *efficiency* = throughput / ``local`` throughput of the same job.
The workers share this machine's cores, so the compute-only baseline is measured with the same
sharing; efficiency is then the fraction of the compute-only speed that survives communication,
which is what an n-host cluster with the same links would see per host.

A job that fails part-way keeps the rows measured before the failure (the error is recorded in
the result file and the command exits non-zero at the end). Writes ``<out>/<name>.json`` (after
every job, so a long run keeps what it measured) and
``<out>/<name>_speedup.png``, ``<out>/<name>_efficiency.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from benchmarks import plots
from benchmarks.netem import EmulatedCluster, measure_link, run_horovod
from benchmarks.results import RESULTS_DIR, Progress, command_line, read_results, write_results
from benchmarks.synthetic import available_methods


def sweep(methods: Sequence[str], densities: Sequence[float]) -> List[Dict[str, Any]]:
    """The configurations of one job: compute-only, dense, then every method at every density."""
    return ([{"optimizer": "local"}, {"compressor": "none"}]
            + [{"compressor": m, "density": d} for m in methods for d in densities])


def merge_repeats(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per configuration label: the throughput is the median over the repeats (the row
    closest to it supplies the statistics), the repeats' totals are kept in ``repeats``."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["label"], []).append(row)
    merged = []
    for runs in groups.values():
        totals = [r["total_img_sec"] for r in runs]
        median = float(np.median(totals))
        row = dict(min(runs, key=lambda r: abs(r["total_img_sec"] - median)))
        row.update(total_img_sec=median, img_sec_per_worker=median / row["workers"], repeats=totals,
                   step_seconds=row["batch_size"] * row["workers"] / median)
        merged.append(row)
    return merged


def add_ratios(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Speed-up over dense and efficiency against compute-only, within one job's rows."""
    local = next(r for r in rows if r["optimizer"] == "local")["total_img_sec"]
    dense = next(r for r in rows if r["optimizer"] == "hs" and r["compressor"] == "none")["total_img_sec"]
    for row in rows:
        row["speedup_vs_dense"] = row["total_img_sec"] / dense
        row["efficiency"] = row["total_img_sec"] / local
    return rows


def table(rows: Sequence[Dict[str, Any]]) -> str:
    """The human-readable table of all rows."""
    head = (f"{'n':>2} {'rate':>7} {'compressor':28s} {'img/s/worker':>12} {'total img/s':>11} {'vs dense':>8} "
            f"{'efficiency':>10} {'sent/step':>10} {'select ms':>9} {'comm ms':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        stats = r.get("stats") or {}
        seconds = stats.get("seconds", {})
        sent = f"{stats['bytes_sent'] / 1e6:.2f} MB" if stats else "-"
        lines.append(f"{r['workers']:>2} {r['rate']:>7} {r['label'][:28]:28s} {r['img_sec_per_worker']:12.2f} "
                     f"{r['total_img_sec']:11.2f} {r['speedup_vs_dense']:8.2f} {r['efficiency']:10.2f} "
                     f"{sent:>10} {1e3 * seconds.get('select', 0):9.1f} {1e3 * seconds.get('communicate', 0):8.1f}")
    return "\n".join(lines)


def plot(rows: Sequence[Dict[str, Any]], out: Path, name: str, model: str) -> List[Path]:
    """Speed-up and efficiency bars, one panel per (workers, rate)."""
    panels: Dict[str, Dict[str, Dict[str, float]]] = {"speedup_vs_dense": {}, "efficiency": {}}
    for r in rows:
        if r["optimizer"] == "local":
            continue
        panel = f"n={r['workers']}, {r['rate']}"
        for key in panels:
            panels[key].setdefault(panel, {})[r["label"]] = r[key]
    return [plots.grouped_bars(out / f"{name}_speedup.png", f"{model}: throughput / dense throughput",
                               panels["speedup_vs_dense"], "speed-up over dense", reference=1.0),
            plots.grouped_bars(out / f"{name}_efficiency.png", f"{model}: throughput / compute-only throughput",
                               panels["efficiency"], "scaling efficiency", reference=1.0)]


def run_job(args: argparse.Namespace, workers: int, rate: Optional[str], configs: List[Dict[str, Any]],
            progress: Progress) -> Dict[str, Any]:
    """Build the cluster, measure a link, run the sweep; returns the link and the rows."""
    with tempfile.TemporaryDirectory(prefix="hs-cluster-") as tmp, EmulatedCluster(workers, rate) as cluster:
        link = measure_link(cluster).as_dict() if workers > 1 else None
        sweep_file, result_file = Path(tmp, "sweep.json"), Path(tmp, "rows.json")
        sweep_file.write_text(json.dumps(configs))
        argv = [sys.executable, "-m", "benchmarks.synthetic", "--model", args.model,
                "--batch-size", str(args.batch_size), "--num-warmup-batches", str(args.num_warmup_batches),
                "--num-batches-per-iter", str(args.num_batches_per_iter), "--num-iters", str(args.num_iters),
                "--sweep", str(sweep_file), "--results", str(result_file)]
        if args.size:
            argv += ["--size", str(args.size)]
        if args.groups is not None:
            argv += ["--groups", str(args.groups)]
        where = f"n={workers} {rate or 'unshaped'}"
        label = ""

        def follow(line: str) -> None:
            nonlocal label
            if line.startswith("Compressor: "):
                label = line.split(": ", 1)[1]
                progress.starting(f"{where} {label}")
            elif line.startswith("Total img/sec"):
                progress.done(f"{where} {label}", line)

        error = None
        try:
            run_horovod(cluster, argv, timeout=args.timeout, on_line=follow)
        except RuntimeError as failure:  # keep what was measured before it; report the rest
            error = f"n={workers} {rate}: {label} failed: {str(failure)[-2000:]}"
            print(error, file=sys.stderr)
        rows = read_results(result_file) if result_file.exists() else []
    for row in rows:
        row.update(rate=rate or "unshaped", link=link)
    complete = any(r["optimizer"] == "local" for r in rows) and any(r["compressor"] == "none" for r in rows)
    return {"link": link, "rows": add_ratios(merge_repeats(rows)) if complete else [], "error": error}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, help="image side / sequence length (default: the model's)")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"],
                        help="tc rates of the links (1gbit, 10gbit, 100mbit, ...) or 'unshaped'")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    parser.add_argument("--methods", nargs="+", help="methods to run (default: every one with a torch "
                        "implementation now)")
    parser.add_argument("--groups", help="grouping passed to every method (--groups of benchmarks.synthetic)")
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole sweep this many times in the job (interleaved); report medians")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="cluster", help="result file name stem")
    args = parser.parse_args(argv)
    methods = args.methods or available_methods()
    configs = sweep(methods, args.densities) * args.repeats
    jobs = [(n, None if rate == "unshaped" else rate) for rate in args.rates for n in args.workers]
    rows: List[Dict[str, Any]] = []
    links: List[Dict[str, Any]] = []
    errors: List[str] = []
    command = command_line(argv, "benchmarks.cluster")
    with Progress(len(jobs) * len(configs), "cluster") as progress:
        for workers, rate in jobs:
            job = run_job(args, workers, rate, configs, progress)
            rows += job["rows"]
            if job["link"]:
                links.append({"workers": workers, **job["link"]})
            if job["error"]:
                errors.append(job["error"])
            write_results(args.out / f"{args.name}.json", "cluster",
                          {"model": args.model, "batch_size": args.batch_size, "links": links, "rows": rows,
                           "errors": errors}, command)
    print(table(rows))
    for link in links:
        print(f"link at {link['rate']} (n={link['workers']}): {link['bits_per_second'] / 1e9:.3f} Gbit/s, "
              f"latency {1e6 * link['latency_seconds']:.1f} us")
    for path in plot(rows, args.out, args.name, args.model):
        print(f"wrote {path}")
    print(f"wrote {args.out / (args.name + '.json')}")
    if errors:
        sys.exit(f"{len(errors)} job(s) failed part-way (their rows up to the failure are kept):\n" + "\n".join(errors))


if __name__ == "__main__":
    main()
