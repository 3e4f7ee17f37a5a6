"""Throughput and scaling efficiency of dense Horovod and every sparse method on an emulated slow
cluster: workers in network namespaces joined by links shaped with ``tc tbf`` (see
:mod:`benchmarks.emulated.netem`; needs root).

    python -m benchmarks.emulated.cluster --model vgg --batch-size 16 --workers 2 4 \\
        --rates 1gbit 10gbit --densities 0.001 0.01
    python -m benchmarks.emulated.cluster --model vgg --batch-size 16 --workers 4 --workers-per-host 2 \\
        --rates 1gbit --densities 0.001 0.01

For every (rate, worker count) the cluster is built, one link is measured (bulk TCP bandwidth and
ping-pong latency), and one Horovod job over Gloo runs :mod:`benchmarks.emulated.synthetic` through:
``local`` (each worker trains without any exchange), dense (``none``) and each method at each
density, one after the other in the same job, so every figure of a row of the table is measured
side by side with its baselines (``--repeats R`` runs the whole sweep R times in turn and keeps
the median throughput of each configuration, so a load spike of a shared machine does not
decide a ratio). With ``--workers-per-host L`` the ``n`` workers run as ``n / L`` hosts of ``L``
(:class:`~benchmarks.emulated.netem.EmulatedCluster`: unshaped inside a host, the shaped link between
hosts), and on more than one host each method at each density runs twice in a row: flat, then
two-tier (``hierarchical=True``: dense inside the host, the method across hosts; rows labelled
``... two-tier``). With ``--ddp``, a ``torch.distributed`` job on the same cluster then runs
:mod:`benchmarks.emulated.synthetic_ddp` through dense DDP (PyTorch's bucket allreduce), PyTorch's
PowerSGD hook (rank 4) and each method at each density through ``horovod_sparse.ddp.hook``
(rows labelled ``ddp ...``). With ``--fsdp``, another ``torch.distributed`` job runs
:mod:`benchmarks.emulated.synthetic_fsdp`: FSDP2 sharded inside each host (``--workers-per-host``),
its replicas averaged by FSDP's own HSDP (``fsdp none``) or by each method at each density
through ``horovod_sparse.fsdp`` (rows labelled ``fsdp ...``). Then the namespaces are removed.

Columns: images/s per worker and in total (Horovod's figures), *speed-up* (``vs dense``) =
throughput / dense throughput of the same job (dense Horovod, dense DDP for the DDP rows, HSDP
for the FSDP rows),
``vs hvd`` = throughput / dense Horovod throughput, ``vs flat`` = a two-tier row's throughput /
its flat twin's, *efficiency* = throughput / ``local`` throughput (of the Horovod job; no
exchange, so the same for DDP); bytes sent per step per worker across hosts (the whole network
when flat) and inside the host (two-tier).
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks.emulated.netem import EmulatedCluster, JobOutput, measure_link, run_horovod, run_torch_distributed
from benchmarks.emulated.synthetic import available_methods
from benchmarks.emulated.synthetic_ddp import POWERSGD_START_ITER
from benchmarks.shared import plots
from benchmarks.shared.results import RESULTS_DIR, Progress, command_line, read_results, write_results
from benchmarks.shared.tiers import tier_bytes


def _methods(methods: Sequence[str], densities: Sequence[float]) -> List[Dict[str, Any]]:
    return [{"compressor": m, "density": d} for m in methods for d in densities]


def sweep(methods: Sequence[str], densities: Sequence[float], two_tier: bool = False) -> List[Dict[str, Any]]:
    """The configurations of one job: compute-only, dense, then every method at every density;
    with ``two_tier``, each of those followed by its two-tier twin (``"hierarchical": true``)."""
    tiers = [{}, {"hierarchical": True}] if two_tier else [{}]
    return [{"optimizer": "local"}, {"compressor": "none"}] + [{**c, **t} for c in _methods(methods, densities)
                                                             for t in tiers]


def ddp_sweep(methods: Sequence[str], densities: Sequence[float]) -> List[Dict[str, Any]]:
    """The configurations of one DDP job (:mod:`benchmarks.emulated.synthetic_ddp`): dense DDP, PyTorch's
    PowerSGD, then every method at every density through horovod_sparse's comm hook."""
    return [{"compressor": "none"}, {"compressor": "powersgd"}] + _methods(methods, densities)


