"""The DDP side of the throughput benchmarks: :mod:`benchmarks.emulated.synthetic_ddp` smoke-run under
``torchrun`` on 2 local processes (dense DDP, PyTorch's PowerSGD, a horovod_sparse method), and
``benchmarks.emulated.cluster --ddp`` on a real emulated cluster (root). Only the printed format, the JSON
rows and their plumbing are checked, never a measured time; and the PowerSGD baseline every
benchmark runs on Gloo (``benchmarks.shared.ddp_baselines``) against PyTorch's own hook."""
from __future__ import annotations

import re
import subprocess
import sys
from typing import Any, Dict, List, Tuple

import pytest

from benchmarks.emulated import synthetic_ddp
from benchmarks.emulated.cluster import add_ratios, ddp_sweep
from benchmarks.shared import models
from tests.benchmarks.test_clis import cluster_rows, needs_root, run_torch_synthetic
from tests.support.launch import WORKERS, worker_env

SWEEP = [{"compressor": "none"}, {"compressor": "powersgd"}, {"compressor": "micro", "density": 0.01}]
LABELS = ["ddp none", "ddp powersgd(rank=4)", "ddp micro(density=0.01)"]
BLOCK = re.compile(
    r"Model: resnet20\nBatch size: 4\nNumber of CPUs: 2\nCompressor: (?P<label>.+)\nRunning warmup\.\.\.\n"
    r"Running benchmark\.\.\.\nIter #0: (?P<i0>[\d.]+) img/sec per CPU\nIter #1: (?P<i1>[\d.]+) img/sec per CPU\n"
    r"Img/sec per CPU: (?P<mean>[\d.]+) \+-(?P<conf>[\d.]+)\n"
    r"Total img/sec on 2 CPU\(s\): (?P<total>[\d.]+) \+-(?P<tconf>[\d.]+)\n")


# -- small pure pieces ----------------------------------------------------------------------------
def test_compressor_specs_and_labels():
    assert synthetic_ddp.ddp_compressor("powersgd", 0.01) == ("powersgd", {"rank": synthetic_ddp.POWERSGD_RANK})
    assert synthetic_ddp.ddp_compressor("powersgd:rank=2", None) == ("powersgd", {"rank": 2})
    assert synthetic_ddp.ddp_compressor("micro", 0.001) == ("micro", {"density": 0.001})
    assert synthetic_ddp.ddp_compressor("none", 0.001) == ("none", {})
    with pytest.raises(ValueError, match="only rank"):
        synthetic_ddp.ddp_compressor("powersgd:density=0.1", None)
    config = synthetic_ddp.parser().parse_args(["--compressor", "topk", "--density", "0.01"])
    assert synthetic_ddp.describe(config) == "ddp topk(density=0.01)"
    with pytest.raises(ValueError, match="--num-warmup-batches must be at least 2"):
        synthetic_ddp.register_hook(None, "powersgd", {"rank": 4}, warmup_batches=1)


def test_ddp_rows_are_measured_against_dense_ddp_and_dense_horovod():
    assert ddp_sweep(["topk", "micro"], [0.001]) == [{"compressor": "none"}, {"compressor": "powersgd"},
                                                     {"compressor": "topk", "density": 0.001},
                                                     {"compressor": "micro", "density": 0.001}]
    rows = add_ratios([{"optimizer": "local", "compressor": "none", "total_img_sec": 40.0},
                       {"optimizer": "hs", "compressor": "none", "total_img_sec": 10.0},
                       {"optimizer": "hs", "compressor": "topk", "total_img_sec": 30.0},
                       {"frontend": "ddp", "optimizer": "ddp", "compressor": "none", "total_img_sec": 20.0},
                       {"frontend": "ddp", "optimizer": "ddp", "compressor": "micro", "total_img_sec": 30.0}])
    assert [r["speedup_vs_dense"] for r in rows] == [4.0, 1.0, 3.0, 1.0, 1.5]
    assert [r["speedup_vs_horovod_dense"] for r in rows] == [4.0, 1.0, 3.0, 2.0, 3.0]
    assert [r["efficiency"] for r in rows] == [1.0, 0.25, 0.75, 0.5, 0.75]


# -- synthetic_ddp under torchrun ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Tuple[str, List[Dict[str, Any]], str]:
    return run_torch_synthetic(tmp_path_factory.mktemp("synthetic_ddp"), "benchmarks.emulated.synthetic_ddp", 2, SWEEP,
                               "--num-warmup-batches", "2")


