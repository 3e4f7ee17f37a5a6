"""Horovod's outer steps in two tiers (``horovod_sparse.torch.OuterSteps(..., hierarchical=True)``) on
a real 4-worker ``horovodrun`` job over Gloo, its hosts ``localhost:2,127.0.0.1:2`` the two nodes
(Horovod's ``cross_rank``): the two-tier configs of ``tests/outer/tiers.py`` bitwise those of the
``torch.distributed`` job (whose written-out reference ``tests/outer/test_two_tier.py`` holds
them to), with the training loop's own unnamed Horovod collective after every inner step."""
import pytest

from tests.outer.jobs import assert_twins
from tests.outer.tiers import BURST, DDP, EXACT, NONFINITE, NP, RESUMED, tiers_config
from tests.support.checks import Observed
from tests.support.launch import job_fixture

#: The torchrun job's two-tier configs under horovodrun (names prefixed ``hvd_``), each with an
#: unnamed ``hvd.broadcast_`` after every inner step: every method and DiLoCo's dense average, the
#: inner steps averaged in the host by Horovod's optimizer over ``node_process_set()``, resumed
#: mid-round, a NaN round (skipped and raised), MiCRO's cross sets taking their own rounds (``BURST``).
TWINS = EXACT + [DDP, RESUMED, BURST] + NONFINITE
#: ``node_size`` given (Horovod's nodes are its hosts): refused on every rank.
NODE_SIZE_GIVEN = tiers_config("hvd_tiers_node_size", "topk", keep=["node_size"])
HOROVOD = [{**c, "name": f"hvd_{c['name']}", "loop_collective": True} for c in TWINS] + [NODE_SIZE_GIVEN]

horovod_tiers_job = job_fixture("outer_steps.py", NP, HOROVOD, hosts="localhost:2,127.0.0.1:2",
                                env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})


@pytest.mark.parametrize("name", [c["name"] for c in TWINS])
def test_horovod_two_tier_outer_steps_equal_the_torch_distributed_ones_bitwise(horovod_tiers_job, tiers_job, name):
    """Each config's every recorded array (parameters at every boundary, averages, residuals), every
    boundary, abandonment and error, on all 4 ranks, bitwise those of the same config in the
    ``torch.distributed`` two tiers: the method across the hosts on each rank's slice of its host's
    sum, DiLoCo's dense average in the tiers, the inner steps' gradients averaged in the host
    (``tiers_ddp_topk``), resumed mid-round, NaN rounds abandoned everywhere; the loop's own
    collectives pairing up across ranks (Horovod would wait for ever otherwise)."""
    horovod = Observed(horovod_tiers_job, f"hvd_{name}", NP)
    assert_twins(horovod, Observed(tiers_job, name, NP), name)
    assert all(horovod.meta[r]["tiers"] == [2, 2] for r in range(NP))


def test_node_size_is_refused_on_every_rank(horovod_tiers_job):
    """``node_size`` given to Horovod's two tiers: the same ``ValueError`` on every rank at
    construction, naming the fix (the hosts are the nodes)."""
    obs = Observed(horovod_tiers_job, NODE_SIZE_GIVEN["name"], NP)
    errors = [obs.meta[r]["errors"] for r in range(NP)]
    assert all(e == errors[0] for e in errors), errors
    (error,) = errors[0]
    assert error[0] == -1 and "leave node_size=None" in error[1] and "horovodrun -H" in error[1], error


def test_cross_sets_took_their_own_rounds_and_the_loops_collectives_still_paired(horovod_tiers_job):
    """MiCRO with a burst in slice 0: the two cross sets launched different numbers of collectives
    in some round (ranks 0 and 2 own slice 0, ranks 1 and 3 slice 1), yet the job ran through with
    the loop's unnamed broadcast after every inner step (its rounds are bitwise the
    ``torch.distributed`` twin's: the test above): the round's end leveled the counts."""
    obs = Observed(horovod_tiers_job, f"hvd_{BURST['name']}", NP)
    launched = [[sum(g["collectives"] for g in x["stats"]["groups"]) for x in obs.meta[r]["rounds"]] for r in range(NP)]
    assert launched[0] == launched[2] and launched[1] == launched[3], launched
    assert launched[0] != launched[1], launched
