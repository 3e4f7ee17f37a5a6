"""The main job (``make demo``: ``python -m benchmarks.main_job.digits``) end to end in a small configuration,
and its report on rows made up here.

The job test reads the printed table back and checks what it claims (every method present, accuracy
near dense, bytes consistent with the density, the projection and the recommendation); no
assertion depends on a measured time beyond its being there and positive.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from benchmarks.emulated import scaling
from benchmarks.emulated.netem import rate_bits
from benchmarks.emulated.synthetic import available_methods
from benchmarks.emulated.wire import wire_law
from benchmarks.main_job import digits_report
from benchmarks.main_job.digits import parser as digits_parser
from benchmarks.main_job.digits_report import CLUSTERS, Report
from benchmarks.main_job.digits_training import OUTER
from horovod_sparse.common.cost_model import break_even_link
from horovod_sparse.methods.lags.rule import LagsOptions

ROOT = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
PNG = b"\x89PNG\r\n\x1a\n"
#: The small configuration: few epochs at a density digits forgives after them.
DENSITY = 0.05
EPOCHS = 4
#: Points below dense every method must stay within after EPOCHS epochs at DENSITY.
BAND = 10.0
TARGET = ("10gbit", 16)
#: The most a rank's density may reach per method: DENSITY, except for LAGS, whose rule may raise a
#: group's density up to its cap from times measured on the running job (so on one machine it
#: stays at DENSITY and on another reaches the cap).
CAP = {"lags": max(DENSITY, LagsOptions(density=DENSITY).max_density)}
ROW = re.compile(r"^(?P<label>\S+?)\s+(?P<accuracy>[\d.]+)\s+(?P<points>[+-][\d.]+)\s+"
                 r"(?P<kb>[\d.]+)\s+(?P<reduction>[\d.]+)x\s+(?P<union>[\d.]+)\s+(?P<local>[\d.]+) \|(?P<cells>.*)$")
CELL = re.compile(r"([\d.]+)\s+([\d.]+)x")


def demo(out: Path, *options: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "benchmarks.main_job.digits", "--epochs", str(EPOCHS), "--densities", str(DENSITY),
            "--link", TARGET[0], "--workers", str(TARGET[1]), "--out", str(out), *options]
    result = subprocess.run(argv, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return result


def table_rows(stdout: str) -> Dict[str, Dict[str, Any]]:
    """The table's rows by label, with their figures and projected cells."""
    rows = {}
    for line in stdout.splitlines():
        match = ROW.match(line)
        if match:
            row: Dict[str, Any] = match.groupdict()
            row["cells"] = [(float(ms), float(x)) for ms, x in CELL.findall(row["cells"])]
            rows[row["label"]] = row
    return rows


@pytest.fixture(scope="module")
def torch_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = demo(out)
    return result, out, json.loads((out / "digits.json").read_text())["results"]


def outer_labels() -> List[str]:
    """The outer-step rows ``make demo`` trains by default (``--outer``, ``--outer-methods``)."""
    defaults = digits_parser().parse_args([])
    return [f"{m if m == 'none' else f'{m}:density={DENSITY}'}{OUTER}{every}"
            for every in defaults.outer for m in defaults.outer_methods]


def test_every_method_mergecomp_and_the_outer_steps_are_in_the_table(torch_demo):
    result, _, _ = torch_demo
    rows = table_rows(result.stdout)
    expected = ["none", *(f"{m}:density={DENSITY}" for m in available_methods()),
                f"topk:density={DENSITY}@mergecomp", *outer_labels()]
    assert "none+outer=10" in expected
    assert sorted(rows) == sorted(expected)
    assert "measured on this machine, 2 workers" in result.stdout
    assert "projected: ms per step (speed-up over dense)" in result.stdout


