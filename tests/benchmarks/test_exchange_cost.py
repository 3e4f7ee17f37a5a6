"""Issue 57's exchange cost on ResNet-50's parameter list (``benchmarks.costs.exchange_cost``, one
rank, the methods' accelerator paths): what each front end with its defaults dispatches in a
step beyond its dense step, held to the issue's budgets a bucket where a method meets them and to
its record where it does not yet, in one launch of the benchmark's command line."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any, Dict, List

import pytest

from benchmarks.shared import models
from horovod_sparse.ddp import Compression
from tests.benchmarks.test_clis import ROOT, run
from tests.support.launch import launcher_env

METHODS = [name for name in Compression.names() if name not in ("none", "fp16")]
FRONT_ENDS = ("ddp", "fsdp", "horovod")

#: Issue 57's budgets: the most operations a bucket a method's exchange may dispatch beyond the
#: dense exchange's (gTop-k's a round; one rank runs none, so its bucket's).
BUDGETS = {"topk": 20, "lags": 20, "threshold": 20, "gtopk": 30, "dgc": 40, "gaussiank": 40, "sparseloco": 40,
           "micro": 40, "exdyna": 40}
#: What a step may add once, beyond its buckets' budgets: the step's end (its figures read in one go,
#: the non-finite decisions learnt), "a few dozen" in the issue.
STEP_END = 24
#: The methods within their budgets in every front end: held to them.
WITHIN_BUDGET = ("topk", "lags", "threshold", "gtopk")

#: A step's operations beyond the dense step's, per front end and method, as measured (the excess
#: column of ``python -m benchmarks.costs.exchange_cost --models resnet50 --front-ends ddp fsdp
#: horovod --accelerator-paths --steps 0 --warmup 2``): a ceiling that fails when a change adds
#: operations; lower it when a change removes some. Where it is above the budget (DGC, Gaussian-k,
#: SparseLoCo, MiCRO, ExDyna) issue 57 is not met yet. The hard threshold's fell from 128, 34 and 132
#: when its default capacity (the whole group) sent the masked group itself, not a padded payload;
#: DGC's from 320, 74 and 324 when its first settled threshold, lowered thresholds and cut took five
#: operations fewer a bucket; SparseLoCo's from 503, 105 and 510 when its quantizer, dequantizing,
#: codes and chunk starts took ten fewer, and two more when its codes were summed as bytes and its
#: buffer not reshaped; MiCRO's and ExDyna's DDP rows from 857 when a scan's block
#: maxima stopped slicing magnitudes that hold whole blocks only (four of the five buckets).
RECORDS = {
    "ddp": {"topk": 90, "lags": 90, "threshold": 73, "gtopk": 70, "dgc": 295, "gaussiank": 300, "sparseloco": 443,
            "micro": 853, "exdyna": 853},
    "fsdp": {"topk": 24, "lags": 24, "threshold": 23, "gtopk": 20, "dgc": 69, "gaussiank": 70, "sparseloco": 93,
             "micro": 187, "exdyna": 187},
    "horovod": {"topk": 94, "lags": 950, "threshold": 82, "gtopk": 20, "dgc": 299, "gaussiank": 304,
                "sparseloco": 450, "micro": 182, "exdyna": 182},
}
#: The groups a step exchanges with each front end's defaults: DDP's five buckets (25 MB, the first
#: 1 MB), FSDP2's one unit, the Horovod optimizer's flat buckets (25 MiB; one group for gTop-k,
#: MiCRO and ExDyna, whose defaults are the whole model; LAGS's layers, its own grouping).
GROUPS = {"ddp": dict.fromkeys(METHODS, 5), "fsdp": dict.fromkeys(METHODS, 1),
          "horovod": {**dict.fromkeys(METHODS, 5), "gtopk": 1, "micro": 1, "exdyna": 1, "lags": 54}}


@pytest.fixture(scope="module")
def cost(tmp_path_factory) -> Dict[str, Any]:
    """One run of the command line: every method on every front end, counted (no step timed),
    one Horovod row per tensor (Top-k's); its rows by front end and exchange, and its output."""
    out = tmp_path_factory.mktemp("cost") / "cost.json"
    result = run([sys.executable, "-m", "benchmarks.costs.exchange_cost", "--models", "resnet50", "--front-ends",
                  *FRONT_ENDS, "--accelerator-paths", "--steps", "0", "--warmup", "2", "--per-tensor", "topk",
                  "--threads", "2", "--results", str(out)])
    rows: List[Dict[str, Any]] = json.loads(out.read_text())["results"]["rows"]
    return {"rows": rows, "by": {(r["front_end"], r["exchange"]): r for r in rows}, "stdout": result.stdout}


def test_every_front_end_counts_each_exchange_beside_its_dense_one(cost):
    """Per front end a dense row, then every method's: DDP's with PowerSGD beside dense (its
    operations not counted on Gloo, whose threads run its callbacks), counted inside the hooks
    over DDP's buckets (the hook's calls: the same in every row); FSDP2's and the Horovod
    optimizer's whole steps, Top-k's one group per tensor (161) dispatching more than its flat
    buckets; ResNet-50's 161 tensors and 25.6 M parameters; every row printed, nothing timed;
    too short a warm-up for PowerSGD, bad ``--steps``, ``--threads`` and ``--per-tensor`` refused."""
    rows, by = cost["rows"], cost["by"]
    assert [(r["front_end"], r["exchange"]) for r in rows] == [
        ("ddp", "dense"), ("ddp", "powersgd"), *[("ddp", m) for m in METHODS], ("fsdp", "dense"),
        *[("fsdp", m) for m in METHODS], ("horovod", "dense"), *[("horovod", m) for m in METHODS],
        ("horovod", "topk@tensor")]
    dense, powersgd = by["ddp", "dense"], by["ddp", "powersgd"]
    assert (dense["parameters"], dense["tensors"]) == (models.count_parameters(models.resnet50()), 161)
    assert dense["buckets"] == powersgd["buckets"] == 5 and powersgd["ops"] is None and dense["ops"] > 0
    assert by["fsdp", "dense"]["buckets"] is None and by["fsdp", "dense"]["ops"] > 0
    assert by["horovod", "topk@tensor"]["buckets"] == 161
    assert by["horovod", "topk@tensor"]["ops"] > by["horovod", "topk"]["ops"] > by["horovod", "dense"]["ops"] > 0
    for r in rows:
        assert r["ms"] is r["over_dense"] is r["device_ms"] is None, r
        if r["ops"] is not None and r["exchange"] != "dense":
            assert r["excess_ops_per_bucket"] == pytest.approx(r["excess_ops"] / r["buckets"]), r
        ops = "- +-" if r["ops"] is None else f"{r['ops']} +\\{r['excess_ops']:+d}"
        assert re.search(rf"^resnet50 +{r['front_end']} +{r['exchange']} +{ops} +{r['buckets'] or '-'} ",
                         cost["stdout"], re.M), r
    command = [sys.executable, "-m", "benchmarks.costs.exchange_cost", "--models", "resnet50"]
    for extra, error in [(["--warmup", "1"], "--warmup 1: PowerSGD's first 2 steps are dense; warm up at least 2"),
                         (["--steps", "-1"], "--steps -1 --threads 1: steps are 0 or more, threads 1 or more"),
                         (["--methods", "topk", "--per-tensor", "dgc"], "--per-tensor dgc: name methods of --methods")]:
        refused = subprocess.run(command + extra, env=launcher_env(), cwd=ROOT, capture_output=True, text=True)
        assert refused.returncode == 2 and error in refused.stderr, refused.stderr


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_steps_operations_stay_within_their_budget_or_record(cost, front_end):
    """Each method's groups with the front end's defaults (:data:`GROUPS`: nothing split per
    tensor) and its operations beyond the dense step's: at most its record (:data:`RECORDS`), and
    for the methods within issue 57's budgets (:data:`WITHIN_BUDGET`) at most the budget a group
    plus :data:`STEP_END`. A copy per parameter (161 of them) or a bucket split per tensor breaks
    both."""
    for method in METHODS:
        r = cost["by"][front_end, method]
        budget = BUDGETS[method] * r["buckets"] + STEP_END
        print(f"{front_end} {method}: +{r['excess_ops']} operations in {r['buckets']} groups "
              f"({r['excess_ops_per_bucket']:.1f} a group), record {RECORDS[front_end][method]}, budget {budget}")
        assert r["buckets"] == GROUPS[front_end][method], (method, r["buckets"])
        assert r["excess_ops"] <= RECORDS[front_end][method], (method, r["excess_ops"])
        if method in WITHIN_BUDGET:
            assert r["excess_ops"] <= budget, (method, r["excess_ops"], budget)
