"""What the main job (:mod:`benchmarks.main_job.digits`) makes of its measurements: every configuration's
step projected to larger clusters with :mod:`benchmarks.emulated.scaling`'s alpha-beta model, the table
that says which figures are measured and which projected, the recommendation, and the figures.

Pure functions of the rows a digits job writes (:meth:`benchmarks.main_job.digits_training.Recorder.row`):
no framework is imported, so a driver reports without loading torch or TensorFlow.
"""
from __future__ import annotations

import functools
import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.emulated import scaling
from benchmarks.emulated.netem import rate_bits
from benchmarks.emulated.wire import wire_law
from benchmarks.main_job.digits_training import LOCAL, OUTER, TWO_TIER
from benchmarks.shared import plots
from benchmarks.shared.tiers import tier_bytes
from horovod_sparse.common.cost_model import AlphaBeta, break_even_link

#: A projected cluster: (tc link rate, workers).
Cluster = Tuple[str, int]
#: The clusters every table projects to.
CLUSTERS: List[Cluster] = [("1gbit", 8), ("1gbit", 64), ("10gbit", 8), ("10gbit", 64)]
#: The emulated link ``--emulate`` measures on.
EMULATED_RATE = "1gbit"


def rate_name(rate: str) -> str:
    """``1gbit`` -> ``1 Gbit/s``, ``100mbit`` -> ``100 Mbit/s``."""
    bits = rate_bits(rate)
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def cluster_name(cluster: Cluster) -> str:
    """``("1gbit", 8)`` -> ``1 Gbit/s n=8``."""
    return f"{rate_name(cluster[0])} n={cluster[1]}"


def is_dense(row: Dict[str, Any]) -> bool:
    """The dense Horovod baseline: compressor ``none`` with Horovod's own grouping."""
    return row["compressor"] == "none" and row["groups"] is None


def flat_label(row: Dict[str, Any]) -> str:
    """The label of a row's flat configuration: its own, or a two-tier row's without :data:`TWO_TIER`."""
    return row["label"].removesuffix(TWO_TIER)


def projected_step(row: Dict[str, Any], flat: Dict[str, Any], compute: float, links: AlphaBeta, workers: int,
                   per_node: int, inside: AlphaBeta) -> float:
    """Seconds per step of ``row`` projected to ``workers`` workers, ``per_node`` to a node whose
    link (``links``) they share and whose links inside are ``inside``: a flat row with the
    node's link shared (:func:`benchmarks.emulated.scaling.predict_step`); a row measured two-tier
    (``two_tier``) by :func:`benchmarks.emulated.scaling.predict_two_tier` against ``flat``, its flat twin
    of the same job, or as that twin where the cluster has one node or one worker per node (the
    exchange runs flat there)."""
    nodes = workers // per_node
    if row.get("two_tier") and per_node > 1 and nodes > 1:
        return scaling.predict_two_tier(row, flat, compute, links.with_workers(nodes), inside.with_workers(per_node))
    return scaling.predict_step(flat, compute, links.with_workers(workers), per_node=per_node)


def local_ms(row: Dict[str, Any]) -> float:
    """The row's measured work per step outside the communication wait, in ms (the ``local``
    term of :func:`benchmarks.emulated.scaling.predict_step`, at the measured worker count)."""
    return 1e3 * scaling.local_seconds(row, row["workers"])