def test_accuracy_is_near_dense_and_the_difference_is_right(torch_demo):
    result, _, payload = torch_demo
    rows = table_rows(result.stdout)
    dense = float(rows["none"]["accuracy"])
    assert dense > 90
    for label, row in rows.items():
        points = float(row["points"])
        assert points == pytest.approx(float(row["accuracy"]) - dense, abs=0.011), label
        assert points > -BAND, f"{label} is {points} points below dense after {EPOCHS} epochs"
    measured = {r["label"]: r for r in payload["rows"]}
    for label, row in rows.items():
        assert float(row["accuracy"]) == pytest.approx(100 * measured[label]["accuracy"], abs=0.006)


def test_bytes_follow_the_density(torch_demo):
    result, _, payload = torch_demo
    rows = table_rows(result.stdout)
    measured = {r["label"]: r for r in payload["rows"]}
    parameters = measured["none"]["parameters"]
    assert measured["none"]["stats"]["bytes_sent"] == 4 * parameters  # float32 values, every one
    for label, row in rows.items():
        stats = measured[label]["stats"]
        assert float(row["kb"]) == pytest.approx(stats["bytes_sent"] / 1e3, abs=0.006)
        assert float(row["reduction"]) == pytest.approx(4 * parameters / stats["bytes_sent"], rel=0.01, abs=0.06)
        every = measured[label]["every"]
        if label.startswith("none"):  # DiLoCo: every parameter once a round
            assert stats["bytes_sent"] == 4 * parameters / (every or 1), label
            continue
        if every:  # a round's figures spread over its steps: a tenth of the per-step row's
            per_step = measured[label.removesuffix(f"{OUTER}{every}")]["stats"]
            assert stats["bytes_sent"] <= per_step["bytes_sent"] / every * 1.5, label
        # Each rank sends at most the union's coordinates, a value and an index each, plus metadata.
        kinds = stats["bytes_sent_by_kind"]
        assert 0 < kinds["values"] <= 4 * stats["union_density"] * parameters * 1.01, label
        assert kinds["indices"] <= 4 * stats["union_density"] * parameters * 1.01, label
        cap = CAP.get(label.split(":")[0], DENSITY)
        assert DENSITY / 2 <= stats["union_density"] <= 4 * cap, label
        assert float(row["reduction"]) > 1 / (4 * cap), label


def test_projection_and_recommendation_are_present(torch_demo):
    result, out, payload = torch_demo
    rows = table_rows(result.stdout)
    for label, row in rows.items():
        assert len(row["cells"]) == len(CLUSTERS) + 1, label  # the four clusters and --link/--workers
        assert all(ms > 0 and speedup > 0 for ms, speedup in row["cells"]), label
        assert float(row["local"]) >= 0
        if label == "none":
            assert all(speedup == 1.0 for _, speedup in row["cells"])
    assert "10 Gbit/s n=16" in result.stdout and "1 Gbit/s n=64" in result.stdout
    (line,) = [text for text in result.stdout.splitlines()
               if text.startswith("Recommendation for 16 workers on 10 Gbit/s")]
    chosen = "none" if "dense Horovod" in line else line.split(": ", 1)[1].split(",")[0]
    assert float(rows[chosen]["points"]) >= -1.0
    check_break_even(" ".join(result.stdout.split()), {r["label"]: r for r in payload["rows"]}, chosen)
    assert {r["label"] for r in payload["rows"]} >= set(rows) | {"local"}
    for name in ("digits_accuracy_bytes.png", "digits_speedup.png"):
        assert f"wrote {out / name}" in result.stdout and (out / name).read_bytes()[:8] == PNG


BREAK_EVEN = re.compile(
    rf"Break-even link of (?P<label>\S+) on {TARGET[1]} workers \(ring model, latency ignored\): its step, with its "
    r"local work measured here \([\d.]+ ms\) and its [\d.]+ kB per worker, beats a dense bf16 all-reduce of the "
    r"[\d,]+ parameters (?:below (?P<gbits>[\d.e+]+) Gbit/s\. Your 10 Gbit/s link is (?P<not>not )?below that: "
    r"(?P<verdict>do not compress here|compressing pays there)\.|(?P<never>on no link \(it sends no fewer bytes\): "
    r"do not compress here\.)|(?P<always>on any link \(no local work measured\): compressing pays on 10 Gbit/s "
    r"links\.))")


