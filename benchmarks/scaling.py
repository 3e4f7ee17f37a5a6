"""Scaling model: an alpha-beta model of every method's training step, with alpha and beta measured
on the emulated links, validated against the emulated-cluster runs, and projected to n = 1024.

    python -m benchmarks.scaling --cluster results/cluster.json

1. *alpha, beta*: for each link rate of the cluster runs, a two-worker emulated cluster
   (:mod:`benchmarks.netem`) times Horovod allgathers of 1 kB to 8 MB per rank and fits them with
   :func:`horovod_sparse.common.cost_model.calibrate` (kept in ``<out>/alpha_beta.json``;
   ``--remeasure`` measures again; needs root).
2. *The step* of a method on ``n`` workers: ``compute + local(n) + wire(n)``. ``compute`` is the
   step of the same workers training without exchange and ``local`` the method's own work outside
   the collectives (selection, flattening, applying: every timed phase but the communication
   wait), both measured in the cluster run; the partitioned methods (MiCRO, ExDyna) scan ``d/n``
   of the buffer, so their selection is scaled as ``1/n`` (an optimistic simplification; the other
   phases, over the whole buffer or the ``k`` selected, are not). ``wire`` is the alpha-beta time of the
   method's collectives (:data:`WIRE`), each with the payload per rank measured in the run and its
   law in ``n``: a dense allreduce ``2 alpha log2 n + 2 (n-1)/n beta S``; an allgather of ``s``
   bytes per rank ``alpha log2 n + (n-1) beta s`` (Top-k and the threshold methods: the build-up);
   MiCRO/ExDyna allgather ``~k/n`` indices per rank and allreduce ``k`` values (no build-up);
   gTop-k ``log2 n`` point-to-point rounds of ``k`` pairs. Communication overlapped with the
   backward pass is not subtracted (an upper bound on the step).
3. *Validation*: predicted against measured step time of every cluster row (n = 2 and 4); the
   project's target is an error of at most 20%.
4. *Projection* to n = 2 ... 1024 at 1, 10 and 100 Gbit/s (each rate's own fit where one was
   measured; otherwise beta scaled from the 1 Gbit/s fit by the ratio of the nominal rates, alpha
   kept: :func:`network`): scaling efficiency ``compute / step``, and the gTop-k paper's comparison on
   32 workers at 1 GbE (its efficiency against dense and against Top-k), once with the selection
   times measured here and once with the methods' own work left out (selection as cheap as on
   the paper's GPUs).

Writes ``<out>/<name>.json`` and ``<out>/<name>.png`` (efficiency against workers, one panel per
rate). ``--calibrate-worker`` is the mode the calibration job runs in.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from benchmarks import plots
from benchmarks.netem import rate_bits
from benchmarks.results import RESULTS_DIR, command_line, read_results, write_results
from horovod_sparse.common.cost_model import AlphaBeta

#: Methods whose selection scans only this worker's ``1/n`` partition of the buffer.
PARTITIONED = ("micro", "exdyna")
PROJECTION_WORKERS = [2 ** i for i in range(1, 11)]
PROJECTION_RATES = ["1gbit", "10gbit", "100gbit"]
#: The fits of the benchmarks' cluster runs (``python -m benchmarks.scaling`` on the emulated links
#: of a quiet 2-core machine, docs/benchmarks.md "Scaling model"): what :mod:`benchmarks.digits` projects with when
#: this machine has no ``results/alpha_beta.json`` of its own.
REFERENCE_FITS: Dict[str, Any] = {"1gbit": {"model": {"alpha": 0.80e-3, "beta": 12.7e-9, "workers": 2}},
                                  "10gbit": {"model": {"alpha": 0.93e-3, "beta": 1.9e-9, "workers": 2}}}


@dataclass(frozen=True)
class Payload:
    """Bytes per rank of one step, by kind (``values``, ``indices``, ``meta``), as measured on
    ``workers`` workers, and the number of collectives issued."""

    values: float
    indices: float
    meta: float
    collectives: float
    workers: int


def _dense(ab: AlphaBeta, p: Payload) -> float:
    # One allreduce per collective (latency each), the bytes of all of them through the ring once.
    n = ab.workers
    return p.collectives * 2 * ab.alpha * ab.log2n + 2 * (n - 1) / n * ab.beta * (p.values + p.indices + p.meta)


def _allgather(ab: AlphaBeta, p: Payload) -> float:
    # Every collective pays one latency term; the bytes of all of them cross the wire once each.
    return p.collectives * ab.alpha * ab.log2n + (ab.workers - 1) * ab.beta * (p.values + p.indices + p.meta)


def _partitioned(ab: AlphaBeta, p: Payload) -> float:
    # Indices: each rank's share of the union (k/n) shrinks as 1/n; values: an allreduce of the
    # whole union (k), whatever n.
    indices = p.indices * p.workers / ab.workers
    return (p.collectives * ab.alpha * ab.log2n + (ab.workers - 1) * ab.beta * (indices + p.meta)
            + 2 * (ab.workers - 1) / ab.workers * ab.beta * p.values)


def _butterfly(ab: AlphaBeta, p: Payload) -> float:
    rounds_measured = max(1.0, math.log2(p.workers))
    per_round = (p.values + p.indices + p.meta) / rounds_measured
    return math.ceil(ab.log2n) * (ab.alpha + ab.beta * per_round)


#: How each method's collectives cost on ``n`` workers, given the payload measured on ``p.workers``.
WIRE: Dict[str, Callable[[AlphaBeta, Payload], float]] = {
    "none": _dense, "fp16": _dense,
    "topk": _allgather, "threshold": _allgather, "dgc": _allgather, "gaussiank": _allgather, "lags": _allgather,
    "micro": _partitioned, "exdyna": _partitioned,
    "gtopk": _butterfly,
}


def payload(row: Dict[str, Any]) -> Payload:
    """The measured payload of a cluster row."""
    stats = row["stats"]
    kinds = stats.get("bytes_sent_by_kind") or {"values": stats["bytes_sent"], "indices": 0.0, "meta": 0.0}
    return Payload(kinds["values"], kinds["indices"], kinds["meta"], stats["collectives"], row["workers"])


def local_seconds(row: Dict[str, Any], workers: int) -> float:
    """The row's measured per-step work outside the collectives (selection, flattening, applying,
    merging, ...: every phase but the ``communicate`` wait), moved to ``workers`` workers (the
    ``select`` phase of a :data:`PARTITIONED` method scales as ``1/n``)."""
    phases = {phase: v for phase, v in row["stats"]["seconds"].items() if phase != "communicate"}
    if row["compressor"] in PARTITIONED and "select" in phases:
        phases["select"] *= row["workers"] / workers
    return sum(phases.values())


def predict_step(row: Dict[str, Any], compute: float, ab: AlphaBeta, local: bool = True) -> float:
    """Predicted seconds per step of the row's method on ``ab.workers`` workers (``local=False``:
    without the method's own work, as if selection were free)."""
    try:
        wire = WIRE[row["compressor"]]
    except KeyError:
        raise ValueError(f"no wire model for method {row['compressor']!r}; add it to WIRE") from None
    return compute + (local_seconds(row, ab.workers) if local else 0.0) + wire(ab, payload(row))


