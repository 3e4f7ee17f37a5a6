"""``benchmarks.main_job.convergence --ddp`` on a short real run (2 workers, 1 seed, 2 epochs, a small MLP):
the torchrun job's DDP rows (dense DDP, PowerSGD, a method through horovod_sparse's hook) sit
beside the Horovod job's in the table and the JSON, compared to both dense baselines, with the
bytes each rank sends per step. Accuracy does not depend on timing: the run is deterministic."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import HANG_TIMEOUT, worker_env

ROOT = Path(__file__).resolve().parent.parent.parent
HIDDEN = 32
#: The digits MLP's parameters at HIDDEN = 32: 64x32 + 32, 32x32 + 32, 32x10 + 10.
PARAMETERS = 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
#: Steps a rank trains: 2 epochs of 21 batches of 32 (rank 0 holds 674 of the 1347 training images).
STEPS = 2 * 21
#: What PowerSGD at rank 4 allreduces once compressing: P and Q of the matrices that compress by
#: more than 2x ((n + m) 4 elements for n x m: 32x64, 32x32), the rest whole (the 10x32 matrix,
#: (10 + 32) 4 * 2 > 320, and the biases).
POWERSGD_NUMEL = (32 + 64) * 4 + (32 + 32) * 4 + 10 * 32 + 32 + 32 + 10
LABELS = ["none", "topk:density=0.05", "ddp none", "ddp powersgd:rank=4,start=2", "ddp topk:density=0.05"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run's printed output and its JSON results."""
    out = tmp_path_factory.mktemp("convergence-ddp")
    argv = [sys.executable, "-m", "benchmarks.main_job.convergence", "--workers", "2", "--seeds", "0", "--epochs", "2",
            "--hidden", str(HIDDEN), "--compressors", "topk:density=0.05", "--ddp", "--powersgd-rank", "4",
            "--powersgd-start", "2", "--out", str(out)]
    result = subprocess.run(argv, env=worker_env(), cwd=ROOT, capture_output=True, text=True, timeout=HANG_TIMEOUT)
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    assert (out / "convergence.png").is_file()
    return result.stdout, json.loads((out / "convergence.json").read_text())["results"]


def test_table_and_json_have_the_ddp_rows(run):
    stdout, results = run
    for label in LABELS:
        assert re.search(rf"^\s+2 {re.escape(label)}\s+[\d.]+%", stdout, re.M), label
    assert re.search(r"^\s+2 ddp none\s+[\d.]+%\s+[\d.]+\s+[+-][\d.]+\s+\+0\.00\s", stdout, re.M)
    summary = {s["compressor"]: s for s in results["summary"]}
    assert list(summary) == LABELS
    assert sorted(r["compressor"] for r in results["runs"]) == sorted(LABELS)
    for s in summary.values():
        assert len(s["curve_mean"]) == 2 and all(0 <= a <= 1 for a in s["curve_mean"])
        assert s["vs_dense_points"] == pytest.approx(100 * (s["accuracy_mean"] - summary["none"]["accuracy_mean"]))
        if s["compressor"].startswith("ddp "):
            assert s["vs_dense_ddp_points"] == pytest.approx(
                100 * (s["accuracy_mean"] - summary["ddp none"]["accuracy_mean"]))
        else:
            assert s["vs_dense_ddp_points"] is None


def test_dense_ddp_trains_as_dense_horovod(run):
    """Same data, batches, initial weights and learning rate, the gradients averaged by another
    summation order: the final accuracies agree within 2 points (9 of the 450 test images)."""
    summary = {s["compressor"]: s for s in run[1]["summary"]}
    assert abs(summary["ddp none"]["accuracy_mean"] - summary["none"]["accuracy_mean"]) <= 0.02


def test_bytes_and_union_density(run):
    """Dense DDP sends every gradient, as dense Horovod counts it; PowerSGD its P and Q matrices
    and the uncompressed tensors after 2 dense steps, and has no union density; the hook reports
    its own."""
    summary = {s["compressor"]: s for s in run[1]["summary"]}
    for dense in ("none", "ddp none"):
        assert summary[dense]["bytes_sent_per_step"] == 4 * PARAMETERS and summary[dense]["union_density"] == 1.0
    powersgd = summary["ddp powersgd:rank=4,start=2"]
    assert powersgd["bytes_sent_per_step"] == pytest.approx(4 * (2 * PARAMETERS + (STEPS - 2) * POWERSGD_NUMEL) / STEPS)
    assert powersgd["union_density"] is None
    topk = summary["ddp topk:density=0.05"]
    assert 0 < topk["bytes_sent_per_step"] < 4 * PARAMETERS and 0 < topk["union_density"] < 1
