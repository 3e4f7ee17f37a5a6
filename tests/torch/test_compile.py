"""``torch.compile``: a compiled model trains through the Horovod optimizer and through DDP with
the comm hook as the same model does eagerly (``tests/workers/compiled.py``, one 2-worker
``horovodrun`` job, Inductor on the CPU), and what cannot work is refused with the fix.

Inductor fuses the model's kernels in another order than eager mode, so a compiled run's
parameters match the eager run's up to float32 rounding (:data:`ROUNDING`), not bitwise; a sparse
step is a thousand times coarser than that (``lr * |g|`` at the selected coordinates), so an
exchange that selected, delivered or averaged anything else would fail by far. The statistics
(coordinates selected, reaching the model, dense or not) must be equal.
"""
import numpy as np
import pytest

import horovod_sparse.methods  # noqa: F401  (registers the methods)
from horovod_sparse.common.registry import method_names
from horovod_sparse.ddp.hook import PYTHON_REDUCER_REFUSAL
from tests.support.checks import Observed
from tests.support.launch import job_fixture

STEPS = 4
#: The largest difference of a parameter between the compiled and the eager run: float32
#: rounding of values below 1 over a few steps (seen: below 1e-8).
ROUNDING = 1e-6
FRONT_ENDS = ("horovod", "ddp")
CONFIGS = ([{"name": f"{front}_{method}", "front_end": front, "method": method, "steps": STEPS}
            for front in FRONT_ENDS for method in method_names()]
           + [{"name": f"{front}_autograd", "front_end": front, "method": "micro", "steps": STEPS,
               "compiled_autograd": True} for front in FRONT_ENDS]
           + [{"name": "ddp_python_reducer", "front_end": "ddp", "method": "topk", "steps": 1,
               "optimize_ddp": "python_reducer", "compiled_autograd": True}])

job = job_fixture("compiled.py", 2, CONFIGS)


@pytest.mark.parametrize("name", [c["name"] for c in CONFIGS if "optimize_ddp" not in c])
def test_compiled_model_trains_as_the_eager_one(job, name):
    """Per step and rank: the same statistics, sparse groups after DDP's first step, losses and
    parameters within :data:`ROUNDING`; the loss falls; replicas stay identical."""
    obs = Observed(job, name, 2)
    for rank, (arrays, record) in enumerate(zip(obs.arrays, obs.meta)):
        eager, compiled = record["eager"], record["compiled"]
        assert "error" not in compiled, compiled.get("error")
        assert compiled["stats"] == eager["stats"], rank
        assert not any(dense for _, _, dense in eager["stats"][-1]), eager["stats"][-1]
        np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=0, atol=ROUNDING)
        assert eager["losses"][-1] < eager["losses"][0], eager["losses"]
        for key in (k for k in arrays if k.startswith("eager_")):
            np.testing.assert_allclose(arrays["compiled_" + key[len("eager_"):]], arrays[key], rtol=0,
                                       atol=ROUNDING, err_msg=f"rank {rank} {key}")
            np.testing.assert_array_equal(arrays[key], obs.arrays[0][key], err_msg=f"rank {rank} {key}")


def test_python_reducer_refused_with_the_fix(job):
    """Dynamo's Python reducer (``optimize_ddp="python_reducer"``) hands the hook no bucket: every
    rank raises the refusal naming the mode and the fix."""
    for record in Observed(job, "ddp_python_reducer", 2).meta:
        kind, message = record["compiled"]["error"]
        assert kind == "TypeError", (kind, message)
        assert PYTHON_REDUCER_REFUSAL.format(got="tuple") in message, message
