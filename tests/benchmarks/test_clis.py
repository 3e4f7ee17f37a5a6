"""The benchmark CLIs, smoke-run at tiny sizes on real horovodrun jobs (and, as root, on a real
emulated cluster): the printed format, the JSON they write, and the invariants of their figures.
No timing is asserted: figures measured here are noise, only their plumbing is checked."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from benchmarks.emulated import netem, scaling, synthetic, synthetic_harness
from benchmarks.emulated.cluster import add_ratios, merge_repeats, place, sweep, table
from benchmarks.shared import models, tiers
from horovod_sparse.common.cost_model import AlphaBeta
from tests.support.launch import HANG_TIMEOUT, SUITE_HOROVODRUN, TORCHRUN, launcher_env

ROOT = Path(__file__).resolve().parent.parent.parent
PNG = b"\x89PNG\r\n\x1a\n"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def run(argv: List[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, env=launcher_env(), cwd=ROOT, capture_output=True, text=True, timeout=HANG_TIMEOUT)
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return result


def run_torch_synthetic(out: Path, module: str, nproc: int, sweep: List[Dict[str, Any]],
                        *extra: str) -> Tuple[str, List[Dict[str, Any]], str]:
    """``torchrun`` of the synthetic benchmark ``module`` on ``nproc`` local processes (resnet20,
    batch 4, two timed iterations of one batch, ``extra`` options) over ``sweep``: rank 0's
    output, the result rows and the command they record."""
    (out / "sweep.json").write_text(json.dumps(sweep))
    result = run([TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "-m", module, "--model", "resnet20",
                  "--batch-size", "4", "--num-batches-per-iter", "1", "--num-iters", "2", *extra,
                  "--sweep", str(out / "sweep.json"), "--results", str(out / "rows.json")])
    payload = json.loads((out / "rows.json").read_text())
    return result.stdout, payload["results"], payload["command"]


def rank0_lines(stdout: str) -> List[str]:
    """Rank 0's lines of a horovodrun output, without horovodrun's ``[0]<stdout>:`` prefix."""
    return [line.split(":", 1)[1] for line in stdout.splitlines() if line.startswith("[0]<stdout>:")]


# -- models ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, parameters", [("resnet20", 272_474), ("resnet50", 25_557_032),
                                              ("vgg", 26_766_922), ("lstm", 19_780_400),
                                              ("gpt2small", 124_439_808)])
def test_models_have_their_published_sizes_and_train(name, parameters):
    spec = models.model_spec(name)
    size = 32 if name not in ("lstm", "gpt2small") else 5  # small inputs: every model takes any size from here up
    model = spec.build(size)
    assert models.count_parameters(model) == parameters
    inputs, targets = spec.batch(2, size, torch.Generator().manual_seed(0))
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_the_transformer_is_causal():
    """Changing tokens from position 4 on leaves the logits of positions 0-3 as they were."""
    torch.manual_seed(0)
    model = models.CausalTransformer(50, 8, 16, 2, 2).eval()
    tokens = torch.randint(50, (2, 8), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 4:] = (changed[:, 4:] + 1) % 50
    before, after = model(tokens), model(changed)
    assert torch.allclose(before[:, :, :4], after[:, :, :4]) and not torch.allclose(before[:, :, 4:], after[:, :, 4:])


def test_vgg_is_communication_heavy():
    model = models.vgg()
    linear = sum(m.weight.numel() + m.bias.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert models.count_parameters(model) >= 20_000_000 and linear / models.count_parameters(model) > 0.9


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError, match="resnet20.*vgg"):
        models.model_spec("alexnet")


# -- small pure pieces ---------------------------------------------------------------------------------
def test_rates_and_token_bucket():
    assert netem.rate_bits("1gbit") == 1e9 and netem.rate_bits("100mbit") == 1e8
    assert netem.tbf_arguments("1gbit")[:3] == ["tbf", "rate", "1gbit"]
    assert int(netem.tbf_arguments("10gbit")[4]) == 1_250_000  # 1 ms of traffic
    assert int(netem.tbf_arguments("1mbit")[4]) == 16 * 1024  # never below a full segment
    with pytest.raises(ValueError, match="1gbit"):
        netem.rate_bits("fast")


def test_compressor_options_and_sweeps():
    assert synthetic_harness.compressor_options("topk:min_numel=0", 0.01) == ("topk", {"min_numel": 0, "density": 0.01})
    assert synthetic_harness.compressor_options("none", 0.01) == ("none", {})
    assert synthetic.parse_groups("3") == 3 and synthetic.parse_groups("model") == "model"
    assert synthetic.parse_groups("buckets:64") == "buckets:64"
    assert "topk" in synthetic.available_methods()
    configs = sweep(["topk", "dgc"], [0.001, 0.01])
    assert configs[:2] == [{"optimizer": "local"}, {"compressor": "none"}] and len(configs) == 6
    rows = add_ratios([{"optimizer": "local", "compressor": "none", "total_img_sec": 40.0},
                       {"optimizer": "hs", "compressor": "none", "total_img_sec": 10.0},
                       {"optimizer": "hs", "compressor": "topk", "total_img_sec": 30.0}])
    assert [r["speedup_vs_dense"] for r in rows] == [4.0, 1.0, 3.0]
    assert [r["efficiency"] for r in rows] == [1.0, 0.25, 0.75]
    runs = [{"label": label, "total_img_sec": t, "workers": 2, "batch_size": 4, "stats": {"t": t}}
            for t, label in [(10.0, "a"), (5.0, "b"), (30.0, "a"), (12.0, "a")]]
    a, b = merge_repeats(runs)
    assert (a["label"], a["total_img_sec"], a["repeats"], a["stats"]) == ("a", 12.0, [10.0, 30.0, 12.0], {"t": 12.0})
    assert a["img_sec_per_worker"] == 6.0 and a["step_seconds"] == pytest.approx(4 / 6.0)
    assert b["repeats"] == [5.0]


def test_two_tier_configurations_and_ratios():
    """A sweep on hosts of several workers: each method's two-tier twin right after its flat row;
    ``--hierarchical`` in the CLI or a sweep entry; the flat twin's ratio; bytes per tier."""
    configs = sweep(["topk"], [0.001, 0.01], two_tier=True)
    assert configs[2:] == [{"compressor": "topk", "density": 0.001}, {"compressor": "topk", "density": 0.001,
                                                                      "hierarchical": True},
                           {"compressor": "topk", "density": 0.01}, {"compressor": "topk", "density": 0.01,
                                                                     "hierarchical": True}]
    args = synthetic.parser().parse_args(["--compressor", "topk", "--density", "0.01", "--hierarchical"])
    assert args.hierarchical and synthetic_harness.describe(args) == "topk(density=0.01) two-tier"
    assert synthetic_harness.wants_process_sets([args])
    flat = synthetic.parser().parse_args(["--optimizer", "local", "--hierarchical"])
    assert not synthetic_harness.wants_process_sets([flat])
    assert synthetic_harness.describe(flat) == "local (no exchange)"
    with pytest.raises(ValueError, match="HOROVOD_HIERARCHICAL_ALLREDUCE"):
        synthetic_harness.check_stock(synthetic.parser().parse_args(["--optimizer", "stock", "--hierarchical"]), "none")
    stats = {"bytes_sent": 110.0, "bytes_sent_by_kind": {"values": 6.0, "indices": 4.0, "meta": 0.0, "node": 100.0},
             "seconds": {}}
    assert tiers.tier_bytes(stats) == (10.0, 100.0) and tiers.tier_bytes({}) == (0.0, 0.0)
    old = {"bytes_sent": 10.0, "bytes_sent_by_kind": {"values": 6.0, "indices": 4.0, "meta": 0.0}}
    assert tiers.tier_bytes(old) == (10.0, 0.0)  # written before the node kind
    assert tiers.tier_bytes({"bytes_sent": 5.0}) == (5.0, 0.0)  # DDP's own allreduce, PowerSGD: no kinds
    row = {"workers": 4, "workers_per_host": 2, "rate": "1gbit", "batch_size": 16, "img_sec_per_worker": 1.0,
           "stats": stats}
    rows = add_ratios([{**row, "label": "local", "optimizer": "local", "compressor": "none", "total_img_sec": 40.0},
                       {**row, "label": "none", "optimizer": "hs", "compressor": "none", "total_img_sec": 10.0},
                       {**row, "label": "topk", "optimizer": "hs", "compressor": "topk", "options": {"density": 0.01},
                        "total_img_sec": 20.0},
                       {**row, "label": "topk two-tier", "optimizer": "hs", "compressor": "topk",
                        "options": {"density": 0.01}, "hierarchical": True, "total_img_sec": 30.0},
                       {**row, "label": "micro two-tier", "optimizer": "hs", "compressor": "micro",
                        "hierarchical": True, "total_img_sec": 30.0}])
    assert [r.get("speedup_vs_flat") for r in rows] == [None, None, None, 1.5, None]
    assert place(rows[0]) == "2x2" and place({"workers": 4}) == "4x1"
    lines = table(rows).splitlines()
    assert lines[5].split()[:2] == ["2x2", "1gbit"] and "1.50" in lines[5] and "0.00 MB" in lines[5]


