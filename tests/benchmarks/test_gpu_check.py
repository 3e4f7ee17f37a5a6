"""The CPU parts of the GPU check (``benchmarks/gpu_check.py``), as CI runs them: every method
through the DDP hook, AMP with a loss scaler and the gradient layout under fused AdamW pass on the
CPU, and the check writes every part of its report (host synchronisations are counted on CUDA
only; selection and training-step times and the profile are figures, not asserted; the
break-even links are checked against the report's own step times and bytes)."""
import functools
import json
import math
import re
import subprocess
import sys

import pytest

from benchmarks.emulated.wire import Payload, wire_law
from horovod_sparse.common.cost_model import AlphaBeta, break_even_link
from horovod_sparse.ddp import Compression
from tests.support.launch import HANG_TIMEOUT, worker_env

METHODS = [name for name in Compression.names() if name not in ("none", "fp16")]


def test_gpu_check_cpu_parts(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick",
                             "--results", str(out)], env=worker_env(), capture_output=True, text=True,
                            timeout=HANG_TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gpu_check: passed" in result.stdout
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["command"].startswith("python -m benchmarks.gpu_check")
    assert sorted(results["methods"]) == sorted(METHODS) == sorted(results["amp"]) == sorted(results["fsdp"])
    assert all(row["same_selection"] and row["max_rel_diff"] == 0.0 for row in results["fsdp"].values())
    for method in METHODS:
        assert results["methods"][method]["same_selection"] and results["methods"][method]["max_rel_diff"] == 0.0
        amp = results["amp"][method]
        assert amp["same_as_stock"] and amp["finite"] and amp["overflows"] >= 2, (method, amp)
    assert results["layout"] == {"strides_kept": True, "equal_to_contiguous": True, "ok": True}
    assert results["syncs"] is None
    (selection,) = results["selection"]
    assert (selection["numel"], selection["density"], selection["k"]) == (1_000_000, 0.001, 1000)
    assert set(selection["seconds"]) == {"sum", "torch.topk", "top_k", "threshold", "gaussiank", "dgc", "micro"}
    (steps,) = results["steps"]
    assert set(steps["seconds"]) == {"dense", "powersgd", *METHODS, "dense+view", "topk+view"}
    assert steps["model"] == "resnet20"
    fsdp = results["fsdp_steps"]
    assert fsdp["model"] == "resnet20" and set(fsdp["seconds"]) == {"dense", *METHODS}
    assert results["profile"]["method"] == "topk" and len(results["profile"]["added"]) == 20
    check_exchange_cost(results["exchange_cost"], result.stdout)
    check_break_even(steps, result.stdout)


def check_exchange_cost(rows, stdout):
    """The exchange cost's rows on the CPU: DDP's dense, PowerSGD (its operations not counted:
    its callbacks run on Gloo's threads) and every method, FSDP2's dense and every method, each
    method dispatching more than its dense row, no device times, every row printed."""
    assert [(r["front_end"], r["exchange"]) for r in rows] == (
        [("ddp", e) for e in ["dense", "powersgd", *METHODS]] + [("fsdp", e) for e in ["dense", *METHODS]])
    for r in rows:
        assert r["model"] == "resnet20" and r["device_ms"] is None and r["ms"] > 0
        if r["exchange"] in METHODS:
            assert r["excess_ops"] > 0 and r["buckets"] >= 1, r
        assert re.search(rf"^resnet20 +{r['front_end']} +{r['exchange']} ", stdout, re.M), r
    assert next(r for r in rows if r["exchange"] == "powersgd")["ops"] is None


#: Methods whose collectives are one allgather of what each rank sent (benchmarks.emulated.wire).
ALLGATHER = ("topk", "lags", "dgc", "gaussiank", "threshold")


def check_break_even(steps, stdout):
    """Every method's break-even link at 8 and 64 ranks is in the report and printed, and follows
    from the report's own figures: None exactly where the method's wire bytes are not fewer than
    a bf16 ring all-reduce's, positive elsewhere; for the allgather methods the closed form
    ``8 (2 (n-1)/n 2 P - (n-1) b) / added`` written out here; for every method what
    ``break_even_link`` makes of the report's numbers."""
    parameters, seconds = steps["parameters"], steps["seconds"]
    assert parameters > 0 and sorted(steps["break_even"]) == sorted(METHODS)
    for method, row in steps["break_even"].items():
        assert row["added_seconds"] == max(0.0, seconds[method] - seconds["dense"]), method
        assert row["bytes_from"] == ("selected" if method == "gtopk" else "statistics"), method  # one rank: no round
        payload = Payload(**row["payload"])
        law = functools.partial(wire_law(method), p=payload)
        sent = payload.values + payload.indices + payload.meta
        assert sent > 0, method
        assert set(row["bits_per_second"]) == {"8", "64"}, method
        assert f"break-even {steps['model']} {method} " in " ".join(stdout.split()), method
        for workers, link in row["bits_per_second"].items():
            n = int(workers)
            per_byte = AlphaBeta(0.0, 1.0, n)
            saves = law(per_byte) < 2 * (n - 1) / n * 2 * parameters
            assert (link is None) == (not saves), (method, n, link)
            if saves:
                assert link > 0, (method, n)
            assert link == break_even_link(parameters, row["added_seconds"], law, n), (method, n)
            if method in ALLGATHER and saves:
                dense, wire = 2 * (n - 1) / n * 2 * parameters, (n - 1) * sent
                expected = math.inf if row["added_seconds"] == 0 else 8 * (dense - wire) / row["added_seconds"]
                assert link == pytest.approx(expected, rel=1e-12), (method, n)
