"""Horovod's outer steps (``horovod_sparse.torch.OuterSteps``) on a real 2-worker ``horovodrun``
job over Gloo: the worker of ``tests/outer`` (``tests/workers/outer_steps.py``) under Horovod,
against the written-out reference of the rounds, and bitwise against the ``torch.distributed``
outer steps of the same configs (the package's ``torchrun`` job): the same rounds, whatever the
collectives."""
import pytest

from tests.outer.jobs import (DILOCO, EXACT, METHODS, NONFINITE, NONFINITE_OVERLAP, OFFLOADED, OVERLAP, STREAMED,
                              STREAMED_RESUME, assert_rounds, assert_twins, config)
from tests.support.checks import Observed
from tests.support.launch import job_fixture

#: The torchrun job's configs run again under horovodrun (names prefixed ``hvd_``): every method's
#: rounds, DiLoCo's default dense and with Top-k, overlapped, streamed, resumed with an exchange in
#: flight (torch.save), a NaN (synchronous and overlapped), the outer state offloaded.
TWINS = (EXACT + DILOCO + [c for c in OVERLAP + STREAMED if c["name"] in ("overlap_topk", "streamed_micro")]
         + [c for c in STREAMED_RESUME if c["name"].startswith("streamed_topk_torch")]
         + [c for c in NONFINITE + NONFINITE_OVERLAP if c["name"].endswith("raise")] + OFFLOADED[:1])
#: Construction must raise the same error on both ranks: ``every`` differs, and a method built for
#: ``torch.distributed`` (``horovod_sparse.outer.Compression``).
REFUSED = [config("hvd_mismatch", "topk", every_of_rank={"1": 4}),
           config("hvd_wrong_namespace", "topk", namespace="outer")]
HOROVOD = [{**c, "name": f"hvd_{c['name']}"} for c in TWINS] + REFUSED

horovod_job = job_fixture("outer_steps.py", 2, HOROVOD)


@pytest.mark.parametrize("method", METHODS)
def test_horovod_rounds_match_the_written_out_reference_bitwise(horovod_job, method):
    """Every method's rounds under ``horovodrun``, on both ranks: the averaged pseudo-gradients,
    the parameters after every outer step and the residuals bitwise those of the written-out
    rounds (as on ``torch.distributed``)."""
    assert_rounds(config(method, method), Observed(horovod_job, f"hvd_{method}", 2))


@pytest.mark.parametrize("name", [c["name"] for c in TWINS])
def test_horovod_outer_steps_equal_the_torch_distributed_ones_bitwise(horovod_job, job, name):
    """Each config's every recorded array (parameters at every boundary, averages, residuals,
    the final ones), every boundary's inner step, fragment and closed exchanges, each exchange's
    abandonment and every error raised, on both ranks, bitwise those of the same config on
    ``torch.distributed``: DiLoCo's dense average through Horovod's allreduce, the methods
    through Horovod's collectives, overlapped, streamed, resumed, NaN rounds abandoned
    everywhere (``"raise"`` raising on both ranks), the outer state offloaded."""
    assert_twins(Observed(horovod_job, f"hvd_{name}", 2), Observed(job, name, 2), name)


def test_what_differs_between_ranks_or_was_built_for_torch_distributed_is_refused_everywhere(horovod_job):
    """``every`` differing between ranks, and a method built for ``torch.distributed``: construction
    raises the same ``ValueError`` on both ranks, naming what differs or the fix, before anything
    trains."""
    for name, says in (("hvd_mismatch", "every"), ("hvd_wrong_namespace", "horovod_sparse.torch.Compression.topk")):
        obs = Observed(horovod_job, name, 2)
        errors = [obs.meta[r]["errors"] for r in range(2)]
        assert errors[0] == errors[1] and errors[0][0][0] == -1 and says in errors[0][0][1], errors
