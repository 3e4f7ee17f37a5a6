"""Outer steps on FSDP2's replica axis (``horovod_sparse.outer.OuterSteps`` of a ``fully_shard``-ed
model, ``process_group=mesh["replicate"].get_group()``) on one real ``torchrun`` job of 4 ranks as a
2 x 2 mesh (2 replicas, each sharded over 2 ranks; Gloo), against the written-out rounds of each
shard position (:func:`tests.outer.fsdp.reference_position`): the flat rounds over the 2 ranks
holding that shard, from their recorded local shards at each round's end. The worker is the flat
tests' (``tests/workers/outer_steps.py``, its ``fsdp`` option).
"""
import numpy as np
import pytest

from tests.outer.fsdp import (DILOCO, EMPTY_SHARD, EXACT, NONFINITE, NP, OFFLOADED, POSITIONS, REFUSED, REPLICAS_OF,
                              RESUMED, STREAMED, STREAMED_RESUMED, Position, assert_fsdp_rounds, local_shapes,
                              reference_position, start_shards)
from tests.outer.jobs import EVERY, SHAPES, as32, assert_second_round_abandoned, assert_streamed, round_thetas
from tests.support.checks import Observed, assert_conserved


@pytest.mark.parametrize("name", [c["name"] for c in EXACT])
def test_each_shard_matches_the_written_out_rounds_bitwise(fsdp_job, name):
    """Top-k, MiCRO, gTop-k, SparseLoCo and ``Compression.none`` (DiLoCo's dense average): each
    rank holds its local shards (their shapes FSDP's), and every round's average, every rank's
    shards after the outer step (SGD, lr 1, stepping the DTensor parameters) and the final
    residuals are bitwise the written-out rounds of its shard position, the rounds closing after
    every ``every``-th inner step."""
    cfg = next(c for c in EXACT if c["name"] == name)
    obs = Observed(fsdp_job, name, NP)
    for r in range(NP):
        assert obs.meta[r]["errors"] == [] and obs.meta[r]["tiers"] is None
        assert [x["step"] for x in obs.meta[r]["rounds"]] == [EVERY - 1, 2 * EVERY - 1, 3 * EVERY - 1]
        assert [list(obs.arrays[r][f"start_{i}"].shape) for i in range(len(SHAPES))] == local_shapes(r % POSITIONS)
    assert_fsdp_rounds(cfg, obs)


@pytest.mark.parametrize("name", [c["name"] for c in EXACT])
def test_replicas_identical_and_nothing_lost(fsdp_job, name):
    """Every rank starts from replica 0's shard of its position (taken at construction) and holds
    bitwise its replica twin's shard after every outer step; the two shard positions hold
    different shards; nothing is lost per shard (the averages delivered plus the mean residual
    are the mean of the pseudo-gradients of its replicas, to within float32's rounding bound)."""
    cfg, obs = next(c for c in EXACT if c["name"] == name), Observed(fsdp_job, name, NP)
    rounds = obs.meta[0]["rounds"]
    for s, ranks in enumerate(REPLICAS_OF):
        start = start_shards(s)
        for r in ranks:
            for i in range(len(SHAPES)):
                np.testing.assert_array_equal(as32(obs.arrays[r][f"start_{i}"]).reshape(-1), start[i])
                for j in range(len(rounds)):
                    twin = obs.arrays[ranks[0]][f"param_{j}_{i}"]
                    np.testing.assert_array_equal(obs.arrays[r][f"param_{j}_{i}"], twin, err_msg=f"{r} {j} {i}")
        if cfg["method"] == "none":
            continue
        for i in range(len(SHAPES)):
            anchors = [start[i]] + [as32(obs.arrays[ranks[0]][f"param_{j}_{i}"]).reshape(-1)
                                    for j in range(len(rounds) - 1)]
            raw = np.stack([np.stack([(anchors[j] - theta[i]).astype(np.float64) for theta in
                                      round_thetas(Position(obs, s), j)]) for j in range(len(rounds))])
            delivered = sum(obs.arrays[ranks[0]][f"agg_{j}_{i}"] for j in range(len(rounds)))
            final = [obs.arrays[r][f"residual_{len(rounds) - 1}_{i}"] for r in ranks]
            assert_conserved(delivered, final, raw, "float32", f"{name} position {s} parameter {i}")
    assert not np.array_equal(obs.arrays[0]["param_0_0"], obs.arrays[1]["param_0_0"])


def test_diloco_outer_optimizer_over_the_dtensor_parameters(fsdp_job):
    """DiLoCo's default Nesterov SGD steps the DTensor parameters with DTensor gradients: its
    momentum is a DTensor sharded like them, and each shard is the written-out Nesterov rounds'
    (float64) to within a few float32 roundings, the replicas bitwise alike, a final
    :meth:`sync` after a part round included."""
    obs = Observed(fsdp_job, DILOCO["name"], NP)
    assert [x["step"] for x in obs.meta[0]["rounds"]] == [2, 5, 8, 10]
    for s, ranks in enumerate(REPLICAS_OF):
        expected, _ = reference_position(DILOCO, obs, s)
        for r in ranks:
            assert obs.meta[r]["outer_state_sharded"] and obs.meta[r]["errors"] == []
            for j, (_, params) in enumerate(expected):
                for i in range(len(SHAPES)):
                    got = as32(obs.arrays[r][f"param_{j}_{i}"]).reshape(-1)
                    np.testing.assert_array_equal(got, as32(obs.arrays[ranks[0]][f"param_{j}_{i}"]).reshape(-1))
                    np.testing.assert_allclose(got, params[i], rtol=1e-6, atol=1e-6 * float(np.abs(params[i]).max()),
                                               err_msg=f"position {s} round {j} parameter {i}")