def test_emulated_hosts_of_several_workers():
    """The layout alone (building the namespaces needs root: the cluster test does)."""
    cluster = netem.EmulatedCluster(4, "1gbit", workers_per_host=2)
    assert (cluster.hosts, len(cluster.namespaces), cluster.addresses) == (2, 2, ["10.213.0.1", "10.213.0.2"])
    assert [cluster.host_of(w) for w in range(4)] == [0, 0, 1, 1]
    assert cluster.exec_argv(3, ["x"]) == ["ip", "netns", "exec", cluster.namespaces[1], "x"]
    assert netem.EmulatedCluster(3, None).hosts == 3  # one worker per host by default
    with pytest.raises(ValueError, match="multiple"):
        netem.EmulatedCluster(3, "1gbit", workers_per_host=2)


def test_wire_models_follow_their_laws():
    ab = AlphaBeta(alpha=1e-3, beta=1e-9, workers=2)
    p = scaling.Payload(values=4e6, indices=4e6, meta=0.0, collectives=1, workers=2)
    # n = 2: one allreduce of 8 MB = 2 alpha + 2 (1/2) beta 8 MB; one allgather = alpha + beta 8 MB.
    assert scaling.WIRE["none"](ab, p) == pytest.approx(2e-3 + 8e-3)
    assert scaling.WIRE["topk"](ab, p) == pytest.approx(1e-3 + 8e-3)
    big = ab.with_workers(64)
    assert scaling.WIRE["topk"](big, p) == pytest.approx(6e-3 + 63 * 8e-3)  # build-up: (n - 1) s
    assert scaling.WIRE["none"](big, p) == pytest.approx(12e-3 + 2 * 63 / 64 * 8e-3)  # bandwidth-bound
    # MiCRO: indices shrink as 1/n per rank, values are one allreduce of the union.
    assert scaling.WIRE["micro"](big, p) == pytest.approx(6e-3 + 63 * 1e-9 * 4e6 * 2 / 64 + 2 * 63 / 64 * 4e-3)
    assert scaling.WIRE["gtopk"](big, p) == pytest.approx(6 * (1e-3 + 8e-3))  # log2 n rounds of k pairs


def test_wire_models_on_nodes_sharing_a_link():
    """Ranks placed several to a node share its link: an allgather brings every remote rank's
    bytes to each of the node's ranks; a node-aware ring crosses each link once; gTop-k's first
    log2(per_node) rounds stay inside."""
    ab, p = AlphaBeta(alpha=1e-3, beta=1e-9, workers=64), scaling.Payload(4e6, 4e6, 0.0, 1, 2)
    assert scaling.WIRE["topk"](ab, p, 8) == pytest.approx(6e-3 + 8 * 56 * 8e-3)
    assert scaling.WIRE["none"](ab, p, 8) == scaling.WIRE["none"](ab, p)
    assert scaling.WIRE["gtopk"](ab, p, 8) == pytest.approx(3 * 1e-3 + 3 * (1e-3 + 8 * 8e-3))
    assert scaling.WIRE["topk"](ab, p, 1) == scaling.WIRE["topk"](ab, p)  # one rank a node: as before