def check_break_even(text: str, measured: Dict[str, Dict[str, Any]], chosen: str) -> None:
    """The recommendation's break-even sentence names the recommended configuration (or a sparse
    one when dense is recommended), and its link and verdict follow from the job's own figures:
    the row's local work moved to the target's workers and its payload through its collectives,
    against a bf16 ring all-reduce of the parameters; "do not compress here" exactly where the
    target link is not below it."""
    match = BREAK_EVEN.search(text)
    assert match, text[text.index("Recommendation for"):]
    row = measured[match["label"]]
    assert match["label"] == chosen if chosen != "none" else row["compressor"] != "none"
    law = functools.partial(wire_law(row["compressor"]), p=scaling.payload(row))
    link = break_even_link(row["parameters"], scaling.local_seconds(row, TARGET[1]), law, TARGET[1])
    if link is None:
        assert match["never"], match[0]
    elif math.isinf(link):
        assert match["always"], match[0]
    else:
        assert float(match["gbits"]) == pytest.approx(link / 1e9, rel=0.006), match[0]
        compress = rate_bits(TARGET[0]) < link
        assert (match["not"] is None, match["verdict"] == "compressing pays there") == (compress, compress), match[0]


def test_progress_lines_and_no_framework_noise(torch_demo):
    result, _, _ = torch_demo
    assert re.search(rf"^\[digits\] \d+/\d+ this machine: topk:density={DENSITY} epoch {EPOCHS}/{EPOCHS}: "
                     r"training loss [\d.]+ \(elapsed \d+m\d\ds", result.stderr, re.M)
    for noise in ("oneDNN", "tensorflow/core", "cpu_feature_guard", "<stderr>"):
        assert noise not in result.stdout + result.stderr


def test_tensorflow_runs_every_method_traced(tmp_path):
    """Keras model.fit in its default traced mode, MiCRO and MergeComp (whose exchange runs on the
    host) included; EPOCHS epochs, as the PyTorch job: MergeComp's search takes up to about 50
    steps, as many as measured times make it, and the second half of the epochs must have steps
    after it to measure (with 2 epochs it did not always)."""
    labels = ["none", f"topk:density={DENSITY}", f"micro:density={DENSITY}", f"topk:density={DENSITY}@mergecomp"]
    result = demo(tmp_path, "--framework", "tensorflow", "--compressors", *labels[1:])
    assert set(table_rows(result.stdout)) == set(labels)
    assert "TensorFlow, Keras model.fit" in result.stdout
    rows = {row["label"]: row for row in json.loads((tmp_path / "digits.json").read_text())["results"]["rows"]}
    assert [rows[label]["mode"] for label in labels] == ["tf.function"] * 4
    chosen = rows[labels[-1]]["mergecomp"]
    assert re.search(rf"^{re.escape(labels[-1])}: MergeComp chose {chosen['groups']} groups? after a search of "
                     rf"{chosen['search_steps']} steps", result.stdout, re.M)
    for noise in ("oneDNN", "tensorflow/core", "cpu_feature_guard"):
        assert noise not in result.stdout + result.stderr


# -- the report on made-up rows -------------------------------------------------------------------------------
def made_up_rows() -> List[Dict[str, Any]]:
    def row(label: str, accuracy: float, values: float, select: float) -> Dict[str, Any]:
        name = label.split(":")[0]
        return {"label": label, "compressor": name, "groups": None, "accuracy": accuracy, "workers": 2,
                "parameters": 1000, "step_seconds": 0.01, "stats": {} if name == "local" else {
                    "bytes_sent": 2 * values, "union_density": values / 4000, "collectives": 2,
                    "bytes_sent_by_kind": {"values": values, "indices": 0.0 if name == "none" else values, "meta": 0.0},
                    "seconds": {"select": select, "communicate": 1.0}}}

    return [row("local", 0.0, 0, 0), row("none", 0.95, 4e6, 0.0), row("topk:density=0.01", 0.945, 4e4, 1e-3),
            row("micro:density=0.01", 0.90, 4e4, 1e-4)]


