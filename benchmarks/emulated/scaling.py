"""Scaling model: an alpha-beta model of every method's training step, with alpha and beta measured
on the emulated links, validated against the emulated-cluster runs, and projected to n = 1024.

    python -m benchmarks.emulated.scaling --cluster results/cluster.json

1. *alpha, beta*: for each link rate of the cluster runs, a two-worker emulated cluster
   (:mod:`benchmarks.emulated.netem`) times Horovod allgathers of 1 kB to 8 MB per rank and fits them with
   :func:`horovod_sparse.common.cost_model.calibrate` (kept in ``<out>/alpha_beta.json``;
   ``--remeasure`` measures again; needs root). When the runs have two-tier rows, the links
   inside a host get their own fit (:data:`NODE_FIT`: two workers in one namespace, unshaped).
2. *The step* of a method on ``n`` workers: ``compute + local(n) + wire(n)``. ``compute`` is the
   step of the same workers training without exchange and ``local`` the method's own work outside
   the collectives (selection, flattening, applying: every timed phase but the communication
   wait), both measured in the cluster run; the partitioned methods (MiCRO, ExDyna) scan ``d/n``
   of the buffer, so their selection is scaled as ``1/n`` (an optimistic simplification; the other
   phases, over the whole buffer or the ``k`` selected, are not). ``wire`` is the alpha-beta time of the
   method's collectives (:data:`benchmarks.emulated.wire.WIRE`), each with the payload per rank measured in the run and
   its law in ``n``: a dense allreduce ``2 alpha log2 n + 2 (n-1)/n beta S``; an allgather of ``s``
   bytes per rank ``alpha log2 n + (n-1) beta s`` (Top-k and the threshold methods: the build-up);
   MiCRO/ExDyna allgather ``~k/n`` indices per rank and allreduce ``k`` values (no build-up);
   gTop-k ``log2 n`` point-to-point rounds of ``k`` pairs. Communication overlapped with the
   backward pass is not subtracted (an upper bound on the step). Ranks placed ``L`` to a host
   share its link: an allgather brings the ``n - L`` remote ranks' bytes to each of them
   (``L (n - L) beta s`` through the link), a ring that visits a host's ranks in a row crosses
   the link once, gTop-k's first ``log2 L`` rounds stay inside.
   *Two-tier* (``hierarchical=True``, :func:`predict_two_tier`) on ``N`` nodes of ``L``: compute,
   the method's own work with its selection over a slice (``1/L``), a ring reduce-scatter and
   allgather of the buffer ``S`` inside the node with the inside fit
   (``2 (L-1)/L beta_in S``, ``(L-1) alpha_in`` a collective), and the method's law on ``N``
   nodes with the payload of a node (its ``L`` slices together).
3. *Validation*: predicted against measured step time of every cluster row (n = 2 and 4, two-tier
   rows against their own model); the project's target is an error of at most 20%.
4. *Projection* to n = 2 ... 1024 at 1, 10 and 100 Gbit/s (each rate's own fit where one was
   measured; otherwise beta scaled from the 1 Gbit/s fit by the ratio of the nominal rates, alpha
   kept: :func:`network`): scaling efficiency ``compute / step``, and the gTop-k paper's comparison on
   32 workers at 1 GbE (its efficiency against dense and against Top-k), once with the selection
   times measured here and once with the methods' own work left out (selection as cheap as on
   the paper's GPUs).
5. *Two-tier projection* (:func:`project_nodes`): every method measured two-tier, on ``--nodes``
   nodes of ``--gpus-per-node`` ranks with NVLink-class links inside (:data:`NVLINK`) at each
   of ``--node-rates`` between nodes, flat against two-tier.

Writes ``<out>/<name>.json`` and ``<out>/<name>.png`` (efficiency against workers, one panel per
rate). ``--calibrate-worker`` is the mode the calibration job runs in.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from benchmarks.emulated.cluster import method_key, place
from benchmarks.emulated.netem import rate_bits
from benchmarks.emulated.wire import WIRE, Payload, wire_law  # noqa: F401  (WIRE re-exported: scaling.WIRE)
from benchmarks.shared import plots
from benchmarks.shared.results import RESULTS_DIR, command_line, read_results, write_results
from horovod_sparse.common.cost_model import AlphaBeta

#: Methods whose selection scans only this worker's ``1/n`` partition of the buffer.
PARTITIONED = ("micro", "exdyna")
PROJECTION_WORKERS = [2 ** i for i in range(1, 11)]
PROJECTION_RATES = ["1gbit", "10gbit", "100gbit"]
#: The key of the fit of the links inside a host (two workers in one namespace, unshaped).
NODE_FIT = "node"
#: NVLink-class links inside a node: 3 us a message step, 100 GB/s (the projection's inside tier).
NVLINK = AlphaBeta(alpha=3e-6, beta=1e-11, workers=1)
#: Rates between the nodes of the two-tier projection (``--node-rates``).
NODE_PROJECTION_RATES = ["1gbit", "10gbit", "25gbit"]
#: The fits of the benchmarks' cluster runs (``python -m benchmarks.emulated.scaling`` on the emulated links
#: of a quiet 2-core machine, docs/benchmarks.md "Scaling model"): what :mod:`benchmarks.main_job.digits` projects with
#: when this machine has no ``results/alpha_beta.json`` of its own.
REFERENCE_FITS: Dict[str, Any] = {"1gbit": {"model": {"alpha": 0.80e-3, "beta": 12.7e-9, "workers": 2}},
                                  "10gbit": {"model": {"alpha": 0.93e-3, "beta": 1.9e-9, "workers": 2}}}


def payload(row: Dict[str, Any]) -> Payload:
    """The measured payload of a cluster row: for a flat row, per rank on ``row["workers"]``
    ranks; for a two-tier row (``two_tier``), per node (its ``local_size`` slices' payloads
    together) on its ``hosts`` nodes: what crosses a node's link."""
    stats = row["stats"]
    kinds = stats.get("bytes_sent_by_kind") or {"values": stats["bytes_sent"], "indices": 0.0, "meta": 0.0}
    if row.get("two_tier"):
        per = row["local_size"]
        return Payload(per * kinds["values"], per * kinds["indices"], per * kinds["meta"], stats["collectives"],
                       row["hosts"])
    return Payload(kinds["values"], kinds["indices"], kinds["meta"], stats["collectives"], row["workers"])


