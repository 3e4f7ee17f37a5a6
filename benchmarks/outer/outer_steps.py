"""Outer steps against per-step exchange across slow links: DiLoCo dense and sparse, per-step DDP
dense and sparse, side by side in one job per link speed on an emulated cluster (root: network
namespaces, :mod:`benchmarks.emulated.netem`).

    python -m benchmarks.outer.outer_steps --rates 100mbit 1gbit [--workers 2] [--steps 300] [--every 10 50]
    python -m benchmarks.outer.outer_steps --rates local ...   # this machine's loopback, no shaping (no root)
    python -m benchmarks.outer.outer_steps --schedules sync overlap streamed --fragments 4 ...

For every rate one ``torch.distributed`` job (Gloo) across the emulated cluster trains, one after
the other from the same initial weights (:mod:`benchmarks.outer.outer_training`): per-step DDP (DDP's
own allreduce, and ``--methods`` through horovod_sparse's comm hook) and outer steps
(``horovod_sparse.outer``: dense DiLoCo, and ``--outer-methods`` on the pseudo-gradients) at
every ``--every`` H, on each ``--tasks`` task: a byte-level causal transformer on the Python
standard library's sources (validation loss) and the main job's digits MLP (test accuracy).

The table (per task and rate): the final metric, training seconds (the evaluations excluded),
payload MB a worker sent, the seconds to reach per-step dense DDP's final metric (``-`` when
never reached at an evaluation) and that time as a fraction of dense DDP's; for outer rows with a
method, dense DiLoCo's final metric at the same H and how many times the row's bytes it sent.
Writes ``<out>/<name>.json`` and
``<out>/<name>_<task>_seconds.png`` and ``..._bytes.png`` (the metric against training seconds and
against MB sent, one panel per rate); ``--report FILE`` prints the table and draws the figures of
such a file again. ``--worker`` is the mode the job's ranks run in.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from benchmarks.emulated.netem import EmulatedCluster, run_torch_distributed
from benchmarks.main_job.digits_training import torchrun
from benchmarks.outer.outer_training import RESULT_PREFIX, add_arguments, check_arguments, run_worker
from benchmarks.shared import plots
from benchmarks.shared.results import RESULTS_DIR, command_line, write_results

LOCAL = "local"
WORKER_OPTIONS = ("--tasks", "--steps", "--outer-steps", "--eval-every", "--every", "--methods", "--outer-methods",
                  "--density", "--sparse-outer", "--lr", "--batch-size", "--digits-batch-size", "--seed",
                  "--schedules", "--fragments")


def worker_argv(args: argparse.Namespace, torchft: bool) -> List[str]:
    """The worker's command line: this module in ``--worker`` mode with the run's options, for the
    job of torchft's DiLoCo (``torchft``) or the job of every other configuration."""
    argv = [sys.executable, "-m", "benchmarks.outer.outer_steps", "--worker", *(["--torchft"] if torchft else [])]
    for option in WORKER_OPTIONS:
        value = getattr(args, option[2:].replace("-", "_"))
        if value is not None:
            argv += [option, *map(str, value if isinstance(value, list) else [value])]
    return argv