@dataclass
class Report:
    """A digits job's rows with their projections.

    Attributes:
        rows: one per configuration, the compute-only one (``local``) left out; dense first.
        compute: the compute-only step measured in the same job, in seconds.
        fits: the alpha-beta fits the projections use (:func:`benchmarks.emulated.scaling.network`).
        fits_source: where ``fits`` come from, in words.
        per_node: workers per node of the projected clusters (``--gpus-per-node``), joined inside
            by :data:`benchmarks.emulated.scaling.NVLINK` links.
        clusters: the projected clusters: :data:`CLUSTERS`, then the user's when not among them.
        steps: ``steps[label][cluster]``: projected seconds per step, for ``clusters`` and the
            emulated cluster.
        emulated: ``emulated[label]``: seconds per step measured on the emulated cluster
            (``--emulate``: :data:`EMULATED_RATE` links, as many workers as the job), else None.
    """

    rows: List[Dict[str, Any]]
    compute: float
    fits: Dict[str, Any]
    fits_source: str
    per_node: int
    clusters: List[Cluster]
    steps: Dict[str, Dict[Cluster, float]]
    emulated: Optional[Dict[str, float]] = None

    @classmethod
    def build(cls, rows: Sequence[Dict[str, Any]], fits: Dict[str, Any], fits_source: str, target: Cluster,
              emulated_rows: Optional[Sequence[Dict[str, Any]]] = None, per_node: int = 1,
              emulated_per_node: int = 1) -> "Report":
        """Project every row of a job (which must hold the ``local`` and the dense row, and each
        two-tier row's flat twin) to :data:`CLUSTERS` and the ``target`` cluster with ``per_node``
        workers per node (:func:`projected_step`) and, with ``emulated_rows``, to the emulated
        cluster: ``emulated_per_node`` workers to a host, joined inside by the links of the
        :data:`benchmarks.emulated.scaling.NODE_FIT` fit (which ``fits`` must hold for two-tier rows then)."""
        compute = next(r["step_seconds"] for r in rows if r["compressor"] == LOCAL)
        ranked = sorted((r for r in rows if r["compressor"] != LOCAL), key=lambda r: not is_dense(r))
        if not ranked or not is_dense(ranked[0]):
            raise ValueError("a digits job's rows must include dense Horovod (compressor none)")
        clusters = list(dict.fromkeys([*CLUSTERS, target]))
        emulated = None if emulated_rows is None else {r["label"]: r["step_seconds"] for r in emulated_rows}
        report = cls(ranked, compute, fits, fits_source, per_node, clusters, {}, emulated)
        flat = {r["label"]: r for r in ranked if not r.get("hierarchical")}
        for row in ranked:
            twin = flat[flat_label(row)]
            steps = {(rate, n): projected_step(row, twin, compute, scaling.network(fits, rate), n, per_node,
                                               scaling.NVLINK) for rate, n in clusters}
            if emulated is not None:
                rate, n = report.emulated_cluster
                inside = fits.get(scaling.NODE_FIT)
                steps[rate, n] = projected_step(row, twin, compute, scaling.network(fits, rate), n,
                                                emulated_per_node, scaling.NVLINK if inside is None
                                                else AlphaBeta(**inside["model"]))
            report.steps[row["label"]] = steps
        return report

    @property
    def dense(self) -> Dict[str, Any]:
        return self.rows[0]

    @property
    def emulated_cluster(self) -> Cluster:
        """The cluster ``--emulate`` measures: :data:`EMULATED_RATE` links, the job's workers."""
        return EMULATED_RATE, self.dense["workers"]

    def points(self, row: Dict[str, Any]) -> float:
        """Test accuracy of ``row`` minus dense's, in percentage points."""
        return 100 * (row["accuracy"] - self.dense["accuracy"])

    def speedup(self, row: Dict[str, Any], cluster: Cluster) -> float:
        """Projected dense step over ``row``'s step on ``cluster``."""
        return self.steps[self.dense["label"]][cluster] / self.steps[row["label"]][cluster]