def local_seconds(row: Dict[str, Any], workers: int, per_node: int = 1) -> float:
    """The row's measured per-step work outside the collectives (selection, flattening, applying,
    merging, ...: every phase but the ``communicate`` wait), moved to ``workers`` workers in all
    (the ``select`` phase of a :data:`PARTITIONED` method scales as ``1/n``); a two-tier row's
    selection scales as ``1/per_node`` (each rank selects in its slice of the node's sum), and
    a partitioned method's also as ``1/nodes`` (its slice is partitioned among the nodes)."""
    phases = {phase: v for phase, v in row["stats"]["seconds"].items() if phase != "communicate"}
    if "select" in phases:
        if row.get("two_tier"):  # a slice of 1/per_node, partitioned among the nodes
            nodes = workers // per_node
            phases["select"] *= row["local_size"] / per_node * (row["hosts"] / nodes
                                                                if row["compressor"] in PARTITIONED else 1.0)
        elif row["compressor"] in PARTITIONED:
            phases["select"] *= row["workers"] / workers
    return sum(phases.values())


def predict_step(row: Dict[str, Any], compute: float, ab: AlphaBeta, local: bool = True, per_node: int = 1) -> float:
    """Predicted seconds per step of a flat row's method on ``ab.workers`` workers, ``per_node``
    of them sharing a node's link (``local=False``: without the method's own work, as if
    selection were free)."""
    return (compute + (local_seconds(row, ab.workers) if local else 0.0)
            + wire_law(row["compressor"])(ab, payload(row), per_node))


def node_seconds(row: Dict[str, Any], inside: AlphaBeta, node_collectives: float) -> float:
    """The inside tier of a two-tier step on nodes of ``inside.workers`` ranks: a ring
    reduce-scatter and a ring allgather of the buffer (the row's ``node`` bytes per rank),
    ``node_collectives`` of them in all: ``(L-1) alpha`` each, ``2 (L-1)/L beta S`` in all."""
    size = row["stats"]["bytes_sent_by_kind"]["node"]
    ranks = inside.workers
    return node_collectives * (ranks - 1) * inside.alpha + 2 * (ranks - 1) / ranks * inside.beta * size