# -- calibration -----------------------------------------------------------------------------------
def calibrate_worker(results: Path) -> None:
    """One rank of the calibration job: fit alpha and beta to timed allgathers (rank 0 writes)."""
    import horovod.torch as hvd
    import torch

    from horovod_sparse.common.cost_model import calibration_sizes
    from horovod_sparse.common.measurements import measure_cost_model
    from horovod_sparse.torch import backend

    hvd.init()
    torch.set_num_threads(1)
    model, samples = measure_cost_model(backend, hvd.global_process_set, calibration_sizes(1 << 10, 1 << 23, 6),
                                        repeats=5)
    if hvd.rank() == 0:
        results.write_text(json.dumps({"model": model.as_dict(), "samples": samples}))


def measure_alpha_beta(rates: Sequence[str]) -> Dict[str, Any]:
    """Fit alpha and beta on a two-worker emulated cluster for each rate; also probe the link."""
    from benchmarks.netem import EmulatedCluster, measure_link, run_horovod

    fits: Dict[str, Any] = {}
    for rate in rates:
        with tempfile.TemporaryDirectory(prefix="hs-scaling-") as tmp, EmulatedCluster(2, rate) as cluster:
            link = measure_link(cluster).as_dict()
            out = Path(tmp, "fit.json")
            run_horovod(cluster, [sys.executable, "-m", "benchmarks.scaling", "--calibrate-worker",
                                  "--results", str(out)], timeout=900)
            fits[rate] = {**json.loads(out.read_text()), "link": link}
        model = fits[rate]["model"]
        print(f"{rate}: alpha {1e6 * model['alpha']:.1f} us, beta {8 / model['beta'] / 1e9:.3f} Gbit/s "
              f"(link probe: {link['bits_per_second'] / 1e9:.3f} Gbit/s)", flush=True)
    return fits


