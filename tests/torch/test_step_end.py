"""When the Horovod optimizer launches the agreement on non-finite gradients: with its count on
the host (CPU tensors) as soon as every group of the step is launched, before it waits for the
exchange, so that Horovod negotiates it with the exchange instead of in a cycle of its own after
it; at the step's end where a decision is still on a device (read once, with the step's
figures); never without a ``nonfinite`` policy. One Horovod process (``hvd.init()`` without a
launcher) in a subprocess, its collectives and waits logged in order. That the early report
agrees as the late one did across ranks is ``tests/common/test_nonfinite.py``'s."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support.launch import HANG_TIMEOUT, worker_env

SCRIPT = r"""
import json, warnings
import horovod.torch as hvd, torch
import horovod_sparse.torch as hs
import horovod_sparse.torch.collectives as collectives
import horovod_sparse.torch.exchanging as exchanging
from horovod_sparse.torch_core.selection import accelerator_paths

hvd.init()
log = []
launch_report, wait = collectives.launch_report, collectives.wait
collectives.launch_report = exchanging.launch_report = lambda *a: (log.append("report"), launch_report(*a))[1]
collectives.wait = lambda *a, **k: (log.append("wait"), wait(*a, **k))[1]

def steps(nonfinite, forced=False, nan_at=None):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 200)]
    opt = hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                  named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                  compression=hs.Compression.topk(density=0.1, min_numel=0), nonfinite=nonfinite)
    logs, abandoned = [], []
    for step in range(3):
        log.clear()
        opt.zero_grad()
        scale = float("nan") if step == nan_at else 1.0
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            if forced:
                with accelerator_paths():
                    sum((p * p).sum() * scale for p in params).backward(); opt.step()
            else:
                sum((p * p).sum() * scale for p in params).backward(); opt.step()
        logs.append(list(log)); abandoned.append(opt.last_stats.abandoned)
    return {"logs": logs, "abandoned": abandoned}

print(json.dumps({"host": steps("skip"), "device": steps("skip", forced=True), "none": steps(None),
                  "nan": steps("skip", nan_at=1)}))
"""


def run_script():
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=worker_env(), capture_output=True, text=True,
                            timeout=HANG_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_agreement_is_launched_before_the_exchange_is_waited_for_when_its_count_is_on_the_host():
    """Per step after the first (whose configuration agreement comes first), one sparse group
    (an allgather of values and one of indices): on CPU tensors the report is launched before the
    exchange's two waits; with the decisions on a device (the accelerators' paths) after them;
    without a policy there is none; a NaN reported early abandons its step, and only it."""
    runs = run_script()
    for log in runs["host"]["logs"][1:]:
        assert log == ["report", "wait", "wait", "wait"], log
    for log in runs["device"]["logs"][1:]:
        assert log == ["wait", "wait", "report", "wait"], log
    assert runs["none"]["logs"][1:] == [["wait", "wait"]] * 2, runs["none"]
    assert runs["host"]["abandoned"] == [False] * 3 and runs["nan"]["abandoned"] == [False, True, False], runs