def predict_two_tier(row: Dict[str, Any], flat: Dict[str, Any], compute: float, across: AlphaBeta,
                     inside: AlphaBeta, local: bool = True) -> float:
    """Predicted seconds per step of a two-tier row's method on ``across.workers`` nodes of
    ``inside.workers`` ranks: compute, the method's own work (:func:`local_seconds`), the inside
    tier (:func:`node_seconds`) and the method's law on the nodes with the payload per node
    (:func:`payload`), each node link carrying its ranks' slices. ``flat`` is the same
    configuration's flat row of the same job: the collectives the two-tier row issues beyond
    its count are the inside tier's."""
    cross = payload(row)
    node_collectives = max(0.0, cross.collectives - flat["stats"]["collectives"])
    cross = Payload(cross.values, cross.indices, cross.meta, flat["stats"]["collectives"], cross.workers)
    work = local_seconds(row, across.workers * inside.workers, inside.workers) if local else 0.0
    return compute + work + node_seconds(row, inside, node_collectives) + wire_law(row["compressor"])(across, cross)


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
    """Fit alpha and beta for each rate on a two-worker emulated cluster (two hosts; the link is
    probed too), and for :data:`NODE_FIT` on one host of two workers (unshaped)."""
    from benchmarks.emulated.netem import EmulatedCluster, measure_link, run_horovod

    fits: Dict[str, Any] = {}
    for rate in rates:
        inside = rate == NODE_FIT
        with (tempfile.TemporaryDirectory(prefix="hs-scaling-") as tmp,
              EmulatedCluster(2, None if inside else rate, workers_per_host=2 if inside else 1) as cluster):
            link = None if inside else measure_link(cluster).as_dict()
            out = Path(tmp, "fit.json")
            run_horovod(cluster, [sys.executable, "-m", "benchmarks.emulated.scaling", "--calibrate-worker",
                                  "--results", str(out)], timeout=900)
            fits[rate] = {**json.loads(out.read_text()), "link": link}
        model = fits[rate]["model"]
        probe = "" if link is None else f" (link probe: {link['bits_per_second'] / 1e9:.3f} Gbit/s)"
        print(f"{rate}: alpha {1e6 * model['alpha']:.1f} us, beta {8 / model['beta'] / 1e9:.3f} Gbit/s{probe}",
              flush=True)
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
    """The rate projections start from: ``1gbit`` when fitted, else the slowest fitted rate
    (:data:`NODE_FIT` is no rate)."""
    rates = [r for r in fits if r != NODE_FIT]
    return "1gbit" if "1gbit" in fits else max(rates, key=lambda r: fits[r]["model"]["beta"])


# -- validation and projection ------------------------------------------------------------------------
def compute_seconds(rows: Sequence[Dict[str, Any]], workers: int, rate: str) -> float:
    """The compute-only step of the job with ``workers`` workers at ``rate``."""
    return next(r["step_seconds"] for r in rows if r["optimizer"] == "local" and r["workers"] == workers
                and r["rate"] == rate)