def load_fits(fit_file: Path, rates: Sequence[str], remeasure: bool, command: str) -> Dict[str, Any]:
    """The fits of ``fit_file`` (a result file of :func:`measure_alpha_beta`'s fits), with every
    rate of ``rates`` it lacks (all of them with ``remeasure``) measured and the file rewritten."""
    fits = read_results(fit_file) if fit_file.exists() and not remeasure else {}
    if not set(rates) <= set(fits):
        fits.update(measure_alpha_beta([r for r in rates if r not in fits]))
        write_results(fit_file, "alpha_beta", fits, command)
    return fits


def network(fits: Dict[str, Any], rate: str) -> AlphaBeta:
    """The alpha-beta model of links at ``rate`` (a tc rate, e.g. ``10gbit``), for one worker
    (:meth:`AlphaBeta.with_workers` sets the count): the fit of that rate when ``fits`` has one;
    otherwise the 1 Gbit/s fit (or the slowest fitted rate) with alpha kept and beta scaled by the
    ratio of the nominal rates."""
    if rate in fits:
        return AlphaBeta(**fits[rate]["model"]).with_workers(1)
    base = AlphaBeta(**fits[base_rate(fits)]["model"])
    return AlphaBeta(base.alpha, base.beta * rate_bits(base_rate(fits)) / rate_bits(rate), 1)


def base_rate(fits: Dict[str, Any]) -> str:
    """The rate projections start from: ``1gbit`` when fitted, else the slowest fitted rate."""
    return "1gbit" if "1gbit" in fits else max(fits, key=lambda r: fits[r]["model"]["beta"])


# -- validation and projection ------------------------------------------------------------------------
def compute_seconds(rows: Sequence[Dict[str, Any]], workers: int, rate: str) -> float:
    """The compute-only step of the job with ``workers`` workers at ``rate``."""
    return next(r["step_seconds"] for r in rows if r["optimizer"] == "local" and r["workers"] == workers
                and r["rate"] == rate)