def run_rate(rate: str, args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every configuration at link ``rate`` (``local``: no emulation); rank 0's result rows."""
    rows: List[Dict[str, Any]] = []

    def on_line(line: str) -> None:
        if line.startswith(RESULT_PREFIX):
            row = {**json.loads(line[len(RESULT_PREFIX):]), "rate": rate}
            rows.append(row)
            print(f"  {rate:>8} {row['task']:>6} {row['label']:<24} {row['metric']} {row['final']:.4g} "
                  f"in {row['seconds']:.1f} s, {row['bytes'] / 1e6:.2f} MB", flush=True)

    jobs = [worker_argv(args, torchft=False)] + ([worker_argv(args, torchft=True)] if args.torchft else [])
    if rate == LOCAL:
        for argv in jobs:
            torchrun(args.workers, argv, on_line, timeout=args.timeout)
        return rows
    with EmulatedCluster(workers=args.workers, rate=rate) as cluster:
        for argv in jobs:
            run_torch_distributed(cluster, argv, timeout=args.timeout, on_line=on_line)
    return rows


def reached(row: Dict[str, Any], target: float, lower_is_better: bool) -> Optional[float]:
    """Seconds at ``row``'s first evaluation at or beyond ``target``, None if none."""
    for point in row["curve"]:
        if (point["value"] <= target) if lower_is_better else (point["value"] >= target):
            return point["seconds"]
    return None


def add_comparisons(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each row with ``to_dense_ddp`` (seconds to dense DDP's final metric), ``time_fraction``
    (that over dense DDP's seconds) and, for outer rows with a method, ``dense_diloco_final`` and
    ``bytes_ratio`` (dense DiLoCo's final metric, and its bytes over the row's, at the same H and
    schedule)."""
    out = []
    for row in rows:
        same = [r for r in rows if r["rate"] == row["rate"] and r["task"] == row["task"]]
        dense = next(r for r in same if r["label"] == "ddp none")
        seconds = reached(row, dense["final"], row["metric"].endswith("loss"))
        extra: Dict[str, Any] = {"to_dense_ddp": seconds,
                                 "time_fraction": None if seconds is None else seconds / dense["seconds"]}
        if row["kind"] == "outer" and row["method"] != "none":
            diloco = next(r for r in same if r["kind"] == "outer" and r["method"] == "none"
                          and r["every"] == row["every"] and r.get("schedule") == row.get("schedule"))
            extra.update(dense_diloco_final=diloco["final"], bytes_ratio=diloco["bytes"] / row["bytes"])
        out.append({**row, **extra})
    return out


def _cell(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: Sequence[Dict[str, Any]]) -> str:
    """The markdown table of :func:`add_comparisons`' rows."""
    lines = ["| task | link | configuration | final | seconds | MB sent / worker | s to dense DDP's final "
             "| fraction of dense DDP's time | dense DiLoCo, same H: final, its MB / these |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        versus = "-" if "dense_diloco_final" not in r else f"{r['dense_diloco_final']:.4g}, {r['bytes_ratio']:.0f}x"
        lines.append(f"| {r['task']} | {r['rate']} | {r['label']} | {r['final']:.4g} | {r['seconds']:.1f} | "
                     f"{r['bytes'] / 1e6:.3g} | {_cell(r['to_dense_ddp'], '.1f')} | "
                     f"{_cell(r['time_fraction'], '.3f')} | {versus} |")
    return "\n".join(lines)


def plot(rows: Sequence[Dict[str, Any]], out: Path, name: str) -> List[Path]:
    """Per task: the metric against training seconds and against MB sent, one panel per rate."""
    paths = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        metric = mine[0]["metric"]
        for axis, key, scale in (("seconds", "seconds", 1.0), ("MB sent per worker", "bytes", 1e-6)):
            panels: Dict[str, Dict[str, plots.Series]] = {}
            for r in mine:
                label = r["label"].replace("ddp none", "none (dense DDP)")
                panels.setdefault(f"{task}, {r['rate']}", {})[label] = (
                    [p[key] * scale for p in r["curve"]], [p["value"] for p in r["curve"]])
            path = out / f"{name}_{task}_{key}.png"
            paths.append(plots.curves(path, f"{metric} against {axis}", panels, axis, metric))
    return paths


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"],
                        help="link speeds as tc writes them, or 'local' (loopback, unshaped, no root)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds each job (ours, then torchft's) may run before it is stopped as a failure")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="outer_steps")
    parser.add_argument("--report", type=Path,
                        help="a result file this benchmark wrote: print its table and draw its figures again, "
                             "without training")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    if args.worker:
        run_worker(args)
        return
    if args.report is not None:
        rows = add_comparisons(json.loads(args.report.read_text())["results"])
        print(table(rows))
        for written in plot(rows, args.out, args.name):
            print(f"wrote {written}")
        return
    rows: List[Dict[str, Any]] = []
    for rate in args.rates:
        print(f"{rate}: {args.workers} workers", flush=True)
        rows += run_rate(rate, args)
    rows = add_comparisons(rows)
    print(table(rows))
    command = command_line(argv, "benchmarks.outer.outer_steps")
    path = write_results(args.out / f"{args.name}.json", "outer_steps", rows, command)
    for written in [path, *plot(rows, args.out, args.name)]:
        print(f"wrote {written}")


if __name__ == "__main__":
    main()