def flat_twin(rows: Sequence[Dict[str, Any]], row: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The flat row of a two-tier row's configuration in the same job (same workers and rate)."""
    return next((r for r in rows if not r.get("two_tier") and r["workers"] == row["workers"]
                 and r["rate"] == row["rate"] and method_key(r) == method_key(row)), None)


def validate(rows: Sequence[Dict[str, Any]], fits: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Predicted against measured step time for every measured row with an exchange: flat rows
    with their hosts' ranks sharing a link (``workers_per_host``), two-tier rows with the
    :data:`NODE_FIT` inside (those without it, or without their flat twin, are left out)."""
    table = []
    for row in rows:
        if row["optimizer"] != "hs" or row["rate"] not in fits:
            continue
        ab = AlphaBeta(**fits[row["rate"]]["model"])
        compute = compute_seconds(rows, row["workers"], row["rate"])
        per_node = row.get("workers_per_host", 1)
        if row.get("two_tier"):
            twin = flat_twin(rows, row)
            if twin is None or NODE_FIT not in fits:
                continue
            inside = AlphaBeta(**fits[NODE_FIT]["model"]).with_workers(row["local_size"])
            predicted = predict_two_tier(row, twin, compute, ab.with_workers(row["hosts"]), inside)
        else:
            predicted = predict_step(row, compute, ab.with_workers(row["workers"]), per_node=per_node)
        table.append({"workers": row["workers"], "workers_per_host": per_node, "rate": row["rate"],
                      "label": row["label"], "measured": row["step_seconds"], "predicted": predicted,
                      "error": predicted / row["step_seconds"] - 1})
    return table


def project(rows: Sequence[Dict[str, Any]], fits: Dict[str, Any], local: bool = True) -> List[Dict[str, Any]]:
    """Efficiency of every method of the smallest measured job at the 1 Gbit/s fit's rate (or the
    slowest measured one), projected to PROJECTION_WORKERS at PROJECTION_RATES on the links of
    :func:`network`; ``local=False`` leaves the methods' own work out (selection as cheap as on a
    GPU)."""
    rate0 = base_rate(fits)
    n0 = min(r["workers"] for r in rows)
    measured = [r for r in rows if r["optimizer"] == "hs" and r["workers"] == n0 and r["rate"] == rate0
                and not r.get("two_tier")]
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


def project_nodes(rows: Sequence[Dict[str, Any]], fits: Dict[str, Any], nodes: int, per_node: int,
                  rates: Sequence[str], inside: AlphaBeta = NVLINK) -> List[Dict[str, Any]]:
    """Every two-tier row measured at the base rate (:func:`base_rate`), and its flat twin,
    projected to ``nodes`` nodes of ``per_node`` ranks at each of ``rates`` between the nodes
    (:func:`network`) and ``inside`` links within them: the flat step (every rank's traffic
    through its node's link, :func:`predict_step`) against the two-tier step
    (:func:`predict_two_tier`), with the measured compute and the methods' own work."""
    rate0 = base_rate(fits)
    projection = []
    for row in rows:
        twin = flat_twin(rows, row) if row.get("two_tier") and row["rate"] == rate0 else None
        if twin is None:
            continue
        compute = compute_seconds(rows, row["workers"], rate0)
        for rate in rates:
            across = network(fits, rate)
            flat = predict_step(twin, compute, across.with_workers(nodes * per_node), per_node=per_node)
            two_tier = predict_two_tier(row, twin, compute, across.with_workers(nodes), inside.with_workers(per_node))
            projection.append({"rate": rate, "label": twin["label"], "compressor": row["compressor"],
                               "nodes": nodes, "per_node": per_node, "flat_step": flat, "two_tier_step": two_tier,
                               "flat_efficiency": compute / flat, "two_tier_efficiency": compute / two_tier,
                               "speedup": flat / two_tier})
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
                        help="result files of benchmarks.emulated.cluster")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="scaling", help="result file name stem")
    parser.add_argument("--remeasure", action="store_true", help="measure alpha and beta again")
    parser.add_argument("--nodes", type=int, default=8, help="nodes of the two-tier projection")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node of the two-tier projection "
                        "(NVLink-class links between them)")
    parser.add_argument("--node-rates", nargs="+", default=NODE_PROJECTION_RATES,
                        help="rates between the nodes of the two-tier projection")
    parser.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.calibrate_worker:
        calibrate_worker(args.results)
        return
    rows = [row for path in args.cluster for row in read_results(path)["rows"]]
    rates = sorted({r["rate"] for r in rows}) + ([NODE_FIT] if any(r.get("two_tier") for r in rows) else [])
    fits = load_fits(args.out / "alpha_beta.json", rates, args.remeasure,
                     command_line(argv, "benchmarks.emulated.scaling"))
    validation = validate(rows, fits)
    print(f"{'hosts':>5} {'rate':>7} {'compressor':37s} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for v in validation:
        print(f"{place(v):>5} {v['rate']:>7} {v['label'][:37]:37s} {v['measured']:10.3f} {v['predicted']:11.3f} "
              f"{100 * v['error']:+6.1f}%")
    errors = np.abs([v["error"] for v in validation])
    print(f"validation: median |error| {100 * np.median(errors):.1f}%, {int((errors <= 0.2).sum())} of "
          f"{len(errors)} within 20%")
    projection, wire_only = project(rows, fits), project(rows, fits, local=False)
    claims = {"measured selection": gtopk_claim(projection), "selection left out": gtopk_claim(wire_only)}
    for variant, lines in claims.items():
        for line in lines:
            print(f"{line} ({variant})")
    tiers = project_nodes(rows, fits, args.nodes, args.gpus_per_node, args.node_rates)
    if tiers:
        print(f"\n{args.nodes} nodes x {args.gpus_per_node} ranks, NVLink-class inside (alpha "
              f"{1e6 * NVLINK.alpha:.0f} us, {1 / NVLINK.beta / 1e9:.0f} GB/s): efficiency flat -> two-tier")
        print(f"{'rate':>7} {'compressor':28s} {'flat':>6} {'two-tier':>8} {'speed-up':>8}")
        for t in tiers:
            print(f"{t['rate']:>7} {t['label'][:28]:28s} {t['flat_efficiency']:6.3f} {t['two_tier_efficiency']:8.3f} "
                  f"{t['speedup']:7.2f}x")
    panels = {rate: {p["label"]: (np.log2(p["workers"]).tolist(), p["efficiency"]) for p in projection
                     if p["rate"] == rate} for rate in PROJECTION_RATES}
    figure = plots.curves(args.out / f"{args.name}.png", "projected scaling efficiency (alpha-beta model)", panels,
                          "log2(workers)", "efficiency = compute / step")
    path = write_results(args.out / f"{args.name}.json", "scaling",
                         {"alpha_beta": fits, "validation": validation, "projection": projection,
                          "projection_selection_left_out": wire_only, "gtopk_claim": claims,
                          "two_tier_projection": tiers},
                         command_line(argv, "benchmarks.emulated.scaling"))
    print(f"wrote {path}\nwrote {figure}")


if __name__ == "__main__":
    main()
