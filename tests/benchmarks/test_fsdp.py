"""The FSDP2 side of the throughput benchmarks: :mod:`benchmarks.emulated.synthetic_fsdp` smoke-run under
``torchrun`` on 4 local processes as a 2 x 2 mesh (FSDP's HSDP, a horovod_sparse method on the
replica axis), ``benchmarks.emulated.cluster --fsdp`` on a real emulated cluster (root) and
:mod:`benchmarks.costs.fsdp_overlap` (its simulation of an asynchronous hook against hand-worked
timelines, its job's rows). Only the printed format, the JSON rows and their plumbing are
checked, never a measured time."""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Tuple

import pytest

from benchmarks.costs import fsdp_overlap
from benchmarks.emulated import synthetic_fsdp
from benchmarks.emulated.cluster import add_ratios, fsdp_sweep
from benchmarks.emulated.netem import inner_argv
from benchmarks.shared import models
from tests.support.launch import TORCHRUN
from tests.benchmarks.test_clis import cluster_rows, needs_root, run, run_torch_synthetic

SWEEP = [{"compressor": "none"}, {"compressor": "micro", "density": 0.01}]
LABELS = ["fsdp none", "fsdp micro(density=0.01)"]


def test_fsdp_specs_sweep_and_ratios():
    config = synthetic_fsdp.parser().parse_args(["--compressor", "topk", "--density", "0.01", "--shard-size", "2"])
    assert synthetic_fsdp.describe(config) == "fsdp topk(density=0.01)" and config.shard_size == 2
    assert fsdp_sweep(["topk"], [0.001]) == [{"compressor": "none"}, {"compressor": "topk", "density": 0.001}]
    rows = add_ratios([{"optimizer": "local", "compressor": "none", "total_img_sec": 40.0},
                       {"optimizer": "hs", "compressor": "none", "total_img_sec": 10.0},
                       {"frontend": "fsdp", "optimizer": "fsdp", "compressor": "none", "total_img_sec": 20.0},
                       {"frontend": "fsdp", "optimizer": "fsdp", "compressor": "micro", "total_img_sec": 30.0}])
    assert [r["speedup_vs_dense"] for r in rows] == [4.0, 1.0, 1.0, 1.5]
    assert [r["speedup_vs_horovod_dense"] for r in rows] == [4.0, 1.0, 2.0, 3.0]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Tuple[str, List[Dict[str, Any]], str]:
    return run_torch_synthetic(tmp_path_factory.mktemp("synthetic_fsdp"), "benchmarks.emulated.synthetic_fsdp", 4,
                               SWEEP, "--num-warmup-batches", "1", "--shard-size", "2")


def test_synthetic_fsdp_prints_the_synthetic_format_and_rows(fsdp_run):
    stdout, rows, command = fsdp_run
    assert re.findall(r"^Compressor: (.+)$", stdout, re.M) == LABELS  # rank 0 only prints
    assert len(re.findall(r"^Total img/sec on 4 CPU\(s\): [\d.]+ \+-[\d.]+$", stdout, re.M)) == 2
    assert re.search(r"^Union density: [\d.]+ \(target [\d.]+, density ratio [\d.]+\)$", stdout, re.M)
    assert command.startswith("python -m benchmarks.emulated.synthetic_fsdp --model resnet20")
    assert [r["label"] for r in rows] == LABELS
    parameters = models.count_parameters(models.resnet20())
    for row in rows:
        assert (row["frontend"], row["optimizer"], row["workers"], row["parameters"], row["shard_size"]) == (
            "fsdp", "fsdp", 4, parameters, 2)
        assert row["img_sec_per_worker"] > 0 and row["total_img_sec"] == pytest.approx(4 * row["img_sec_per_worker"])
    dense, micro = rows
    assert dense["stats"] == {}  # FSDP's HSDP keeps no statistics
    # Each replica exchanges its shard: about half the model per rank, at the target density.
    stats = micro["stats"]
    assert 0.5 * stats["target_density"] <= stats["union_density"] <= 1.5 * stats["target_density"]
    assert stats["bytes_sent"] < stats["dense_bytes"] / 10


@needs_root
def test_cluster_benchmark_runs_the_fsdp_sweep_on_the_same_cluster(tmp_path):
    labels = ["local (no exchange)", "none", "topk(density=0.01)", "fsdp none", "fsdp topk(density=0.01)"]
    rows = cluster_rows(tmp_path, labels, "--fsdp", "--num-warmup-batches", "1")
    assert [r.get("frontend") for r in rows.values()] == ["horovod"] * 3 + ["fsdp"] * 2
    assert rows["fsdp none"]["speedup_vs_dense"] == 1.0
    assert rows["fsdp topk(density=0.01)"]["stats"]["bytes_sent"] < rows["none"]["stats"]["bytes_sent"] / 10


def test_overlap_simulation_runs_the_exchanges_beside_the_compute():
    """Worked by hand: the exchanges queue one after the other on the link, each from the
    moment its hook fired in compute time; the pass ends when compute and link both have."""
    assert fsdp_overlap.overlapped((0.0, 4.0, [])) == 4.0
    # compute 1 | exchange 2 | compute 1: the exchange runs beside the last second of compute.
    assert fsdp_overlap.overlapped((0.0, 4.0, [(1.0, 3.0)])) == 3.0
    # compute 1 | ex 1 | compute 1 | ex 2 | compute 1: link 1-2, then 2-4; compute ends at 3.
    assert fsdp_overlap.overlapped((0.0, 6.0, [(1.0, 2.0), (3.0, 5.0)])) == 4.0
    # A short exchange fully hidden: compute 2 | ex 0.5 | compute 2.
    assert fsdp_overlap.overlapped((10.0, 14.5, [(12.0, 12.5)])) == 4.0
    row = fsdp_overlap.summary("topk", [(0.0, 6.0, [(1.0, 2.0), (3.0, 5.0)])], [8.0])
    assert (row["backward"], row["exchanges"], row["overlapped_backward"], row["lost_overlap"]) == (6.0, 3.0, 4.0, 2.0)
    assert row["lost_share_of_step"] == 0.25 and row["units"] == 2


def test_overlap_job_rows(tmp_path):
    result = run([TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m", "benchmarks.costs.fsdp_overlap",
                  "--model", "resnet20", "--size", "8", "--batch-size", "2", "--shard-size", "2", "--warmup", "1",
                  "--steps", "2", "--compressors", "topk:density=0.01", "gtopk:density=0.01",
                  "--results", str(tmp_path / "overlap.json")])
    rows = json.loads((tmp_path / "overlap.json").read_text())["results"]["rows"]
    assert [r["compressor"] for r in rows] == ["topk(density=0.01)", "gtopk(density=0.01)"]
    # One exchange per unit with parameters of its own: the children (the root holds none).
    units = sum(1 for child in models.resnet20().children() if any(True for _ in child.parameters()))
    for row in rows:
        assert row["units"] == units
        assert 0 < row["exchanges"] < row["backward"] < row["step"]
        assert row["backward"] - row["exchanges"] <= row["overlapped_backward"] <= row["backward"]
        assert re.search(rf"^{re.escape(row['compressor'])} +{units} ", result.stdout, re.M)


def test_emulated_workers_run_the_job_without_the_drivers_options():
    argv = ["--emulate", "1gbit", "--model", "vgg", "--workers=4", "--shard-size", "2", "--compressors", "topk"]
    assert inner_argv(argv) == ["--model", "vgg", "--shard-size", "2", "--compressors", "topk"]
    assert inner_argv(["--workers", "4", "--emulate=1gbit", "--steps", "3"]) == ["--steps", "3"]
