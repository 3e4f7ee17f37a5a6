"""The CPU parts of the GPU check (``benchmarks/gpu_check.py``), as CI runs them: every method
through the DDP hook, AMP with a loss scaler and the gradient layout under fused AdamW pass on the
CPU, and the check writes every part of its report (host synchronisations are counted on CUDA
only; selection and training-step times and the profile are figures, not asserted)."""
import json
import subprocess
import sys

from horovod_sparse.ddp import Compression
from tests.launch import HANG_TIMEOUT, worker_env

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
    assert set(results["selection"]["seconds"]) == {"sum", "torch.topk", "top_k"}
    assert set(results["steps"]["seconds"]) == {"dense", *METHODS, "dense+view", "topk+view"}
    assert results["steps"]["model"] == "resnet20"
    assert results["profile"]["method"] == "topk" and len(results["profile"]["added"]) == 20