def test_report_projects_with_the_scaling_model_and_recommends_within_the_band():
    fits = scaling.REFERENCE_FITS
    report = Report.build(made_up_rows(), fits, "made up", ("1gbit", 8))
    assert [r["label"] for r in report.rows] == ["none", "topk:density=0.01", "micro:density=0.01"]
    topk = report.rows[1]
    for rate, workers in CLUSTERS:
        expected = scaling.predict_step(topk, 0.01, scaling.network(fits, rate).with_workers(workers))
        assert report.steps["topk:density=0.01"][(rate, workers)] == pytest.approx(expected)
    # MiCRO is faster but 5 points below dense: Top-k (0.5 below) is the recommendation.
    assert report.speedup(report.rows[2], ("1gbit", 8)) > report.speedup(topk, ("1gbit", 8)) > 1
    text = " ".join(digits_report.recommendation(report, ("1gbit", 8), tolerance=1.0).split())
    assert text.startswith("Recommendation for 8 workers on 1 Gbit/s links (--workers, --link): topk:density=0.01,")
    assert "Faster, but more than 1 point below dense: micro:density=0.01" in text
    assert digits_report.recommendation(report, ("1gbit", 8), tolerance=10.0).split(": ")[1].startswith("micro")


def test_recommendation_states_the_break_even_link_and_when_not_to_compress():
    """The rule on made-up rows against its closed form written out here: Top-k's 5 ms of
    selection and 80 kB allgathered on 8 workers against a bf16 ring all-reduce of 1 M
    parameters break even at 8 (2 * 7/8 * 2e6 - 7 * 8e4) / 5e-3 = 4.7 Gbit/s: compress on 1 Gbit/s
    links, not on 10 Gbit/s ones (where Top-k is still projected faster than the float32 dense
    Horovod); with the rows' 1000 parameters it never wins."""
    rows = made_up_rows()
    for row in rows:
        row["parameters"] = 1_000_000
    rows[2]["stats"]["seconds"]["select"] = 5e-3
    report = Report.build(rows, scaling.REFERENCE_FITS, "made up", ("1gbit", 8))
    link = 8 * (2 * 7 / 8 * 2e6 - 7 * 8e4) / 5e-3
    head = ("Break-even link of topk:density=0.01 on 8 workers (ring model, latency ignored): its step, with its local "
            "work measured here (5.000 ms) and its 80.00 kB per worker, beats a dense bf16 all-reduce of the 1,000,000 "
            f"parameters below {link / 1e9:.3g} Gbit/s.")
    assert f"{link / 1e9:.3g}" == "4.7"
    for rate, verdict in [("1gbit", "Your 1 Gbit/s link is below that: compressing pays there."),
                          ("10gbit", "Your 10 Gbit/s link is not below that: do not compress here.")]:
        text = " ".join(digits_report.recommendation(report, (rate, 8), tolerance=1.0).split())
        assert "topk:density=0.01, projected" in text and f"{head} {verdict}" in text, text
    assert report.speedup(report.rows[1], ("10gbit", 8)) > 1
    small = Report.build(made_up_rows(), scaling.REFERENCE_FITS, "made up", ("1gbit", 8))
    text = " ".join(digits_report.recommendation(small, ("1gbit", 8), tolerance=1.0).split())
    assert ("beats a dense bf16 all-reduce of the 1,000 parameters on no link (it sends no fewer bytes): do not "
            "compress here.") in text
    # Dense recommended (a band no sparse row is in): the rule still speaks of the fastest sparse row.
    text = " ".join(digits_report.recommendation(report, ("1gbit", 8), tolerance=0.1).split())
    assert "dense Horovod" in text and "Break-even link of micro:density=0.01 on 8 workers" in text