def table(report: Report, title: str) -> str:
    """The table: measured figures (with a ``node kB`` column, the bytes sent inside the host,
    when a row ran two-tier), then projected step and speed-up per cluster, then (with
    ``--emulate``) the emulated cluster's measured step beside its projection."""
    tiers = any(tier_bytes(row["stats"])[1] for row in report.rows)
    node_head = f" {'node kB':>8}" if tiers else ""
    width = max(32, *(len(row["label"]) for row in report.rows))
    measured = (f"{'configuration':{width}s} {'acc. %':>6} {'vs dense':>8} {'kB/step':>8}{node_head} {'reduction':>9} "
                f"{'union':>7} {'local ms':>8}")
    projected = "".join(f"{cluster_name(c):>17s}" for c in report.clusters)
    spans = (f"{'measured on this machine, ' + where(report.dense):^{len(measured)}s} |"
             f"{'projected: ms per step (speed-up over dense)' + per_node_note(report.per_node):^{len(projected)}s}")
    head = f"{measured} |{projected}"
    if report.emulated is not None:
        emulated = f"emulated {cluster_name(report.emulated_cluster)}"
        spans += f" | {'measured / projected ms':^{len(emulated)}s}"
        head += f" | {emulated}"
    lines = [title, spans, head, "-" * len(head)]
    dense_bytes = tier_bytes(report.dense["stats"])[0]
    for row in report.rows:
        label, steps = row["label"], report.steps[row["label"]]
        across, node = tier_bytes(row["stats"])
        node_cell = f" {node / 1e3:8.2f}" if tiers else ""
        line = (f"{label:{width}s} {100 * row['accuracy']:6.2f} {report.points(row):+8.2f} "
                f"{across / 1e3:8.2f}{node_cell} {dense_bytes / across:8.1f}x {row['stats']['union_density']:7.4f} "
                f"{local_ms(row):8.3f} |")
        line += "".join(f"{1e3 * steps[c]:10.2f} {report.speedup(row, c):5.2f}x" for c in report.clusters)
        if report.emulated is not None:
            cell = f"{1e3 * report.emulated[label]:.2f} / {1e3 * steps[report.emulated_cluster]:.2f}"
            line += f" | {cell:^{len(emulated)}s}"
        lines.append(line)
    return "\n".join(lines)


def where(row: Dict[str, Any]) -> str:
    """A row's workers in words: ``2 workers``, or ``2 hosts x 2 workers``."""
    hosts = row.get("hosts", 1)
    return f"{hosts} hosts x {row['workers'] // hosts} workers" if hosts > 1 else f"{row['workers']} workers"


def per_node_note(per_node: int) -> str:
    """The projection's node size in words (nothing for one worker per node)."""
    return f", {per_node} per node" if per_node > 1 else ""


def legend(report: Report, job: str, local_work: str) -> str:
    """How to read the table: what is measured (``local_work`` says what the local ms are), where,
    and what the projection assumes."""
    base = scaling.network(report.fits, "1gbit")
    paragraphs = [
        f"Measured ({job}): test accuracy after the last epoch and its difference to dense in points; payload kB "
        "sent per step per worker (values + indices + metadata) and the reduction against dense; union density (the "
        f"share of the gradient that reached the model); local ms: {local_work}. Per-step figures: the second half "
        "of training.",
        "Projected: benchmarks.emulated.scaling's alpha-beta model with this run's costs: step = the compute-only step "
        f"measured here ({1e3 * report.compute:.3f} ms) + local work + the wire time of the method's collectives for "
        f"the payload measured here, on links with {report.fits_source} (1 Gbit/s: alpha {1e3 * base.alpha:.2f} ms, "
        f"beta {1e9 * base.beta:.1f} ns/byte). Communication overlapped with the backward pass is not subtracted.",
    ]
    if report.per_node > 1:
        paragraphs.append(
            f"Nodes: the projected clusters have {report.per_node} workers per node (--gpus-per-node) sharing the "
            f"node's link, joined inside by NVLink-class links (alpha {1e6 * scaling.NVLINK.alpha:.0f} us, "
            f"{1e-9 / scaling.NVLINK.beta:.0f} GB/s, an assumption); a two-tier row is projected with "
            "benchmarks.emulated.scaling's two-tier model (the buffer reduce-scattered and gathered inside the node, "
            "the method across the nodes on the node's payload), and as its flat row on one node.")
    if any(row.get("two_tier") for row in report.rows):
        paragraphs.append(
            f"Two-tier rows ({TWO_TIER.lstrip('+')}: hierarchical=True, dense inside a host, the method across "
            "hosts) ran on the job's hosts: kB/step is what a worker sent across hosts, node kB what it sent inside "
            "its host (the reduce-scatter and allgather of the buffer).")
    if any(row.get("every") for row in report.rows):
        paragraphs.append(
            f"Outer rows ({OUTER.strip('+=')}=H: Horovod's horovod_sparse.torch.OuterSteps, in the same job) take H "
            "local SGD steps without exchange, then exchange the round's pseudo-gradient (none: dense, DiLoCo; a "
            "method: sparse, with error feedback) and apply it (DiLoCo's Nesterov SGD; with a method SGD at lr 1, "
            "SparseLoCo's, the residual carrying what was not sent): kB/step, collectives and "
            "local work are a round's divided by H, the union density a round's, the measured step the mean (not "
            "the median) over the steps. Their two-tier rows take each host's workers as one replica: the inner "
            "steps averaged inside the host every step (horovod_sparse.torch.DistributedOptimizer, dense, over "
            "hs.node_process_set(): in node kB), the round across hosts.")
    if report.emulated is not None:
        paragraphs.append(f"Emulated: the median step of the same job run across network namespaces joined by "
                          f"{rate_name(EMULATED_RATE)} links shaped with tc (benchmarks.emulated.netem), beside the "
                          "projection for that cluster.")
    return "\n".join(map(paragraph, paragraphs))