def test_two_tier_model():
    """The two-tier step: payload per node, selection in a slice, a ring reduce-scatter and
    allgather inside; validation is exact on rows the model generated, and the projection
    compares each method flat and two-tier on the same nodes."""
    fits = {"1gbit": {"model": {"alpha": 1e-4, "beta": 8e-9, "workers": 2}},
            scaling.NODE_FIT: {"model": {"alpha": 1e-5, "beta": 1e-10, "workers": 2}}}
    assert scaling.base_rate(fits) == "1gbit"
    base = {"optimizer": "hs", "compressor": "topk", "options": {"density": 0.01}, "groups": None, "workers": 4,
            "workers_per_host": 2, "rate": "1gbit", "hosts": 2, "local_size": 2}
    flat = {**base, "label": "topk", "stats": {"seconds": {"select": 0.2, "communicate": 1.0}, "collectives": 3,
                                               "bytes_sent_by_kind": {"values": 1e5, "indices": 1e5, "meta": 0.0,
                                                                      "node": 0.0}}}
    two = {**base, "label": "topk two-tier", "hierarchical": True, "two_tier": True,
           "stats": {"seconds": {"select": 0.1, "communicate": 1.0}, "collectives": 7,
                     "bytes_sent_by_kind": {"values": 5e4, "indices": 5e4, "meta": 0.0, "node": 4e7}}}
    assert scaling.payload(two) == scaling.Payload(1e5, 1e5, 0.0, 7, 2)  # per node, on the hosts
    assert scaling.local_seconds(two, 64, 8) == pytest.approx(0.1 * 2 / 8)
    inside = AlphaBeta(1e-5, 1e-10, 2)
    assert scaling.node_seconds(two, inside, 4) == pytest.approx(4 * 1e-5 + 1e-10 * 4e7)
    across = AlphaBeta(1e-4, 8e-9, 2)
    expected = 0.5 + 0.1 + 4 * 1e-5 + 1e-10 * 4e7 + scaling.WIRE["topk"](across, scaling.Payload(1e5, 1e5, 0, 3, 2))
    assert scaling.predict_two_tier(two, flat, 0.5, across, inside) == pytest.approx(expected)
    local = {"optimizer": "local", "compressor": "none", "workers": 4, "rate": "1gbit", "step_seconds": 0.5,
             "stats": {}}
    flat["step_seconds"] = scaling.predict_step(flat, 0.5, across.with_workers(4), per_node=2)
    two["step_seconds"] = expected
    rows = [local, flat, two]
    assert [v["error"] for v in scaling.validate(rows, fits)] == pytest.approx([0.0, 0.0])
    assert scaling.flat_twin(rows, two) is flat
    (p1, p10) = scaling.project_nodes(rows, fits, 8, 8, ["1gbit", "10gbit"])
    assert (p1["nodes"], p1["per_node"], p1["label"]) == (8, 8, "topk")
    assert p1["flat_step"] > p10["flat_step"] and p1["speedup"] == pytest.approx(p1["flat_step"] / p1["two_tier_step"])


def test_scaling_validation_is_exact_on_rows_the_model_generated():
    fits = {"1gbit": {"model": {"alpha": 1e-4, "beta": 8e-9, "workers": 2}}}
    stats = {"seconds": {"select": 0.2, "communicate": 9.0}, "collectives": 3,
             "bytes_sent_by_kind": {"values": 1e5, "indices": 1e5, "meta": 16}}
    rows = [{"optimizer": "local", "workers": 4, "rate": "1gbit", "step_seconds": 0.5, "stats": {}}]
    for method in ("none", "topk", "micro", "gtopk"):
        row = {"optimizer": "hs", "compressor": method, "label": method, "workers": 4, "rate": "1gbit",
               "stats": stats}
        row["step_seconds"] = scaling.predict_step(row, 0.5, AlphaBeta(1e-4, 8e-9, 4))
        rows.append(row)
    assert [v["error"] for v in scaling.validate(rows, fits)] == pytest.approx([0.0] * 4)
    micro = next(r for r in rows if r.get("label") == "micro")
    assert scaling.local_seconds(micro, 8) == pytest.approx(0.1)  # a partition of d/n: half at 2x n


def test_front_door_lists_and_refuses():
    listing = run([sys.executable, "-m", "benchmarks"]).stdout
    for name in ("synthetic", "convergence", "cluster", "overhead", "digits"):
        assert re.search(rf"^  {name} ", listing, re.M)
    result = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], env=launcher_env(), cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "unknown benchmark 'nope'" in result.stderr


# -- synthetic: one launch, four configurations ----------------------------------------------------------
SYNTHETIC_SWEEP = [{"compressor": "none"}, {"compressor": "topk", "density": 0.01},
                   {"compressor": "none", "optimizer": "stock"}, {"optimizer": "local"}]


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    (out / "sweep.json").write_text(json.dumps(SYNTHETIC_SWEEP))
    result = run([*SUITE_HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "benchmarks",
                  "synthetic", "--model", "resnet20", "--batch-size", "4", "--num-warmup-batches", "1",
                  "--num-batches-per-iter", "1", "--num-iters", "2", "--sweep", str(out / "sweep.json"),
                  "--results", str(out / "rows.json")])
    return rank0_lines(result.stdout), json.loads((out / "rows.json").read_text())["results"]


HOROVOD_BLOCK = re.compile(
    r"Model: resnet20\nBatch size: 4\nNumber of CPUs: 2\nCompressor: (?P<label>.+)\nRunning warmup\.\.\.\n"
    r"Running benchmark\.\.\.\nIter #0: (?P<i0>[\d.]+) img/sec per CPU\nIter #1: (?P<i1>[\d.]+) img/sec per CPU\n"
    r"Img/sec per CPU: (?P<mean>[\d.]+) \+-(?P<conf>[\d.]+)\n"
    r"Total img/sec on 2 CPU\(s\): (?P<total>[\d.]+) \+-(?P<tconf>[\d.]+)\n")


def test_synthetic_prints_horovods_format(synthetic_run):
    lines, _ = synthetic_run
    blocks = list(HOROVOD_BLOCK.finditer("\n".join(lines) + "\n"))
    assert [b["label"] for b in blocks] == ["none", "topk(density=0.01)", "none [stock Horovod]",
                                            "local (no exchange)"]
    for b in blocks:
        mean = float(b["mean"])
        assert abs(mean - (float(b["i0"]) + float(b["i1"])) / 2) <= 0.1
        assert abs(float(b["total"]) - 2 * mean) <= 0.15


def test_synthetic_reports_sparsification_figures(synthetic_run):
    lines, rows = synthetic_run
    text = "\n".join(lines)
    dense, topk, stock, local = rows
    assert [r["optimizer"] for r in rows] == ["hs", "hs", "stock", "local"]
    parameters = models.count_parameters(models.resnet20())
    assert dense["parameters"] == parameters and dense["workers"] == 2
    assert dense["stats"]["bytes_sent"] == 4 * parameters and dense["stats"]["union_density"] == 1.0
    # Top-k's target with its default grouping, flat buckets of at most 25 MiB: ResNet-20's
    # 1.1 MB of float32 is one bucket, k = int(0.01 * numel) of it.
    target = int(0.01 * parameters) / parameters
    assert topk["stats"]["target_density"] == pytest.approx(target)
    assert target <= topk["stats"]["union_density"] <= 2 * target
    assert topk["stats"]["bytes_sent"] < dense["stats"]["bytes_sent"] / 10
    assert {"select", "communicate"} <= set(topk["stats"]["seconds"])
    assert stock["stats"] == {} and local["stats"] == {}
    assert re.search(r"^Union density: [\d.]+ \(target [\d.]+, density ratio [\d.]+\)$", text, re.M)
    assert re.search(r"^Bytes per step per worker: sent .+, received .+ \(dense gradient 1\.1 MB\)$", text, re.M)
    assert re.search(r"^Time per step: [\d.]+ ms \(.*select [\d.]+ ms.*\)$", text, re.M)


