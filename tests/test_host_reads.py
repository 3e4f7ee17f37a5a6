"""Host synchronisations per step, counted on the CPU as a GPU would make them
(``tests/workers/torch_host_reads.py``, a 2-worker horovodrun job, three groups of 1200, 30 and
1440 elements; ``tests/host_reads.py`` says what counts): no method's count may grow beyond
:data:`BUDGET`, the README's table (there per group: these totals over three groups)."""
import pytest

import horovod_sparse.methods  # noqa: F401  (registers the methods)
from horovod_sparse.common.registry import method_names
from tests.checks import Observed
from tests.launch import job_fixture

SHAPES = [[40, 30], [30], [36, 40]]
OPTIONS = {"density": 0.05, "min_numel": 0}
#: Host reads of one step of three groups on the accelerators' paths. Per group: one finiteness
#: check; per step: one read of every group's union count when the step's statistics settle and
#: the agreement on non-finite gradients; and what each method's selection reads.
#: The most of either rank (their selections differ: Gaussian-k's and DGC's retries depend on the data).
BUDGET = {"topk": 5, "lags": 5, "threshold": 11, "dgc": 15, "gaussiank": 22, "gtopk": 19, "micro": 38, "exdyna": 38}
CONFIGS = [{"method": m, "shapes": SHAPES, "options": {**OPTIONS, **({"adaptive": False} if m == "lags" else {})}}
           for m in method_names()]

job = job_fixture("torch_host_reads.py", 2, CONFIGS)


@pytest.mark.parametrize("method", method_names())
def test_host_reads_per_step_within_the_budget(job, method):
    """Within :data:`BUDGET`, and the accelerators' paths (run on the CPU) computing bitwise what
    the host paths compute."""
    obs = Observed(job, method, 2)
    for rank, record in enumerate(obs.meta):
        assert record["groups"] == len(SHAPES)
        assert record["same_as_host_paths"], f"rank {rank}: the accelerators' paths computed something else"
        print(f"{method} rank {rank}: {len(record['reads'])} host reads per step ({len(SHAPES)} groups)")
        assert len(record["reads"]) <= BUDGET[method], (rank, len(record["reads"]), record["reads"])