def test_links_without_a_fit_scale_beta_from_the_nominal_rates():
    fits = {"1gbit": {"model": {"alpha": 1e-3, "beta": 12e-9, "workers": 2}}}
    assert scaling.network(fits, "1gbit") == scaling.AlphaBeta(1e-3, 12e-9, 1)
    assert scaling.network(fits, "25gbit").beta == pytest.approx(12e-9 / 25)
    assert scaling.network(scaling.REFERENCE_FITS, "10gbit").beta == 1.9e-9  # its own fit


# -- two hosts: the two-tier rows, and the projection to nodes ---------------------------------------------------
HOSTS = "localhost:2,127.0.0.1:2"
TWO_TIER_TARGET = ("10gbit", 16)
ROW_WITH_NODE = re.compile(r"^(?P<label>\S+?)\s+(?P<accuracy>[\d.]+)\s+(?P<points>[+-][\d.]+)\s+(?P<kb>[\d.]+)\s+"
                           r"(?P<node>[\d.]+)\s+(?P<reduction>[\d.]+)x\s+[\d.]+\s+[\d.]+ \|(?P<cells>.*)$")


def test_two_hosts_add_two_tier_rows_with_bytes_per_tier(tmp_path):
    """``--hosts`` with two hosts of two: every sparse configuration, outer steps too, also trains
    two-tier, the rows say where they ran, the table splits the bytes by tier (a two-tier outer
    row's host bytes: its inner steps' dense allreduce in the host every step, and its round's
    reduce-scatter and gather), gTop-k sends a quarter across hosts (half the pairs, one round
    instead of two), and the recommendation says, per configuration, what the projected speed-up
    over flat on 4 nodes of 4 says."""
    labels = [f"topk:density={DENSITY}", f"gtopk:density={DENSITY}", f"topk:density={DENSITY}+outer=10"]
    result = demo(tmp_path, "--hosts", HOSTS, "--epochs", "2", "--gpus-per-node", "4", "--compressors", *labels)
    twins = [label + "+two-tier" for label in labels]
    assert "2 hosts x 2 workers" in result.stdout and ", 4 per node" in result.stdout
    printed = {}
    for line in result.stdout.splitlines():
        match = ROW_WITH_NODE.match(line)
        if match:
            printed[match["label"]] = match.groupdict()
    assert sorted(printed) == sorted(["none", *labels, *twins])
    rows = {r["label"]: r for r in json.loads((tmp_path / "digits.json").read_text())["results"]["rows"]}
    for label in ["none", *labels, *twins]:
        row, node = rows[label], rows[label]["stats"]["bytes_sent_by_kind"]["node"]
        assert (row["hosts"], row["local_size"], row["two_tier"]) == (2, 2, label in twins), label
        across = row["stats"]["bytes_sent"] - node
        assert float(printed[label]["kb"]) == pytest.approx(across / 1e3, abs=0.006), label
        assert float(printed[label]["node"]) == pytest.approx(node / 1e3, abs=0.006), label
        if label in twins and row["every"]:  # the inner steps' allreduce in the host, the round's slices
            assert 4 * row["parameters"] < node <= 4 * row["parameters"] * (1 + 1 / row["every"]), label
        elif label in twins:  # the node's collectives move at most the buffer per rank
            assert 0 < node <= 4 * row["parameters"], label
        else:
            assert node == 0, label
    flat_g = rows[f"gtopk:density={DENSITY}"]["stats"]
    tier_g = rows[f"gtopk:density={DENSITY}+two-tier"]["stats"]
    assert tier_g["bytes_sent"] - tier_g["bytes_sent_by_kind"]["node"] == pytest.approx(flat_g["bytes_sent"] / 4,
                                                                                        rel=0.01)
    text = " ".join(result.stdout.split())
    advice = text[text.index("Two-tier exchange on 4 nodes of 4 (projected speed-up over flat): "):].split(" wrote ")[0]
    cells = table_rows_with_node(result.stdout)
    for label in labels:  # the target cluster's cell follows the table's four clusters
        speedup = cells[label][len(CLUSTERS)][0] / cells[label + "+two-tier"][len(CLUSTERS)][0]
        said = float(re.search(rf"{re.escape(label)} \(([\d.]+)x\)", advice)[1])
        assert said == pytest.approx(speedup, rel=0.02), (label, advice)
        turned_on = "turn on" in advice and label in advice.split("keep it off for")[0]
        assert turned_on == (said > 1), advice