def test_synthetic_tensorflow_prints_the_same_format(tmp_path):
    (tmp_path / "sweep.json").write_text(json.dumps(SYNTHETIC_SWEEP[:2]))
    result = run([*SUITE_HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "benchmarks",
                  "synthetic", "--framework", "tensorflow", "--model", "resnet20", "--batch-size", "4",
                  "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2",
                  "--sweep", str(tmp_path / "sweep.json"), "--results", str(tmp_path / "rows.json")])
    blocks = list(HOROVOD_BLOCK.finditer("\n".join(rank0_lines(result.stdout)) + "\n"))
    assert [b["label"] for b in blocks] == ["none", "topk(density=0.01)"]
    dense, topk = json.loads((tmp_path / "rows.json").read_text())["results"]
    assert dense["framework"] == "tensorflow" and topk["framework"] == "tensorflow"
    # The Keras ResNet-20 has the PyTorch one's layers, hence its parameter count.
    assert dense["parameters"] == models.count_parameters(models.resnet20())
    assert dense["stats"]["bytes_sent"] == 4 * dense["parameters"]
    assert topk["stats"]["bytes_sent"] < dense["stats"]["bytes_sent"] / 10


# -- overhead -----------------------------------------------------------------------------------------------
def test_overhead_compares_both_optimizers(tmp_path):
    result = run([*SUITE_HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "benchmarks",
                  "overhead", "--batch-size", "2", "--warmup", "1", "--rounds", "2", "--steps", "1",
                  "--results", str(tmp_path / "overhead.json")])
    text = "\n".join(rank0_lines(result.stdout))
    assert re.search(r"^Overhead: [+-][\d.]+% wall time, [+-][\d.]+% CPU time \(target <= 5%\)$", text, re.M)
    figures = json.loads((tmp_path / "overhead.json").read_text())["results"]
    for clock in ("wall", "cpu"):
        assert len(figures["times"][clock]["stock"]) == len(figures["times"][clock]["hs"]) == 2
        ratios = [h / s for h, s in zip(figures["times"][clock]["hs"], figures["times"][clock]["stock"])]
        assert figures[clock]["overhead"] == pytest.approx(sorted(ratios)[0] / 2 + sorted(ratios)[1] / 2 - 1)


def test_waiting_compares_the_spin_with_the_sleeping_wait(tmp_path):
    result = run([*SUITE_HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "benchmarks",
                  "waiting", "--rounds", "2", "--steps", "3", "--large", "1000", "--passes", "1",
                  "--results", str(tmp_path / "waiting.json")])
    text = "\n".join(rank0_lines(result.stdout))
    rows = json.loads((tmp_path / "waiting.json").read_text())["results"]["rows"]
    assert [(r["loop"], r["way"]) for r in rows] == [("latency", "spin"), ("latency", "sleep"), ("work", "spin"),
                                                      ("work", "sleep")]
    for spin, sleep in (rows[:2], rows[2:]):
        assert sleep["spin_over_sleep"] == pytest.approx(spin["seconds"] / sleep["seconds"])
        assert re.search(rf"^{sleep['loop']} +sleep +{sleep['seconds'] * 1e3:.3f} .* {sleep['spin_over_sleep']:.2f}$",
                         text, re.M)


@pytest.mark.parametrize("front_end", ["horovod", "ddp"])
def test_step_end_times_the_agreement_beside_no_policy_and_dense(tmp_path, front_end):
    options = ["step_end", "--methods", "topk", "--rounds", "2", "--steps", "2",
               "--results", str(tmp_path / "end.json")]
    if front_end == "horovod":
        result = run([*SUITE_HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "benchmarks",
                      *options])
        text = "\n".join(rank0_lines(result.stdout))
    else:
        text = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "benchmarks", *options, "--ddp"]).stdout
    payload = json.loads((tmp_path / "end.json").read_text())["results"]
    rows = payload["rows"]
    assert payload["front_end"] == front_end and payload["ranks"] == 2
    assert [r["copy"] for r in rows] == ["dense", "topk", "topk nonfinite=None"]
    policy, none = rows[1], rows[2]
    assert policy["policy_over_none"] == pytest.approx(policy["seconds"] / none["seconds"])
    assert re.search(rf"^topk +{policy['seconds'] * 1e3:.3f} +{policy['policy_over_none']:.3f}$", text, re.M)


@pytest.mark.parametrize("files, quota", [({"cpu.max": "max 100000\n"}, None),
                                          ({"cpu.max": "200000 100000\n"}, 2.0),
                                          ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
                                          ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"},
                                           1.5),
                                          ({}, None)])
def test_waiting_reads_the_cpu_quota_of_cgroup_v2_and_v1(tmp_path, files, quota):
    from horovod_sparse.torch.waiting import cpu_quota

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == quota


def test_waiting_counts_no_more_cores_than_the_quota_gives():
    """A container limited to 2 CPUs on a 64-core host sleeps beside 2 local ranks, as a 2-core host does."""
    from horovod_sparse.torch.waiting import strategy, usable_cores

    assert [usable_cores(64, q) for q in (None, 2.0, 1.5, 0.2, 100.0)] == [64, 2, 2, 1, 64]
    assert strategy("auto", cores=usable_cores(64, 2.0), local_ranks=2) == "sleep"
    assert strategy("auto", cores=usable_cores(64, None), local_ranks=2) == "spin"


def test_waiting_spins_only_where_the_host_has_cores_to_spare():
    from horovod_sparse.torch.waiting import strategy

    assert strategy("auto", cores=2, local_ranks=2) == "sleep"
    assert strategy("auto", cores=3, local_ranks=2) == "sleep"
    assert strategy("auto", cores=4, local_ranks=2) == "spin"
    assert strategy("auto", cores=64, local_ranks=8) == "spin"
    assert strategy("spin", cores=2, local_ranks=4) == "spin"
    assert strategy("sleep", cores=64, local_ranks=1) == "sleep"
    with pytest.raises(ValueError, match="HOROVOD_SPARSE_WAIT='fast' is not one of auto, spin, sleep"):
        strategy("fast", cores=2, local_ranks=2)


# -- MiCRO/ExDyna controllers and selection cost -------------------------------------------------------------
def test_controllers_tables_and_json(tmp_path):
    result = run([*SUITE_HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "benchmarks",
                  "controllers", "--steps", "12", "--densities", "0.01", "--hidden", "64", "--drain-after", "4",
                  "--drain-cap", "2", "--results", str(tmp_path / "controllers.json")])
    text = "\n".join(rank0_lines(result.stdout))
    for heading in ("1. density tracking", "2. balancing", "3. drain"):
        assert heading in text
    figures = json.loads((tmp_path / "controllers.json").read_text())["results"]
    assert {(r["stream"], r["controller"]) for r in figures["tracking"]} == \
        {(s, c) for s in ("digits", "smooth") for c in ("histogram", "paper")}
    assert [r["label"] for r in figures["balancing"]] == ["MiCRO static partitions", "ExDyna, paper's pairwise rule",
                                                          "ExDyna, default (prefix) rule"]
    for row in figures["tracking"] + figures["balancing"]:
        assert row["mean_deviation"] >= 0 and not row["diverged"]
    assert len(figures["drain"]) == 2