def fsdp_sweep(methods: Sequence[str], densities: Sequence[float]) -> List[Dict[str, Any]]:
    """The configurations of one FSDP2 job (:mod:`benchmarks.emulated.synthetic_fsdp`): FSDP's dense HSDP,
    then every method at every density on the replica axis."""
    return [{"compressor": "none"}] + _methods(methods, densities)


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


def frontend(row: Dict[str, Any]) -> str:
    """The front end a row was measured with: ``ddp``, ``fsdp``, or ``horovod`` (rows that do not
    say)."""
    return row.get("frontend", "horovod")


def method_key(row: Dict[str, Any]) -> str:
    """What a row ran, whatever the tier (equal for a two-tier row and its flat twin): front
    end, optimizer, compressor, options, grouping."""
    return json.dumps([frontend(row), row["optimizer"], row["compressor"], row.get("options"), row.get("groups")],
                      sort_keys=True, default=str)


def add_ratios(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Within one (workers, rate)'s rows: speed-up over the dense row of the same front end
    (dense Horovod, or DDP's own allreduce), speed-up over dense Horovod, efficiency against
    compute-only (Horovod's ``local`` row: no exchange, whatever the front end), and for a
    two-tier row (``hierarchical``) ``speedup_vs_flat``, over the flat row of the same
    configuration (None without one)."""
    local = next(r for r in rows if r["optimizer"] == "local")["total_img_sec"]
    dense = {frontend(r): r["total_img_sec"] for r in rows
             if r["optimizer"] in ("hs", "ddp", "fsdp") and r["compressor"] == "none" and not r.get("hierarchical")}
    flat = {method_key(r): r["total_img_sec"] for r in rows if not r.get("hierarchical")}
    for row in rows:
        row["speedup_vs_dense"] = row["total_img_sec"] / dense[frontend(row)]
        row["speedup_vs_horovod_dense"] = row["total_img_sec"] / dense["horovod"]
        row["efficiency"] = row["total_img_sec"] / local
        if row.get("hierarchical"):
            twin = flat.get(method_key(row))
            row["speedup_vs_flat"] = None if twin is None else row["total_img_sec"] / twin
    return rows


def place(row: Dict[str, Any]) -> str:
    """Where a row ran: ``hosts x workers per host`` (e.g. ``2x2``; ``4x1`` for one worker per host)."""
    per_host = row.get("workers_per_host", 1)
    return f"{row['workers'] // per_host}x{per_host}"


def table(rows: Sequence[Dict[str, Any]]) -> str:
    """The human-readable table of all rows (``vs dense``: against the dense row of the same front
    end; ``vs hvd``: against dense Horovod)."""
    head = (f"{'hosts':>5} {'rate':>7} {'compressor':37s} {'img/s/worker':>12} {'total img/s':>11} "
            f"{'vs dense':>8} {'vs hvd':>6} {'vs flat':>7} {'efficiency':>10} {'across/step':>11} {'node/step':>10} "
            f"{'select ms':>9} {'comm ms':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        stats = r.get("stats") or {}
        seconds = stats.get("seconds", {})
        across, node = (f"{b / 1e6:.2f} MB" for b in tier_bytes(stats)) if stats else ("-", "-")
        vs_flat = f"{r['speedup_vs_flat']:7.2f}" if r.get("speedup_vs_flat") is not None else f"{'-':>7}"
        lines.append(f"{place(r):>5} {r['rate']:>7} {r['label'][:37]:37s} {r['img_sec_per_worker']:12.2f} "
                     f"{r['total_img_sec']:11.2f} {r['speedup_vs_dense']:8.2f} {r['speedup_vs_horovod_dense']:6.2f} "
                     f"{vs_flat} {r['efficiency']:10.2f} {across:>11} {node:>10} "
                     f"{1e3 * seconds.get('select', 0):9.1f} {1e3 * seconds.get('communicate', 0):8.1f}")
    return "\n".join(lines)


def plot(rows: Sequence[Dict[str, Any]], out: Path, name: str, model: str) -> List[Path]:
    """Speed-up (over dense Horovod, the one yardstick of both front ends) and efficiency bars,
    one panel per (hosts x workers per host, rate)."""
    panels: Dict[str, Dict[str, Dict[str, float]]] = {"speedup_vs_horovod_dense": {}, "efficiency": {}}
    for r in rows:
        if r["optimizer"] == "local":
            continue
        panel = f"{place(r)}, {r['rate']}"
        for key in panels:
            panels[key].setdefault(panel, {})[r["label"]] = r[key]
    return [plots.grouped_bars(out / f"{name}_speedup.png", f"{model}: throughput / dense Horovod throughput",
                               panels["speedup_vs_horovod_dense"], "speed-up over dense", reference=1.0),
            plots.grouped_bars(out / f"{name}_efficiency.png", f"{model}: throughput / compute-only throughput",
                               panels["efficiency"], "scaling efficiency", reference=1.0)]


def run_sweep(cluster: EmulatedCluster, launch: Callable[..., JobOutput], module: str, args: argparse.Namespace,
              configs: List[Dict[str, Any]], progress: Progress,
              extra: Sequence[str] = ()) -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """Run ``configs`` as one job of ``module`` (:mod:`benchmarks.emulated.synthetic` or
    :mod:`benchmarks.emulated.synthetic_ddp`, with ``extra`` arguments) across ``cluster`` with ``launch``
    (:func:`~benchmarks.emulated.netem.run_horovod` or :func:`~benchmarks.emulated.netem.run_torch_distributed`).
    Returns the rows it wrote (also those before a failure) and the failure, if any."""
    where = f"{cluster.hosts}x{cluster.workers_per_host} {cluster.rate or 'unshaped'}"
    label = ""

    def follow(line: str) -> None:
        nonlocal label
        if line.startswith("Compressor: "):
            label = line.split(": ", 1)[1]
            progress.starting(f"{where} {label}")
        elif line.startswith("Total img/sec"):
            progress.done(f"{where} {label}", line)

    with tempfile.TemporaryDirectory(prefix="hs-cluster-") as tmp:
        sweep_file, result_file = Path(tmp, "sweep.json"), Path(tmp, "rows.json")
        sweep_file.write_text(json.dumps(configs))
        argv = [sys.executable, "-m", module, "--model", args.model, "--batch-size", str(args.batch_size),
                "--num-warmup-batches", str(args.num_warmup_batches),
                "--num-batches-per-iter", str(args.num_batches_per_iter), "--num-iters", str(args.num_iters),
                "--sweep", str(sweep_file), "--results", str(result_file), *extra]
        if args.size:
            argv += ["--size", str(args.size)]
        error = None
        try:
            launch(cluster, argv, timeout=args.timeout, on_line=follow)
        except RuntimeError as failure:  # keep what was measured before it; report the rest
            error = f"{where}: {label} failed: {str(failure)[-2000:]}"
            print(error, file=sys.stderr)
        return (read_results(result_file) if result_file.exists() else []), error


def run_job(args: argparse.Namespace, workers: int, rate: Optional[str], configs: List[Dict[str, Any]],
            torch_jobs: List[Tuple[str, List[Dict[str, Any]]]], progress: Progress) -> Dict[str, Any]:
    """Build the cluster (``args.workers_per_host`` workers per host), measure a link between
    two hosts, run the Horovod sweep ``configs``, then each ``torch.distributed`` job of
    ``torch_jobs`` (its module and sweep: DDP, FSDP2) on the same cluster; returns the link, the
    rows with their ratios and the errors. Without their job's dense row (or Horovod's ``local``
    and dense rows) a job's rows are left out."""
    with EmulatedCluster(workers, rate, workers_per_host=args.workers_per_host) as cluster:
        link = measure_link(cluster).as_dict() if cluster.hosts > 1 else None
        groups = ["--groups", str(args.groups)] if args.groups is not None else []
        rows, error = run_sweep(cluster, run_horovod, "benchmarks.emulated.synthetic", args, configs, progress, groups)
        errors = [error] if error else []
        for module, torch_configs in torch_jobs:
            torch_rows, error = run_sweep(cluster, run_torch_distributed, module, args, torch_configs, progress)
            errors += [error] if error else []
            if any(r["compressor"] == "none" for r in torch_rows):
                rows += torch_rows
    for row in rows:
        row.update(rate=rate or "unshaped", link=link, workers_per_host=args.workers_per_host)
    complete = (any(r["optimizer"] == "local" for r in rows)
                and any(r["optimizer"] == "hs" and r["compressor"] == "none" for r in rows))
    return {"link": link, "rows": add_ratios(merge_repeats(rows)) if complete else [], "errors": errors}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, help="image side / sequence length (default: the model's)")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="workers in all (per job)")
    parser.add_argument("--workers-per-host", type=int, default=1,
                        help="workers sharing a host (unshaped between them); with more than one host, every "
                        "method also runs two-tier (hierarchical=True) next to its flat row")
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"],
                        help="tc rates of the links (1gbit, 10gbit, 100mbit, ...) or 'unshaped'")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    parser.add_argument("--methods", nargs="+", help="methods to run (default: every one with a torch "
                        "implementation now)")
    parser.add_argument("--groups", help="grouping passed to every method of the Horovod job (--groups of "
                        "benchmarks.emulated.synthetic; DDP's buckets are its groups)")
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole sweep this many times in the job (interleaved); report medians")
    parser.add_argument("--ddp", action="store_true",
                        help="also run the DDP sweep (dense DDP, PowerSGD, every method through horovod_sparse's "
                        "comm hook) on each cluster, after the Horovod job (benchmarks.emulated.synthetic_ddp)")
    parser.add_argument("--fsdp", action="store_true",
                        help="also run the FSDP2 sweep (HSDP, every method on the replica axis through "
                        "horovod_sparse.fsdp; sharded inside each host) on each cluster "
                        "(benchmarks.emulated.synthetic_fsdp)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="cluster", help="result file name stem")
    args = parser.parse_args(argv)
    if args.ddp and args.num_warmup_batches < POWERSGD_START_ITER:
        parser.error(f"--ddp needs --num-warmup-batches >= {POWERSGD_START_ITER} (PowerSGD's dense start)")
    if args.workers_per_host < 1 or any(n % args.workers_per_host for n in args.workers):
        parser.error(f"every --workers count must be a multiple of --workers-per-host {args.workers_per_host}")
    methods = args.methods or available_methods()
    torch_jobs = ([("benchmarks.emulated.synthetic_ddp", ddp_sweep(methods, args.densities) * args.repeats)] if args.ddp
                  else []) + ([("benchmarks.emulated.synthetic_fsdp",
                                fsdp_sweep(methods, args.densities) * args.repeats)]
                              if args.fsdp else [])
    jobs = [(n, None if rate == "unshaped" else rate) for rate in args.rates for n in args.workers]
    rows: List[Dict[str, Any]] = []
    links: List[Dict[str, Any]] = []
    errors: List[str] = []
    command = command_line(argv, "benchmarks.emulated.cluster")
    sweeps = {n: sweep(methods, args.densities, two_tier=args.workers_per_host > 1 and n > args.workers_per_host)
              * args.repeats for n in args.workers}
    torch_configs = sum(len(configs) for _, configs in torch_jobs)
    with Progress(sum(len(sweeps[n]) + torch_configs for n, _ in jobs), "cluster") as progress:
        for workers, rate in jobs:
            job = run_job(args, workers, rate, sweeps[workers], torch_jobs, progress)
            rows += job["rows"]
            if job["link"]:
                links.append({"workers": workers, **job["link"]})
            errors += job["errors"]
            write_results(args.out / f"{args.name}.json", "cluster",
                          {"model": args.model, "batch_size": args.batch_size, "links": links, "rows": rows,
                           "errors": errors}, command)
    print(table(rows))
    for link in links:
        print(f"link at {link['rate']} (n={link['workers']}, between hosts): "
              f"{link['bits_per_second'] / 1e9:.3f} Gbit/s, "
              f"latency {1e6 * link['latency_seconds']:.1f} us")
    for path in plot(rows, args.out, args.name, args.model):
        print(f"wrote {path}")
    print(f"wrote {args.out / (args.name + '.json')}")
    if errors:
        sys.exit(f"{len(errors)} job(s) failed part-way (their rows up to the failure are kept):\n" + "\n".join(errors))


if __name__ == "__main__":
    main()
