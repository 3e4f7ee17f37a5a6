"""Outer steps in two tiers (``horovod_sparse.outer.OuterSteps(..., hierarchical=True)``) on one real
``torchrun`` job of 4 ranks split into 2 nodes of 2 (``node_size=2``, Gloo), against a written-out
reference of the two-tier rounds (:func:`tests.outer.tiers.reference_two_tier`): the node sums of
``residual + anchor - θ``, each slice exchanged by the flat method's reference across the ranks
owning it, the averages gathered, SGD of lr 1 outside. The worker (``tests/workers/outer_steps.py``)
is the flat tests' (tests/outer/test_rounds.py), and so is the reference's input: only each rank's
parameters at the end of a round are taken from the job.
"""
import numpy as np
import pytest

from tests.outer.jobs import (EVERY, SHAPES, as32, assert_second_round_abandoned, one_process_lines, round_thetas,
                              start_params)
from tests.outer.tiers import (DDP, EXACT, LAYOUTS, NODE_SIZE, NODES, NONFINITE, NP, ONE_NODE, REFUSED, RESUMED,
                               assert_two_tier_rounds)
from tests.support.checks import Observed, assert_conserved


@pytest.mark.parametrize("name", [c["name"] for c in EXACT + [DDP]])
def test_two_tier_rounds_match_the_written_out_reference_bitwise(tiers_job, name):
    """Top-k, MiCRO, gTop-k, SparseLoCo and ``Compression.none`` (DiLoCo's dense average, in two
    tiers too), and Top-k with the model in DDP over ``outer.node_group``: the job runs in two
    tiers of 2 x 2, and every round's average, every rank's parameters after it and the final
    residuals (each rank's its slice's) are bitwise the written-out two-tier rounds'."""
    cfg = next(c for c in EXACT + [DDP] if c["name"] == name)
    obs = Observed(tiers_job, name, NP)
    for r in range(NP):
        assert obs.meta[r]["tiers"] == [NODE_SIZE, NP // NODE_SIZE] and obs.meta[r]["errors"] == []
        assert [x["step"] for x in obs.meta[r]["rounds"]] == [EVERY - 1, 2 * EVERY - 1, 3 * EVERY - 1]
    assert_two_tier_rounds(cfg, obs)


@pytest.mark.parametrize("name", [c["name"] for c in EXACT + [DDP]])
def test_identical_replicas_nothing_lost_and_both_tiers_used(tiers_job, name):
    """All 4 ranks start from rank 0's parameters and hold bitwise the same after every outer
    step; nothing is lost (the averages delivered plus the mean residual are the mean of every
    rank's pseudo-gradients, to within float32's rounding bound); every group's exchange moved
    bytes inside the node (reduce-scatter, gather) and across nodes."""
    cfg, obs = next(c for c in EXACT + [DDP] if c["name"] == name), Observed(tiers_job, name, NP)
    start, rounds = start_params(), obs.meta[0]["rounds"]
    for r in range(NP):
        for i in range(len(SHAPES)):
            np.testing.assert_array_equal(as32(obs.arrays[r][f"start_{i}"]).reshape(-1), start[i])
            for j in range(len(rounds)):
                np.testing.assert_array_equal(obs.arrays[r][f"param_{j}_{i}"], obs.arrays[0][f"param_{j}_{i}"],
                                              err_msg=f"rank {r} round {j} parameter {i}")
    for entry in rounds:
        for g in entry["stats"]["groups"]:
            assert g["sent"]["node"] > 0 and g["sent"]["values"] > 0, g
    if cfg["method"] == "none":
        return
    for i in range(len(SHAPES)):
        anchors = [start[i]] + [as32(obs.arrays[0][f"param_{j}_{i}"]).reshape(-1) for j in range(len(rounds) - 1)]
        raw = np.stack([np.stack([(anchors[j] - round_thetas(obs, j)[r][i]).astype(np.float64) for r in range(NP)])
                        for j in range(len(rounds))])
        delivered = sum(obs.arrays[0][f"agg_{j}_{i}"] for j in range(len(rounds)))
        final = [obs.arrays[r][f"residual_{len(rounds) - 1}_{i}"] for r in range(NP)]
        assert_conserved(delivered, final, raw, "float32", f"{name} parameter {i}")


def test_ddp_over_the_node_group_keeps_each_node_one_replica(tiers_job):
    """With the model in DDP over ``outer.node_group``, a node's ranks end every round with the
    same parameters (their gradients averaged in the node), the two nodes with others."""
    obs = Observed(tiers_job, DDP["name"], NP)
    for j in range(len(obs.meta[0]["rounds"])):
        thetas = round_thetas(obs, j)
        for i in range(len(SHAPES)):
            for first, second in NODES:
                np.testing.assert_array_equal(thetas[second][i], thetas[first][i], err_msg=f"round {j} {i}")
            assert not np.array_equal(thetas[NODES[0][0]][i], thetas[NODES[1][0]][i])


def test_exact_resume_mid_round_in_two_tiers(tiers_job):
    """Saved one inner step into the second round (``torch.save``) and loaded into a fresh model,
    inner optimizer and two-tier ``OuterSteps`` (its tiers made anew), training goes on bitwise
    as without the interruption: every round's parameters, averages and residuals on all 4 ranks."""
    whole, resumed = Observed(tiers_job, "tiers_topk", NP), Observed(tiers_job, RESUMED["name"], NP)
    for r in range(NP):
        assert sorted(whole.arrays[r]) == sorted(resumed.arrays[r])
        for key, value in whole.arrays[r].items():
            np.testing.assert_array_equal(resumed.arrays[r][key], value, err_msg=f"rank {r} {key}")
        assert resumed.meta[r]["tiers"] == [NODE_SIZE, NP // NODE_SIZE]


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_round_abandoned_on_every_rank(tiers_job, policy):
    """Rank 1's NaN in the second round: the round is abandoned on all 4 ranks (no outer step:
    every rank back at the round's anchor), ``"raise"`` raises ``FloatingPointError`` on every
    rank at the round's end; the written-out rounds with that round abandoned hold bitwise: each
    rank's residual the node sum of its slice (rank 1's NaN pseudo-gradient never in it, its
    finite ones kept), and the third round runs normally."""
    cfg = next(c for c in NONFINITE if c["name"] == f"tiers_nan_{policy}")
    obs = Observed(tiers_job, cfg["name"], NP)
    assert_second_round_abandoned(obs, policy, bad_rank=1)
    assert_two_tier_rounds(cfg, obs, abandoned=(1,), nan=(1, 0))


def _errors(tiers_job, name):
    """Every rank's recorded errors, asserted the same on every rank."""
    obs = Observed(tiers_job, name, NP)
    errors = [obs.meta[r]["errors"] for r in range(NP)]
    assert all(e == errors[0] for e in errors), errors
    return errors[0]


@pytest.mark.parametrize("name,expected", [
    ("tiers_subgroup", "needs the default process group; use hierarchical=False with another process_group"),
    ("tiers_hierarchical_differs", "rank 3 differs from rank 0: hierarchical=False (rank 0: True)"),
    ("tiers_node_size_differs", "rank 3 differs from rank 0: node_size=4 (rank 0: 2)"),
    ("tiers_local_world_size_differs", "needs the same node_size >= 1 on every rank (LOCAL_WORLD_SIZE by default); "
                                       "the ranks have [4, 2, 4, 4]"),
    ("tiers_uneven", "needs the same number of workers on every node"),
])
def test_tiers_that_cannot_be_had_are_refused_on_every_rank(tiers_job, name, expected):
    """Another process group than the default, ``hierarchical`` or ``node_size`` differing between
    ranks (given, or by ``LOCAL_WORLD_SIZE``), nodes of 3 workers on 4 ranks: construction raises
    the same ``ValueError`` on every rank, naming the problem and the fix, before any tier is made
    (a rank left out of the tiers' collectives would hang the others)."""
    assert name in REFUSED
    (error,) = _errors(tiers_job, name)
    assert error[0] == -1 and expected in error[1], error


def test_one_node_runs_flat_and_layouts_are_not_mixed_in_checkpoints(tiers_job):
    """``hierarchical=True`` without ``node_size`` on this one-node launch (``LOCAL_WORLD_SIZE=4``)
    runs flat; a two-tier state loaded into flat outer steps, and a flat one into two-tier outer
    steps, is refused on every rank naming the arguments that resume it."""
    assert Observed(tiers_job, ONE_NODE["name"], NP).meta[0]["tiers"] is None
    into_flat, into_tiers = _errors(tiers_job, LAYOUTS["name"])
    assert into_flat[0] == into_tiers[0] == -2
    assert "saved in two tiers of 2 workers per node, these run flat" in into_flat[1], into_flat
    assert "hierarchical=True, node_size=2" in into_flat[1], into_flat
    assert "saved flat, these run in two tiers of 2" in into_tiers[1] and "hierarchical=False" in into_tiers[1]


REFUSALS = """
refused(lambda: hso.OuterSteps(model, inner, hierarchical="yes"))
refused(lambda: hso.OuterSteps(model, inner, hierarchical=True, node_size=0))
refused(lambda: hso.OuterSteps(model, inner, hierarchical=True, node_size=1).node_group)
refused(lambda: hs.OuterSteps(model, inner, hierarchical=True).node_group)
os.environ["HOROVOD_ELASTIC"] = "1"
refused(lambda: hs.OuterSteps(model, inner, hierarchical=True))
"""


def test_what_cannot_work_in_one_process_is_refused_with_the_fix():
    """A ``hierarchical`` that is not a bool, a ``node_size`` below 1, the node group of outer
    steps that run flat (one worker per node; Horovod's on one host), and Horovod's two tiers in an
    elastic job (``HOROVOD_ELASTIC=1``: its hosts change) are refused, each naming the fix."""
    flag, size, node_group, horovod, elastic = one_process_lines(REFUSALS, 29537, 5)
    assert "hierarchical must be True or False" in flag and "'yes'" in flag, flag
    assert "node_size must be an integer >= 1" in size, size
    assert "run flat" in node_group and "there is no node group" in node_group, node_group
    assert "run flat" in horovod and "there is no node group" in horovod, horovod
    assert "hierarchical=False in a Horovod elastic job" in elastic, elastic