def test_sparseloco_wire_times_each_step_of_the_payload(tmp_path):
    """``benchmarks.costs.sparseloco_wire`` on two small buffers: a row each with SparseLoCo's
    count of the buffer (the paper's 64 of 4,096, a last chunk's share), every step's time and its
    ratio to the read pass, printed as written."""
    result = run([sys.executable, "-m", "benchmarks", "sparseloco_wire", "--numel", "85002", "8192",
                  "--repeats", "1", "--results", str(tmp_path / "wire.json")])
    figures = json.loads((tmp_path / "wire.json").read_text())["results"]
    assert (figures["density"], figures["workers"]) == (1 / 64, 2)
    assert [(row["numel"], row["m"]) for row in figures["rows"]] == [(85002, 20 * 64 + 3082 // 64), (8192, 128)]
    for row in figures["rows"]:
        line = f"{row['numel']:10d} {row['m']:8d} {row['sum_ms']:7.2f}"
        for name in ("quantize", "pack codes", "unpack codes", "pack offsets", "unpack offsets"):
            assert row[name + "_over_sum"] == pytest.approx(row[name + "_ms"] / row["sum_ms"])
            line += f"{row[name + '_ms']:11.2f} {row[name + '_over_sum']:7.2f}"
        assert line in result.stdout, result.stdout


def test_selection_cost_prints_ratios(tmp_path):
    result = run([sys.executable, "-m", "benchmarks", "selection_cost", "--gradient", "resnet20", "--batch-size", "2",
                  "--workers", "2", "--repeats", "3", "--results", str(tmp_path / "selection.json")])
    figures = json.loads((tmp_path / "selection.json").read_text())
    assert "elements (resnet20's gradient at batch 2)" in result.stdout
    assert figures["whole_buffer"]["numel"] == models.count_parameters(models.model_spec("resnet20").build(32))
    (row,) = figures["partitions"]
    assert row["workers"] == 2 and row["histogram_over_topk"] == pytest.approx(row["histogram_ms"] / row["topk_ms"])
    assert f"{row['histogram_over_topk']:.4f}" in result.stdout
    whole = figures["whole_buffer"]
    for name in ("torch.topk", "top_k", "threshold", "gaussiank", "sparseloco", "sparseloco keys"):
        assert whole[f"{name}_over_sum"] == pytest.approx(whole[f"{name}_ms"] / whole["sum_ms"])
        assert f"{whole[name + '_over_sum']:8.2f}" in result.stdout
    tensorflow = whole["tensorflow"]  # TensorFlow's rows, against its own read pass
    assert "whole buffer, TensorFlow: read pass (tf.reduce_sum)" in result.stdout
    for name in ("tf.math.top_k", "top_k", "top_k traced"):
        assert tensorflow[f"{name}_over_sum"] == pytest.approx(tensorflow[f"{name}_ms"] / tensorflow["sum_ms"])
        assert f"{tensorflow[name + '_ms']:13.1f} {tensorflow[name + '_over_sum']:8.2f}" in result.stdout


def test_top_k_paths_times_both_paths_on_each_size(tmp_path):
    result = run([sys.executable, "-m", "benchmarks", "top_k_paths", "--sizes", "3000", "70000", "--densities", "0.01",
                  "--repeats", "1", "--results", str(tmp_path / "paths.json")])
    rows = json.loads((tmp_path / "paths.json").read_text())["rows"]
    assert [(r["numel"], r["k"]) for r in rows] == [(3000, 30), (70000, 700)]
    for r in rows:
        assert r["device_over_host"] == pytest.approx(r["device_ms"] / r["host_ms"])
        assert f"{r['numel']:>10,} {r['density']:>8} {r['k']:>7,} {r['host_ms']:>9.3f}" in result.stdout


def test_gradient_loading_times_both_ways_and_says_which_the_group_picks(tmp_path):
    """Both ways of loading a group's gradients are timed after checking they leave the same
    residual (it fails otherwise); ``picks`` is the group's own choice."""
    result = run([sys.executable, "-m", "benchmarks", "gradient_loading", "--models", "digits", "resnet20",
                  "--repeats", "1", "--results", str(tmp_path / "loading.json")])
    rows = json.loads((tmp_path / "loading.json").read_text())["rows"]
    assert [(r["model"], r["tensors"], r["numel"], r["picks"]) for r in rows] == [
        ("digits", 6, 85_002, "staged"), ("resnet20", 65, 272_474, "staged")]
    for r in rows:
        assert r["in_place_over_staged"] == pytest.approx(r["in_place_ms"] / r["staged_ms"])
        assert f"{r['staged_ms']:>10.3f} {r['in_place_ms']:>12.3f}" in result.stdout


def test_top_k_paths_keys_forms_the_same_keys_both_ways(tmp_path):
    """``--keys`` times the accelerators' add and the host's widening of the keys, after checking
    they are the same keys (it fails otherwise)."""
    result = run([sys.executable, "-m", "benchmarks", "top_k_paths", "--keys", "--sizes", "3000", "70000",
                  "--repeats", "1", "--results", str(tmp_path / "keys.json")])
    rows = json.loads((tmp_path / "keys.json").read_text())["rows"]
    assert [r["numel"] for r in rows] == [3000, 17 * 4096]  # whole rows of 4,096 (or one shorter row)
    for r in rows:
        assert r["widen_over_add"] == pytest.approx(r["widen_ms"] / r["add_ms"])
        assert f"{r['numel']:>10,} {r['add_ms']:>9.3f} {r['widen_ms']:>9.3f}" in result.stdout


# -- grouping, MergeComp, LAGS ------------------------------------------------------------------------------
def test_grouping_overhead_compares_groupings_and_reports_the_search(tmp_path):
    result = run([*SUITE_HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "benchmarks",
                  "grouping_overhead", "--compressors", "topk:density=0.05", "--batch-size", "2", "--size", "8",
                  "--warmup", "1", "--rounds", "2", "--steps", "1", "--search-warmup", "1", "--search-timed", "1",
                  "--results", str(tmp_path / "grouping.json")])
    text = "\n".join(rank0_lines(result.stdout))
    assert re.search(r"^MergeComp search \(topk:density=0.05\): \d+ candidates, \d+ steps", text, re.M)
    rows = json.loads((tmp_path / "grouping.json").read_text())["results"]["rows"]
    assert [r["grouping"] for r in rows] == ["tensor", "size:8192", "model", "mergecomp"]
    # The best fixed grouping (by median step time) is the ratios' yardstick. Another grouping's
    # median of per-round ratios may fall below 1 on a noisy machine, so only its own is checked.
    best = rows[0]["best_fixed"]
    assert all(r["best_fixed"] == best for r in rows)
    assert best == min(rows[:3], key=lambda r: r["step_seconds"])["grouping"]
    assert next(r for r in rows if r["grouping"] == best)["ratio_to_best_fixed"] == 1.0


def test_lags_overlap_reports_the_model_and_the_chosen_densities(tmp_path):
    result = run([*SUITE_HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "benchmarks",
                  "lags_overlap", "--batch-size", "2", "--size", "8", "--warmup", "3", "--rounds", "1", "--steps", "1",
                  "--sweep", "5", "--results", str(tmp_path / "lags.json")])
    text = "\n".join(rank0_lines(result.stdout))
    assert "Measured alpha-beta model" in text and "LAGS's own start-up model" in text and "local costs" in text
    figures = json.loads((tmp_path / "lags.json").read_text())["results"]
    assert [r["copy"] for r in figures["rows"]] == ["dense", "topk", "lags", "lags-uniform", "lags-fixed-0.05"]
    assert min(figures["lags_local_cost"].values()) >= 0
    assert figures["lags_groups"] and all(g["rho"] is None or 0 < g["rho"] <= 1 for g in figures["lags_groups"])


# -- convergence -------------------------------------------------------------------------------------------
def test_convergence_table_json_and_curves(tmp_path):
    result = run([sys.executable, "-m", "benchmarks", "convergence", "--workers", "2", "--seeds", "0",
                  "--epochs", "2", "--compressors", "topk:density=0.05", "--out", str(tmp_path)])
    assert re.search(r"^\s+2 none\s+[\d.]+%\s+[\d.]+\s+\+0\.00", result.stdout, re.M)
    assert re.search(r"^\s+2 topk:density=0\.05\s+[\d.]+%", result.stdout, re.M)
    payload = json.loads((tmp_path / "convergence.json").read_text())
    summary = {s["compressor"]: s for s in payload["results"]["summary"]}
    assert set(summary) == {"none", "topk:density=0.05"}
    for s in summary.values():
        assert len(s["curve_mean"]) == 2 and all(0 <= a <= 1 for a in s["curve_mean"])
    assert summary["topk:density=0.05"]["vs_dense_points"] == pytest.approx(
        100 * (summary["topk:density=0.05"]["accuracy_mean"] - summary["none"]["accuracy_mean"]))
    assert payload["command"].startswith("python -m benchmarks.main_job.convergence") and payload["machine"]["cpus"]
    assert (tmp_path / "convergence.png").read_bytes()[:8] == PNG


# -- the emulated cluster (root) -----------------------------------------------------------------------------
def our_namespaces(pid: int) -> List[str]:
    return [n for n in netem.list_namespaces() if n.startswith(f"{netem.PREFIX}-{pid}-")]


def run_cluster(tmp_path: Path, methods: List[str], *extra: str) -> Tuple[subprocess.Popen, str, str]:
    """``benchmarks cluster`` on a 2-worker emulated cluster at 100 Mbit/s (resnet20, one timed
    batch): the finished process, its stdout and its stderr."""
    argv = [sys.executable, "-m", "benchmarks", "cluster", "--model", "resnet20", "--batch-size", "2",
            "--workers", "2", "--rates", "100mbit", "--densities", "0.01", "--methods", *methods,
            "--num-batches-per-iter", "1", "--num-iters", "1", "--out", str(tmp_path), *extra]
    process = subprocess.Popen(argv, env=launcher_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    stdout, stderr = process.communicate(timeout=HANG_TIMEOUT)
    return process, stdout, stderr


def cluster_rows(tmp_path: Path, labels: List[str], *extra: str) -> Dict[str, Dict[str, Any]]:
    """:func:`run_cluster` of Top-k with ``extra`` options, which must succeed, leave no
    namespace behind, print a row per label of ``labels`` (at 2x1, 100mbit), write exactly those
    rows without errors, in that order, and both plots: the rows by label."""
    process, stdout, stderr = run_cluster(tmp_path, ["topk"], *extra)
    assert process.returncode == 0, stdout + stderr
    assert our_namespaces(process.pid) == []
    assert f"[cluster] {len(labels)}/{len(labels)} done" in stderr
    for label in labels:
        assert re.search(rf"^  2x1\s+100mbit {re.escape(label)}\s", stdout, re.M)
    results = json.loads((tmp_path / "cluster.json").read_text())["results"]
    assert results["errors"] == []
    rows = {r["label"]: r for r in results["rows"]}
    assert list(rows) == labels
    for name in ("cluster_speedup.png", "cluster_efficiency.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    return rows


@needs_root
def test_cluster_benchmark_end_to_end(tmp_path):
    """A real emulated cluster at 100 Mbit/s; the last configuration names a method that does not
    exist, so the job fails there: the rows measured before are kept, the error is reported."""
    process, stdout, stderr = run_cluster(tmp_path, ["topk", "bogus"], "--num-warmup-batches", "1")
    assert process.returncode == 1, stdout + stderr
    assert "1 job(s) failed part-way" in stderr and "unknown sparsification method 'bogus'" in stderr
    assert our_namespaces(process.pid) == [] and not any(netem.NETNS_ETC.glob(f"{netem.PREFIX}-{process.pid}-*"))
    assert "[cluster] 3/4 done" in stderr
    for label in ("local (no exchange)", "none", "topk(density=0.01)"):
        assert re.search(rf"^  2x1\s+100mbit {re.escape(label)}\s", stdout, re.M)
    results = json.loads((tmp_path / "cluster.json").read_text())["results"]
    assert len(results["errors"]) == 1 and "bogus" in results["errors"][0]
    (link,) = results["links"]
    assert 0 < link["bits_per_second"] <= 1.1e8, "the 100 Mbit/s shaping is not in effect"
    local, dense, topk = results["rows"]
    assert local["efficiency"] == 1.0 and dense["speedup_vs_dense"] == 1.0
    assert topk["stats"]["bytes_sent"] < dense["stats"]["bytes_sent"] / 10
    for name in ("cluster_speedup.png", "cluster_efficiency.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    # The scaling model on this run: alpha and beta measured on a 100 Mbit/s link, then validated
    # and projected.
    result = run([sys.executable, "-m", "benchmarks", "scaling", "--cluster", str(tmp_path / "cluster.json"),
                  "--out", str(tmp_path)])
    fit = json.loads((tmp_path / "alpha_beta.json").read_text())["results"]["100mbit"]
    assert 8 / fit["model"]["beta"] <= 1.1e8 and fit["model"]["alpha"] > 0
    assert re.search(r"^validation: median \|error\| [\d.]+%, \d of 2 within 20%$", result.stdout, re.M)
    projection = json.loads((tmp_path / "scaling.json").read_text())["results"]["projection"]
    assert {p["rate"] for p in projection} == {"1gbit", "10gbit", "100gbit"}
    assert {p["compressor"] for p in projection} == {"none", "topk"}
    for p in projection:  # dense and Top-k steps only get dearer with more workers
        assert p["workers"][-1] == 1024 and all(a >= b for a, b in zip(p["efficiency"], p["efficiency"][1:]))
    assert (tmp_path / "scaling.png").read_bytes()[:8] == PNG


@needs_root
def test_failed_job_is_stopped_and_namespaces_removed():
    """Rank 1 fails while rank 0 waits for it in ``hvd.init()``: rank 0 is stopped (killed: exit
    -9, where Gloo's 120 s timeout would have ended it with an error of its own), the error
    carries each rank's exit code, and nothing is left behind."""
    script = ("import os, sys; sys.exit(5) if os.environ['HOROVOD_RANK'] == '1' else None; "
              "import horovod.torch as hvd; hvd.init()")
    with pytest.raises(RuntimeError, match=r"failed across the emulated cluster(.|\n)*worker 0 \(exit -9\)"
                                           r"(.|\n)*worker 1 \(exit 5\)"):
        with netem.EmulatedCluster(2, "100mbit") as cluster:
            names = [cluster.switch, *cluster.namespaces]
            assert set(names) <= set(netem.list_namespaces())
            netem.run_horovod(cluster, [sys.executable, "-c", script], timeout=200)
    assert not set(names) & set(netem.list_namespaces())
    assert not any((netem.NETNS_ETC / name).exists() for name in names)


@needs_root
def test_namespaces_of_a_killed_run_are_removed_by_the_next():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netem.PREFIX}-{dead.pid}-w0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with netem.EmulatedCluster(1, None) as cluster:
            assert stale not in netem.list_namespaces()
            assert cluster.namespaces[0] in netem.list_namespaces()
    finally:
        netem.delete_namespace(stale)
    assert not our_namespaces(os.getpid())


def test_readme_commands_name_existing_benchmarks_and_options():
    """Every ``python -m benchmarks.<group>.<name> ...`` (or ``python -m benchmarks <name> ...``)
    command in the README and the docs pages (``docs/*.md``) names a benchmark of this checkout,
    and every ``--option`` it passes is one that benchmark's parser declares (in its own module or
    in a benchmarks module it imports ``from``, where shared options such as the main job's
    ``--out`` are declared)."""
    from benchmarks.__main__ import modules

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

    def source(module: str) -> str:
        path = ROOT.joinpath(*module.split("."))
        return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()

    commands = [(page.relative_to(ROOT), f"benchmarks.{name}" if sep == "." else modules()[name], rest)
                for page in pages
                for sep, name, rest in re.findall(r"python -m benchmarks([. ])(\w+(?:\.\w+)*)([^`\n]*)",
                                                  page.read_text())]
    assert len(commands) >= 10
    for page, name, rest in commands:
        own = source(name)
        imported = re.findall(r"^from (benchmarks\.[\w.]+) import", own, re.M)
        text = "\n".join([own, *(source(module) for module in imported)])
        for option in re.findall(r"(--[\w-]+)", rest):
            assert f'"{option}"' in text, f"{page} passes {option} to {name}, which does not declare it"


def test_two_tier_steps_times_each_method_flat_and_two_tier(tmp_path):
    """The job of issues 46 and 56 in small (a 2 x 2 job, a small MLP, a few steps, the loop's own
    collectives between steps): per method a flat and a two-tier row, identical replicas, the ratio
    printed and written."""
    result = run([*SUITE_HOROVODRUN, "-np", "4", "-H", "localhost:2,127.0.0.1:2", "--gloo", sys.executable, "-m",
                  "benchmarks", "two_tier_steps", "--methods", "micro", "--steps", "3", "--rounds", "2",
                  "--hidden", "64", "48", "--between", "broadcast", "--results", str(tmp_path / "tiers.json")])
    text = "\n".join(rank0_lines(result.stdout))
    payload = json.loads((tmp_path / "tiers.json").read_text())["results"]
    parameters = 256 * 64 + 64 + 64 * 48 + 48 + 48 * 64 + 64
    assert (payload["workers"], payload["hosts"], payload["parameters"], payload["between"]) == (4, 2, parameters,
                                                                                                "broadcast")
    flat, tiers = payload["rows"]
    assert (flat["two_tier"], tiers["two_tier"]) == (False, True) and flat["identical"] and tiers["identical"]
    assert sum(tiers["rounds"].values()) >= 2 * 3 and tiers["rounds"]["histogram"] == 2 * 3
    assert tiers["over_flat"] == pytest.approx(tiers["seconds_per_step"] / flat["seconds_per_step"])
    assert re.search(rf"^micro +two-tier +{tiers['seconds_per_step']:.4f} +{tiers['over_flat']:.2f}  True", text, re.M)


def test_node_collectives_times_the_inside_tier_beside_the_allreduce(tmp_path):
    result = run([*SUITE_HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "benchmarks",
                  "node_collectives", "--sizes-mb", "0.1", "0.4", "--repeats", "2",
                  "--results", str(tmp_path / "node.json")])
    text = "\n".join(rank0_lines(result.stdout))
    rows = json.loads((tmp_path / "node.json").read_text())["results"]["rows"]
    assert [(r["megabytes"], r["collective"]) for r in rows] == [
        (size, c) for size in (0.1, 0.4) for c in ("reducescatter", "allgather", "allreduce")]
    for rs, ag, ar in (rows[:3], rows[3:]):
        # A rank of 2 moves half the buffer in a reduce-scatter or an allgather, all of it in an allreduce.
        assert rs["gbit_per_second"] * rs["seconds"] == pytest.approx(8 * rs["megabytes"] * 1e6 / 2 / 1e9)
        assert ar["gbit_per_second"] * ar["seconds"] == pytest.approx(8 * ar["megabytes"] * 1e6 / 1e9)
        assert ar["tier_over_allreduce"] == pytest.approx((rs["seconds"] + ag["seconds"]) / ar["seconds"])
        assert re.search(rf"^ +{ar['megabytes']:.2f} allreduce +{1e3 * ar['seconds']:.2f} .* "
                         rf"{ar['tier_over_allreduce']:.2f}$", text, re.M)


# -- outer steps against per-step exchange -------------------------------------------------------------------
def test_outer_steps_benchmark_end_to_end(tmp_path):
    """``benchmarks.outer.outer_steps`` on this machine's loopback (``--rates local``), both tasks at a
    tiny size, every schedule: every configuration's row, their bytes (plain DDP every parameter
    every step, dense DiLoCo every parameter once a round, the last round's exchange still in
    flight when overlapped, a method on the pseudo-gradients fewer), the comparisons against dense
    DDP and against dense DiLoCo of the same schedule, the JSON and the figures."""
    result = run([sys.executable, "-m", "benchmarks.outer.outer_steps", "--rates", "local", "--steps", "10",
                  "--eval-every", "5", "--every", "5", "--methods", "topk", "--outer-methods", "topk", "--out",
                  str(tmp_path), "--schedules", "sync", "overlap", "streamed", "--fragments", "2"])
    rows = json.loads((tmp_path / "outer_steps.json").read_text())["results"]
    labels = ["ddp none", "ddp topk"] + [f"outer {m} H=5{suffix}" for suffix in ("", " overlap", " streamed F=2")
                                         for m in ("none", "topk")]
    assert [(r["task"], r["label"]) for r in rows] == [(t, label) for t in ("lm", "digits") for label in labels]
    for r in rows:
        assert [p["step"] for p in r["curve"]] == [5, 10] and r["final"] == r["curve"][-1]["value"]
        assert f"| {r['task']} | local | {r['label']} | {r['final']:.4g} |" in result.stdout
        dense = 4 * r["parameters"]
        by_label = {x["label"]: x for x in rows if x["task"] == r["task"]}
        if r["label"] == "ddp none":
            assert r["bytes"] == 10 * dense and r["time_fraction"] == 1.0
        elif r["label"] == "outer none H=5":
            assert r["bytes"] == 2 * dense
        elif r["label"] == "outer none H=5 overlap":
            assert r["bytes"] == dense
        elif r["label"] == "outer none H=5 streamed F=2":  # fragments 0, 1, 0 landed; 1 in flight
            assert dense < r["bytes"] < 2 * dense
        elif r["kind"] == "outer":
            diloco = by_label[r["label"].replace("topk", "none")]
            assert 0 < r["bytes"] < diloco["bytes"] / 10
            assert r["bytes_ratio"] == diloco["bytes"] / r["bytes"]
            assert r["dense_diloco_final"] == diloco["final"]
    assert rows[0]["metric"] == "validation loss" and rows[-1]["metric"] == "test accuracy (%)"
    for name in ("lm_seconds", "lm_bytes", "digits_seconds", "digits_bytes"):
        assert (tmp_path / f"outer_steps_{name}.png").read_bytes()[:8] == PNG


def test_outer_steps_comparisons_and_refusals():
    """Seconds to dense DDP's final metric are read at the first evaluation that reaches it (a loss
    at or below, an accuracy at or above), an outer row with a method is set beside dense DiLoCo at
    its H; evaluations that fall inside a round are refused."""
    from benchmarks.outer.outer_steps import add_comparisons, main

    def row(label, kind, method, every, curve, metric="validation loss"):
        points = [{"step": 10 * (i + 1), "seconds": s, "bytes": b, "value": v} for i, (s, b, v) in enumerate(curve)]
        return {"label": label, "kind": kind, "method": method, "every": every, "task": "lm", "rate": "x",
                "metric": metric, "curve": points, "seconds": points[-1]["seconds"], "bytes": points[-1]["bytes"],
                "final": points[-1]["value"]}

    rows = add_comparisons([row("ddp none", "ddp", "none", None, [(2.0, 100, 3.0), (4.0, 200, 2.0)]),
                            row("outer none H=10", "outer", "none", 10, [(1.0, 50, 2.5), (2.0, 100, 2.0)]),
                            row("outer topk H=10", "outer", "topk", 10, [(1.0, 5, 2.9), (2.0, 60, 2.4)])])
    assert [r["to_dense_ddp"] for r in rows] == [4.0, 2.0, None]
    assert [r["time_fraction"] for r in rows] == [1.0, 0.5, None]
    assert (rows[2]["dense_diloco_final"], rows[2]["bytes_ratio"]) == (2.0, 100 / 60)
    assert "dense_diloco_final" not in rows[1]
    with pytest.raises(SystemExit):
        main(["--rates", "local", "--every", "10", "--eval-every", "15"])


def test_outer_steps_torchft_rows_fragments_and_method_options():
    """torchft's rows: synchronous and streamed at every H (torchft overlaps per fragment only, so no
    ``overlap`` row), over the fragments of ``OuterSteps``' cut, each a module sharing (not copying)
    the model's parameters; a fragment count that does not divide every H is refused (torchft's
    rule) naming the fix; a method's options are read from its spec."""
    import torch

    import horovod_sparse.outer as hso
    from benchmarks.outer.outer_steps import main
    from benchmarks.outer.outer_training import configurations, create, fragment_modules
    from horovod_sparse.outer.fragments import cut

    labels = [c["label"] for c in configurations([], [], [10, 50], torchft=True,
                                                 schedules=("sync", "overlap", "streamed"), fragments=5)]
    assert labels == ["torchft diloco H=10", "torchft diloco H=10 streamed F=5", "torchft diloco H=50",
                      "torchft diloco H=50 streamed F=5"]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    parts = fragment_modules(model, 2)
    assert [[id(p) for p in part.parameters()] for part in parts] == [
        [id(params[i]) for i in run] for run in cut([p.numel() for p in params], 2)]
    assert fragment_modules(model, 1) == [model]
    with pytest.raises(SystemExit):
        main(["--rates", "local", "--every", "10", "--eval-every", "10", "--torchft", "--schedules", "streamed",
              "--fragments", "4"])
    method = create(hso.Compression, "sparseloco:blocks=true,chunk_size=16", 0.1)
    assert (method.options.blocks, method.options.chunk_size, method.options.density) == (True, 16, 0.1)


def test_outer_offload_cost_measures_both_settings_side_by_side(tmp_path):
    """``benchmarks.outer.offload_cost`` on the CPU, a tiny MLP: a row per setting (on the
    device, offloaded), each with its boundaries' median time and the outer state's bytes read
    from its tensors: the anchor and DiLoCo's momentum, 8 bytes per parameter, in host memory
    here either way; the ratio printed."""
    result = run([sys.executable, "-m", "benchmarks.outer.offload_cost", "--width", "32", "--layers", "2",
                  "--rounds", "2", "--warmup", "1", "--results", str(tmp_path / "offload.json")])
    rows = json.loads((tmp_path / "offload.json").read_text())["results"]
    assert [r["offload"] for r in rows] == [False, True]
    for r in rows:
        assert r["parameters"] == 2 * (32 * 32 + 32) and r["boundary_ms"] > 0
        assert r["state_host_mb"] == 8 * r["parameters"] / 1e6 and r["state_device_mb"] is None
    ratio = rows[1]["boundary_ms"] / rows[0]["boundary_ms"]
    assert f"boundary time: {ratio:.2f}x" in result.stdout