def table_rows_with_node(stdout: str) -> Dict[str, List[Any]]:
    """The projected cells (ms, speed-up) of a table with the node column, by label."""
    return {m["label"]: [(float(ms), float(x)) for ms, x in CELL.findall(m["cells"])]
            for m in map(ROW_WITH_NODE.match, stdout.splitlines()) if m}


def two_host_rows(node_bytes: float) -> List[Dict[str, Any]]:
    """A made-up 2 x 2 job: compute-only, dense, Top-k flat and two-tier (half the pairs per rank,
    two more collectives, ``node_bytes`` inside the host)."""
    def row(label: str, values: float, collectives: int, select: float, two_tier: bool = False,
            node: float = 0.0) -> Dict[str, Any]:
        name = label.split(":")[0]
        kinds = {"values": values, "indices": 0.0 if name == "none" else values, "meta": 0.0, "node": node}
        return {"label": label, "compressor": name, "groups": None, "accuracy": 0.95, "workers": 4, "parameters": 1000,
                "step_seconds": 0.01, "hierarchical": two_tier, "two_tier": two_tier, "hosts": 2, "local_size": 2,
                "stats": {} if name == "local" else {
                    "bytes_sent": sum(kinds.values()), "union_density": 0.01, "collectives": collectives,
                    "bytes_sent_by_kind": kinds, "seconds": {"select": select, "communicate": 1.0}}}

    return [row("local", 0, 0, 0), row("none", 4e6, 1, 0.0), row("topk:density=0.01", 4e4, 2, 1e-3),
            row("topk:density=0.01+two-tier", 2e4, 4, 5e-4, two_tier=True, node=node_bytes)]