def paragraph(text: str) -> str:
    """``text`` wrapped at 110 columns, continuation lines indented, never between a number and
    its unit."""
    units = re.sub(r"(\d) (?=Gbit/s|Mbit/s|ms\b|ns/byte|points?\b)", "\\1\0", text)
    return textwrap.fill(units, width=110, subsequent_indent="  ").replace("\0", " ")


def recommendation(report: Report, target: Cluster, tolerance: float) -> str:
    """The fastest configuration on ``target`` among those whose accuracy is within ``tolerance``
    points of dense (dense itself included), the faster ones the band excludes, the break-even
    link on ``target`` (:func:`break_even_advice`) and when to turn the two-tier exchange on."""
    steps = {label: by_cluster[target] for label, by_cluster in report.steps.items()}
    eligible = [r for r in report.rows if report.points(r) >= -tolerance]
    best = min(eligible, key=lambda r: steps[r["label"]])
    where = f"{target[1]} workers on {rate_name(target[0])} links (--workers, --link)"
    if is_dense(best):
        lines = [f"Recommendation for {where}: dense Horovod ({1e3 * steps[best['label']]:.2f} ms per step): no "
                 f"configuration within {tolerance:g} point of dense is projected faster on this model."]
    else:
        lines = [f"Recommendation for {where}: {best['label']}, projected {1e3 * steps[best['label']]:.2f} ms per "
                 f"step, {report.speedup(best, target):.2f}x dense Horovod, test accuracy "
                 f"{100 * best['accuracy']:.2f}% ({report.points(best):+.2f} points vs dense, within {tolerance:g})."]
    faster = [r for r in report.rows if steps[r["label"]] < steps[best["label"]] and r not in eligible]
    if faster:
        lines.append(f"Faster, but more than {tolerance:g} point below dense: " + ", ".join(
            f"{r['label']} ({report.speedup(r, target):.2f}x, {report.points(r):+.2f} points)" for r in faster) + ".")
    advices = [break_even_advice(report, target, best), two_tier_advice(report, target)]
    return "\n".join(map(paragraph, lines + [advice for advice in advices if advice]))