def test_synthetic_ddp_prints_the_synthetic_format(ddp_run):
    stdout, _, _ = ddp_run
    blocks = list(BLOCK.finditer(stdout))
    assert [b["label"] for b in blocks] == LABELS  # rank 0 only prints
    for b in blocks:
        mean = float(b["mean"])
        assert mean > 0 and abs(mean - (float(b["i0"]) + float(b["i1"])) / 2) <= 0.1
        assert abs(float(b["total"]) - 2 * mean) <= 0.15
    assert re.search(r"^Union density: [\d.]+ \(target [\d.]+, density ratio [\d.]+\)$", stdout, re.M)
    assert re.search(r"^PowerSGD: [\d.]+ MB sent per step per worker \(dense gradient 1\.1 MB\), "
                     r"compression \d+x$", stdout, re.M)


def test_synthetic_ddp_rows(ddp_run):
    _, rows, command = ddp_run
    assert command.startswith("python -m benchmarks.emulated.synthetic_ddp --model resnet20")
    assert [r["label"] for r in rows] == LABELS
    assert [r["compressor"] for r in rows] == ["none", "powersgd", "micro"]
    parameters = models.count_parameters(models.resnet20())
    for row in rows:
        assert (row["frontend"], row["optimizer"], row["workers"], row["parameters"]) == ("ddp", "ddp", 2, parameters)
        assert row["img_sec_per_worker"] > 0 and row["total_img_sec"] == pytest.approx(2 * row["img_sec_per_worker"])
        assert len(row["iters"]) == 2 and row["step_seconds"] == pytest.approx(4 / row["img_sec_per_worker"])
    dense, powersgd, micro = rows
    assert dense["stats"] == {}  # DDP's own allreduce keeps no statistics
    assert 0 < powersgd["stats"]["bytes_sent"] < powersgd["stats"]["dense_bytes"] == 4 * parameters
    assert powersgd["stats"]["compression_rate"] > 1
    # MiCRO's union is the union of disjoint partitions' selections: about its target density.
    stats = micro["stats"]
    assert stats["target_density"] == pytest.approx(0.01, rel=0.05)
    assert 0.5 * stats["target_density"] <= stats["union_density"] <= 1.5 * stats["target_density"]
    assert stats["bytes_sent"] < stats["dense_bytes"] / 10
    assert {"select", "communicate"} <= set(stats["seconds"])


# -- the emulated cluster (root) -----------------------------------------------------------------------
@needs_root
def test_cluster_benchmark_runs_the_ddp_sweep_on_the_same_cluster(tmp_path):
    labels = ["local (no exchange)", "none", "topk(density=0.01)", "ddp none", "ddp powersgd(rank=4)",
              "ddp topk(density=0.01)"]
    rows = cluster_rows(tmp_path, labels, "--ddp", "--num-warmup-batches", "2")
    assert [r.get("frontend") for r in rows.values()] == ["horovod"] * 3 + ["ddp"] * 3
    assert rows["ddp none"]["speedup_vs_dense"] == 1.0 and rows["none"]["speedup_vs_horovod_dense"] == 1.0
    assert rows["ddp none"]["speedup_vs_horovod_dense"] == pytest.approx(
        rows["ddp none"]["total_img_sec"] / rows["none"]["total_img_sec"])
    assert rows["ddp topk(density=0.01)"]["efficiency"] == pytest.approx(
        rows["ddp topk(density=0.01)"]["total_img_sec"] / rows["local (no exchange)"]["total_img_sec"])
    assert rows["ddp topk(density=0.01)"]["stats"]["bytes_sent"] < rows["none"]["stats"]["bytes_sent"] / 10


def test_powersgd_baseline_on_gloo_finishes_with_pytorchs_gradients():
    """The benchmarks' PowerSGD on the CPU (tests/workers/powersgd_baseline.py): several buckets,
    30 steps on one Gloo rank, bitwise PyTorch's hook waited for bucket by bucket. PyTorch's hook
    called as it comes hangs there (its callbacks wait on every Gloo thread): a timeout."""
    result = subprocess.run([sys.executable, str(WORKERS / "powersgd_baseline.py")], env=worker_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["same"], result.stdout + result.stderr[-3000:]