def test_report_projects_two_tier_rows_to_nodes_and_says_when_to_turn_it_on():
    """Against the alpha-beta laws written out here: on 8 nodes of 8 the flat row's allgather
    brings 8 x 56 remote ranks' pairs through each node link, the two-tier row's the 7 other
    nodes' (a node's 2 slices each), after 2 inside collectives over NVLink-class links and a
    selection over a quarter of the slice; on one node, or one worker per node, a two-tier row
    is its flat row (it runs flat)."""
    fits = scaling.REFERENCE_FITS
    a, b = fits["1gbit"]["model"]["alpha"], fits["1gbit"]["model"]["beta"]
    a_in, b_in = scaling.NVLINK.alpha, scaling.NVLINK.beta
    compute, node_bytes = 0.01, 4e6
    report = Report.build(two_host_rows(node_bytes), fits, "made up", ("1gbit", 64), per_node=8)
    steps = report.steps
    flat = compute + 1e-3 + 2 * a * 6 + 8 * 56 * b * 8e4
    two_tier = (compute + 5e-4 * 2 / 8 + 2 * 7 * a_in + 2 * 7 / 8 * b_in * node_bytes
                + 2 * a * 3 + 7 * b * (2 * 4e4))
    assert steps["topk:density=0.01"][("1gbit", 64)] == pytest.approx(flat, rel=1e-12)
    assert steps["topk:density=0.01+two-tier"][("1gbit", 64)] == pytest.approx(two_tier, rel=1e-12)
    one_node = compute + 1e-3 + 2 * a * 3  # 8 workers on one node: the node link carries nothing
    assert steps["topk:density=0.01"][("1gbit", 8)] == pytest.approx(one_node, rel=1e-12)
    assert steps["topk:density=0.01+two-tier"][("1gbit", 8)] == steps["topk:density=0.01"][("1gbit", 8)]
    advice = " ".join(digits_report.two_tier_advice(report, ("1gbit", 64)).split())
    assert advice == (f"Two-tier exchange on 8 nodes of 8 (projected speed-up over flat): turn on hierarchical=True "
                      f"(or horovodrun --hierarchical-allreduce) for topk:density=0.01 ({flat / two_tier:.2f}x).")
    assert "nothing to gain on 8 workers with one node" in digits_report.two_tier_advice(report, ("1gbit", 8))
    flat_nodes = Report.build(two_host_rows(node_bytes), fits, "made up", ("1gbit", 64), per_node=1)
    assert all(flat_nodes.steps["topk:density=0.01+two-tier"][c] == flat_nodes.steps["topk:density=0.01"][c]
               for c in flat_nodes.clusters)
    assert "with one worker per node (--gpus-per-node 1)" in digits_report.two_tier_advice(flat_nodes, ("1gbit", 64))
    slow_inside = Report.build(two_host_rows(1e12), fits, "made up", ("1gbit", 64), per_node=8)
    assert "keep hierarchical=True (or horovodrun --hierarchical-allreduce) off" in " ".join(
        digits_report.two_tier_advice(slow_inside, ("1gbit", 64)).split())
    single_host = Report.build(made_up_rows(), fits, "made up", ("1gbit", 64), per_node=8)
    assert "not measured (the job ran on one host)" in digits_report.two_tier_advice(single_host, ("1gbit", 64))
    assert digits_report.two_tier_advice(Report.build(made_up_rows(), fits, "made up", ("1gbit", 64)),
                                         ("1gbit", 64)) is None  # one host, one worker per node: nothing to say


@pytest.mark.parametrize("options, error", [
    (["--np", "3", "--hosts", HOSTS], "--np 3 but --hosts has 4 slots: give --hosts alone"),
    (["--hosts", "localhost:2,127.0.0.1:1"], "every host needs the same number of slots"),
    (["--hosts", "localhost"], "write each host as NAME:SLOTS"),
    (["--gpus-per-node", "3"], "--gpus-per-node 3 must divide every projected cluster's workers"),
])
def test_bad_placement_is_refused_before_training(options, error, capsys):
    from benchmarks.main_job import digits

    with pytest.raises(SystemExit):
        digits.main(options)
    assert error in capsys.readouterr().err


def test_two_tier_configurations_come_with_their_flat_twins():
    from benchmarks.main_job import digits

    def configurations(*options: str) -> List[str]:
        return digits.configurations(digits.placed(digits.parser().parse_args(list(options))))

    asked = ["--compressors", "topk:density=0.1+two-tier", "micro:density=0.1"]
    assert configurations(*asked) == ["local", "none", "topk:density=0.1", "topk:density=0.1+two-tier",
                                      "micro:density=0.1"]
    assert configurations("--hosts", HOSTS, *asked)[2:] == ["topk:density=0.1", "topk:density=0.1+two-tier",
                                                            "micro:density=0.1", "micro:density=0.1+two-tier"]
    # Outer steps too: across the hosts, the host's workers one replica.
    assert configurations("--hosts", HOSTS, "--compressors", "none+outer=10")[2:] == [
        "none+outer=10", "none+outer=10+two-tier"]
    # One worker per host: nothing to split, no twins.
    assert configurations("--hosts", "localhost:1,127.0.0.1:1", "--compressors", "micro:density=0.1")[2:] == [
        "micro:density=0.1"]