def validate(rows: Sequence[Dict[str, Any]], fits: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Predicted against measured step time for every measured row with an exchange."""
    table = []
    for row in rows:
        if row["optimizer"] != "hs" or row["rate"] not in fits:
            continue
        ab = AlphaBeta(**fits[row["rate"]]["model"]).with_workers(row["workers"])
        predicted = predict_step(row, compute_seconds(rows, row["workers"], row["rate"]), ab)
        table.append({"workers": row["workers"], "rate": row["rate"], "label": row["label"],
                      "measured": row["step_seconds"], "predicted": predicted,
                      "error": predicted / row["step_seconds"] - 1})
    return table


def project(rows: Sequence[Dict[str, Any]], fits: Dict[str, Any], local: bool = True) -> List[Dict[str, Any]]:
    """Efficiency of every method of the smallest measured job at the 1 Gbit/s fit's rate (or the
    slowest measured one), projected to PROJECTION_WORKERS at PROJECTION_RATES on the links of
    :func:`network`; ``local=False`` leaves the methods' own work out (selection as cheap as on a
    GPU)."""
    rate0 = base_rate(fits)
    n0 = min(r["workers"] for r in rows)
    measured = [r for r in rows if r["optimizer"] == "hs" and r["workers"] == n0 and r["rate"] == rate0]
    compute = compute_seconds(rows, n0, rate0)
    projection = []
    for rate in PROJECTION_RATES:
        links = network(fits, rate)
        for row in measured:
            steps = [predict_step(row, compute, links.with_workers(n), local) for n in PROJECTION_WORKERS]
            projection.append({"rate": rate, "label": row["label"], "compressor": row["compressor"],
                               "workers": PROJECTION_WORKERS, "step": steps,
                               "efficiency": [compute / s for s in steps]})
    return projection


def gtopk_claim(projection: Sequence[Dict[str, Any]], workers: int = 32, rate: str = "1gbit") -> List[str]:
    """The gTop-k paper's comparison (32 workers, 1 GbE) read off the projection."""
    at = PROJECTION_WORKERS.index(workers)
    lines = []
    for gtopk in (p for p in projection if p["compressor"] == "gtopk" and p["rate"] == rate):
        density = gtopk["label"]
        others = {p["compressor"]: p for p in projection if p["rate"] == rate
                  and (p["compressor"] == "none" or p["label"] == density.replace("gtopk", "topk"))}
        if {"none", "topk"} <= set(others):
            eff = gtopk["efficiency"][at]
            lines.append(f"{density} on {workers} workers at {rate}: efficiency {eff:.3f}, "
                         f"{eff / others['none']['efficiency'][at]:.1f}x dense, "
                         f"{eff / others['topk']['efficiency'][at]:.2f}x Top-k")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", type=Path, nargs="+", default=[RESULTS_DIR / "cluster.json"],
                        help="result files of benchmarks.cluster")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="scaling", help="result file name stem")
    parser.add_argument("--remeasure", action="store_true", help="measure alpha and beta again")
    parser.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.calibrate_worker:
        calibrate_worker(args.results)
        return
    rows = [row for path in args.cluster for row in read_results(path)["rows"]]
    rates = sorted({r["rate"] for r in rows})
    fits = load_fits(args.out / "alpha_beta.json", rates, args.remeasure, command_line(argv, "benchmarks.scaling"))
    validation = validate(rows, fits)
    print(f"{'n':>2} {'rate':>7} {'compressor':28s} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for v in validation:
        print(f"{v['workers']:>2} {v['rate']:>7} {v['label'][:28]:28s} {v['measured']:10.3f} {v['predicted']:11.3f} "
              f"{100 * v['error']:+6.1f}%")
    errors = np.abs([v["error"] for v in validation])
    print(f"validation: median |error| {100 * np.median(errors):.1f}%, {int((errors <= 0.2).sum())} of "
          f"{len(errors)} within 20%")
    projection, wire_only = project(rows, fits), project(rows, fits, local=False)
    claims = {"measured selection": gtopk_claim(projection), "selection left out": gtopk_claim(wire_only)}
    for variant, lines in claims.items():
        for line in lines:
            print(f"{line} ({variant})")
    panels = {rate: {p["label"]: (np.log2(p["workers"]).tolist(), p["efficiency"]) for p in projection
                     if p["rate"] == rate} for rate in PROJECTION_RATES}
    figure = plots.curves(args.out / f"{args.name}.png", "projected scaling efficiency (alpha-beta model)", panels,
                          "log2(workers)", "efficiency = compute / step")
    path = write_results(args.out / f"{args.name}.json", "scaling",
                         {"alpha_beta": fits, "validation": validation, "projection": projection,
                          "projection_selection_left_out": wire_only, "gtopk_claim": claims},
                         command_line(argv, "benchmarks.scaling"))
    print(f"wrote {path}\nwrote {figure}")


if __name__ == "__main__":
    main()