def test_overlapped_streamed_rounds_per_shard_bitwise(fsdp_job):
    """Overlapped rounds over 2 streamed fragments (MiCRO): each shard position's boundaries (a
    fragment's outer step one round late, the progress since its boundary kept), the parameters
    after the final flush and the residuals are bitwise its written-out delayed rounds."""
    obs = Observed(fsdp_job, STREAMED["name"], NP)
    assert obs.meta[0]["fragments"] == [[0, 1], [2, 3]] and obs.meta[0]["errors"] == []
    for s in range(POSITIONS):
        assert_streamed(STREAMED, Position(obs, s), start=start_shards(s), shapes=local_shapes(s))


def test_an_empty_shard_is_exchanged_dense(fsdp_job):
    """A parameter of one row leaves shard position 1 an empty shard: its group is exchanged
    dense there (nothing to select; a sparse method would index an empty buffer), sparse on
    position 0, and every round ends with the replicas alike and the outer step taken."""
    obs = Observed(fsdp_job, EMPTY_SHARD["name"], NP)
    rounds = obs.meta[0]["rounds"]
    for r in range(NP):
        assert obs.meta[r]["errors"] == [] and obs.arrays[r]["start_0"].size == (4 if r % POSITIONS == 0 else 0)
        for j, entry in enumerate(obs.meta[r]["rounds"]):
            assert [g["dense"] for g in entry["stats"]["groups"]] == [r % POSITIONS == 1, False], entry
            for i in range(2):
                np.testing.assert_array_equal(obs.arrays[r][f"param_{j}_{i}"],
                                              obs.arrays[r % POSITIONS][f"param_{j}_{i}"], err_msg=f"{r} {j} {i}")
    assert not np.array_equal(obs.arrays[0]["param_0_0"], obs.arrays[0][f"param_{len(rounds) - 1}_0"])


@pytest.mark.parametrize("twin,name", [("fsdp_topk", OFFLOADED["name"]), ("fsdp_topk", RESUMED["name"]),
                                       (STREAMED["name"], STREAMED_RESUMED["name"])])
def test_offloaded_and_resumed_through_dcp_equal_the_plain_run_bitwise(fsdp_job, twin, name):
    """The outer state offloaded to CPU memory (the outer optimizer stepping the anchor's local
    shards), and a run saved one inner step into the second round through
    ``torch.distributed.checkpoint`` (``dcp.save({"outer": outer})``: each rank's model shards,
    optimizers, anchor and residuals; streamed, with fragment 0's exchange in flight) and loaded
    into a fresh model, inner optimizer and ``OuterSteps`` built from other parameters: each goes
    on bitwise as the plain run, every round's shards, averages and residuals on all 4 ranks."""
    plain, other = Observed(fsdp_job, twin, NP), Observed(fsdp_job, name, NP)
    for r in range(NP):
        assert sorted(plain.arrays[r]) == sorted(other.arrays[r]) and other.meta[r]["errors"] == []
        for key, value in plain.arrays[r].items():
            np.testing.assert_array_equal(other.arrays[r][key], value, err_msg=f"{name} rank {r} {key}")
    assert all(other.meta[r]["steps_the_anchor"] for r in range(NP)) == (name == OFFLOADED["name"])


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_shard_abandons_the_round_on_every_rank(fsdp_job, policy):
    """Rank 1's NaN reaches rank 0's shard alone (FSDP's reduce-scatter): the round is abandoned on
    all 4 ranks, both shard positions (no outer step: every rank back at the round's anchor),
    ``"raise"`` raises ``FloatingPointError`` naming rank 0 on every rank at the round's end;
    the written-out rounds with that round abandoned hold bitwise (rank 0's NaN pseudo-gradient
    never in its residual, every finite one kept), and the third round runs normally."""
    cfg = next(c for c in NONFINITE if c["name"] == f"fsdp_nan_{policy}")
    obs = Observed(fsdp_job, cfg["name"], NP)
    assert_second_round_abandoned(obs, policy, bad_rank=0)
    assert not np.isfinite(round_thetas(obs, 1)[0][0]).all() and np.isfinite(round_thetas(obs, 1)[1][0]).all()
    assert_fsdp_rounds(cfg, obs, abandoned=(1,), nan=(0, 0))


@pytest.mark.parametrize("name,expected", [
    ("fsdp_world", "does not hold replicas of one shard"),
    ("fsdp_shard_group", "does not hold replicas of one shard"),
    ("fsdp_hsdp", "was sharded with a 2-D mesh (FSDP's own HSDP"),
    ("fsdp_every_differs", "rank 3 differs from rank 0: every=4 (rank 0: 3)"),
    ("fsdp_hierarchical", "needs the default process group; use hierarchical=False"),
])
def test_what_cannot_work_is_refused_on_every_rank(fsdp_job, name, expected):
    """Every rank as the process group, or the shard group (not the replicas of one shard
    position), a model sharded over the 2-D mesh (FSDP's HSDP averages across replicas itself),
    ``every`` differing on rank 3 alone (outside rank 0's replicate group: agreed over the whole
    job) and two tiers: construction raises the same ``ValueError`` on all 4 ranks, naming the
    problem and the fix (``mesh['replicate']``, the 1-D ``mesh['shard']``), none left waiting."""
    assert name in REFUSED
    obs = Observed(fsdp_job, name, NP)
    errors = [obs.meta[r]["errors"] for r in range(NP)]
    assert all(len(e) == 1 and e[0][0] == -1 and expected in e[0][1] for e in errors), errors
    if name in ("fsdp_world", "fsdp_shard_group"):
        assert "mesh['replicate']" in errors[0][0][1]
    if name == "fsdp_hsdp":
        assert "mesh['replicate'].get_group() as process_group" in errors[0][0][1]