def break_even_advice(report: Report, target: Cluster, best: Dict[str, Any]) -> Optional[str]:
    """The break-even rule of :mod:`benchmarks.gpu_check` on ``target``: for ``best`` (the
    recommended configuration's flat row) or, when dense is recommended, the sparse flat row
    projected fastest there, the link below which its step beats a dense bf16 ring all-reduce
    of the model (:func:`horovod_sparse.common.cost_model.break_even_link`, latency ignored), from
    its local work measured in this job moved to ``target``'s workers
    (:func:`benchmarks.emulated.scaling.local_seconds`) and its payload through its own collectives with
    a node's workers sharing its link (:mod:`benchmarks.emulated.wire`); "do not compress here" when
    ``target``'s link is not slower than that. None when the job has no sparse row."""
    sparse = [r for r in report.rows if r["compressor"] not in ("none", "fp16") and not r.get("two_tier")]
    if not sparse:
        return None
    chosen = [r for r in sparse if r["label"] == flat_label(best)]
    row = chosen[0] if chosen else min(sparse, key=lambda r: report.steps[r["label"]][target])
    rate, workers = target
    added = scaling.local_seconds(row, workers)
    law = functools.partial(wire_law(row["compressor"]), p=scaling.payload(row), per_node=report.per_node)
    link = break_even_link(row["parameters"], added, law, workers)
    text = (f"Break-even link of {row['label']} on {workers} workers (ring model, latency ignored): its step, with "
            f"its local work measured here ({1e3 * added:.3f} ms) and its {row['stats']['bytes_sent'] / 1e3:.2f} kB "
            f"per worker, beats a dense bf16 all-reduce of the {row['parameters']:,} parameters ")
    if link is None:
        return text + "on no link (it sends no fewer bytes): do not compress here."
    if math.isinf(link):
        return text + f"on any link (no local work measured): compressing pays on {rate_name(rate)} links."
    text += f"below {link / 1e9:.3g} Gbit/s."
    if rate_bits(rate) >= link:
        return text + f" Your {rate_name(rate)} link is not below that: do not compress here."
    return text + f" Your {rate_name(rate)} link is below that: compressing pays there."


def two_tier_advice(report: Report, target: Cluster) -> Optional[str]:
    """When to turn the two-tier exchange on for ``target``: the configurations whose two-tier
    step is projected faster than their flat one there, and those it slows; or why nothing is
    to be had (one worker per node, one node) or known (no two-tier row: the job ran on one host).
    None where neither the job nor the projection has nodes of several workers (nothing to say)."""
    switch = "hierarchical=True (or horovodrun --hierarchical-allreduce)"
    pairs = [(row, report.steps[flat_label(row)][target] / report.steps[row["label"]][target])
             for row in report.rows if row.get("two_tier")]
    if not pairs and report.per_node == 1:
        return None
    nodes = target[1] // report.per_node
    if report.per_node == 1 or nodes <= 1:
        why = "one worker per node (--gpus-per-node 1)" if report.per_node == 1 else "one node"
        return f"Two-tier exchange: nothing to gain on {target[1]} workers with {why}: it runs flat there."
    if not pairs:
        return ("Two-tier exchange: not measured (the job ran on one host); run it on several hosts (--hosts, e.g. "
                "localhost:2,127.0.0.1:2 on this machine) for its rows.")
    gains = [f"{flat_label(row)} ({gain:.2f}x)" for row, gain in pairs if gain > 1]
    losses = [f"{flat_label(row)} ({gain:.2f}x)" for row, gain in pairs if gain <= 1]
    text = f"Two-tier exchange on {nodes} nodes of {report.per_node} (projected speed-up over flat): "
    if not gains:
        return text + f"keep {switch} off: no configuration is projected faster two-tier."
    text += f"turn on {switch} for " + ", ".join(gains)
    return text + ("; keep it off for " + ", ".join(losses) if losses else "") + "."





def figures(report: Report, out: Path, name: str, title: str) -> List[Path]:
    """``<out>/<name>_accuracy_bytes.png`` (test accuracy against payload per step) and
    ``<out>/<name>_speedup.png`` (projected speed-up over dense, one panel per projected cluster)."""
    points = {r["label"]: (r["stats"]["bytes_sent"] / 1e3, 100 * r["accuracy"]) for r in report.rows}
    panels = {cluster_name(c): {r["label"]: report.speedup(r, c) for r in report.rows[1:]} for c in CLUSTERS}
    return [plots.scatter(out / f"{name}_accuracy_bytes.png", f"{title}: accuracy against bytes", points,
                          "kB sent per step per worker (log)", "test accuracy (%)"),
            plots.grouped_bars(out / f"{name}_speedup.png", f"{title}: projected speed-up over dense", panels,
                               "speed-up over dense", reference=1.0)]
