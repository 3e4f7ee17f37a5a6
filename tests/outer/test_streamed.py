"""Overlapped rounds and streamed fragments of ``horovod_sparse.outer.OuterSteps`` (``overlap=``,
``fragments=``) on the real ``torchrun`` job of ``tests/outer`` (Gloo), against a written-out
reference of the delayed, fragmented rounds (:func:`tests.outer.jobs.reference_streamed`): each
rank's parameters at every inner step where the worker's record says they were, every method's
exchange from its own reference (``tests.support.reference_grouping``)."""
import numpy as np
import pytest

from horovod_sparse.outer import fragments as fragmenting
from tests.outer.jobs import (EVERY, NONFINITE_OVERLAP, OFFLOAD, OVERLAP, SHAPES, STREAMED, STREAMED_END,
                              assert_streamed)
from tests.support.checks import Observed

#: Each streamed config's fragments, offsets and boundaries (inner step, fragment), written out:
#: sizes 600, 20, 1200, 7 cut about evenly; fragment f ends its round at position (f+1)*3//F % 3.
LAYOUTS = {
    1: ([[0, 1, 2, 3]], [0], [(2, 0), (5, 0), (8, 0)]),
    2: ([[0, 1], [2, 3]], [1, 0], [(0, 0), (2, 1), (3, 0), (5, 1), (6, 0), (8, 1)]),
    3: ([[0], [1], [2, 3]], [1, 2, 0], [(s, s % 3) for s in range(9)]),
}


@pytest.mark.parametrize("name", [c["name"] for c in OVERLAP + STREAMED])
def test_overlapped_and_streamed_rounds_match_the_written_out_reference_bitwise(job, name):
    """Every method, overlapped (one fragment), overlapped over 2 fragments, and synchronous over
    3: the fragments and their boundaries where they should be, and every boundary's parameters
    on both ranks, the parameters after the final flush and the residuals bitwise the
    written-out delayed rounds'; so each fragment's replicas agree at its boundaries, and after
    the flush every replica holds the same parameters when there is one fragment (with more, the
    fragments other than the last keep their progress since their boundaries: see
    :func:`test_sync_then_flush_leaves_identical_replicas`)."""
    cfg = next(c for c in OVERLAP + STREAMED if c["name"] == name)
    obs = Observed(job, name, 2)
    fragments, offsets, boundaries = LAYOUTS[cfg.get("fragments", 1)]
    assert (obs.meta[0]["fragments"], obs.meta[0]["offsets"]) == (fragments, offsets)
    assert [(x["step"], x["fragment"]) for x in obs.meta[0]["rounds"]] == boundaries
    closed = [x["steps"] for x in obs.meta[0]["rounds"]]
    first = 0 if cfg.get("overlap") else 1  # overlapped: an exchange closes at the next boundary
    assert closed == list(range(first, len(boundaries) + first)), closed
    assert_streamed(cfg, obs)
    for i in range(len(SHAPES)) if len(fragments) == 1 else []:
        np.testing.assert_array_equal(obs.arrays[0][f"final_{i}"], obs.arrays[1][f"final_{i}"])


def test_sync_then_flush_leaves_identical_replicas(job):
    """Overlapped over 2 fragments, training ending mid-cycle: ``sync()`` then ``flush()`` leave
    both ranks bitwise the same parameters (every fragment's last round applied), finite."""
    obs = Observed(job, STREAMED_END["name"], 2)
    for i in range(len(SHAPES)):
        final = obs.arrays[0][f"final_{i}"]
        assert np.isfinite(final).all()
        np.testing.assert_array_equal(obs.arrays[1][f"final_{i}"], final, err_msg=f"parameter {i}")
        assert not np.array_equal(final, obs.arrays[0][f"theta_{len(obs.meta[0]['rounds']) - 1}_{i}"])


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_an_overlapped_nonfinite_round_is_abandoned_everywhere_when_its_exchange_ends(job, policy):
    """Rank 1's NaN in the second round: that round's exchange ends at the third round's end,
    abandoned on both ranks (no outer step; ``"raise"`` raises ``FloatingPointError`` there on
    both); the written-out rounds with that exchange abandoned hold bitwise: each finite
    pseudo-gradient kept in its residual, rank 1's NaN never reaching its residual, and the
    rounds after it run normally."""
    cfg = next(c for c in NONFINITE_OVERLAP if c["name"] == f"nan_overlap_{policy}")
    obs = Observed(job, cfg["name"], 2)
    for r in range(2):
        stats = [x["stats"] for x in obs.meta[r]["rounds"]]
        assert stats[0] is None and [s["abandoned"] for s in stats[1:]] == [False, True], stats
        errors = obs.meta[r]["errors"]
        if policy == "raise":
            assert [e[0] for e in errors] == [3 * EVERY - 1] and "rank(s) [1]" in errors[0][1], errors
        else:
            assert errors == []
    assert_streamed(cfg, obs, abandoned=(1,), nan=(1, 0))


@pytest.mark.parametrize("name", sorted(OFFLOAD))
def test_offloaded_outer_state_gives_the_same_rounds_bitwise(job, name):
    """``offload=True`` (the anchor and the outer optimizer's state in CPU memory, the outer
    optimizer built by the function given, or DiLoCo's by default, over the anchor's tensors):
    every array each rank recorded (every boundary's parameters, averages and residuals, the
    final ones) and every boundary's record bitwise those of the same config without it, and its
    outer optimizer steps tensors in the anchor's memory (without it, the parameters)."""
    offloaded, twin = Observed(job, name, 2), Observed(job, OFFLOAD[name], 2)
    for r in range(2):
        assert sorted(offloaded.arrays[r]) == sorted(twin.arrays[r])
        for key, value in twin.arrays[r].items():
            np.testing.assert_array_equal(offloaded.arrays[r][key], value, err_msg=f"{name} rank {r} {key}")
        assert [(x["step"], x["fragment"], x["steps"]) for x in offloaded.meta[r]["rounds"]] == [
            (x["step"], x["fragment"], x["steps"]) for x in twin.meta[r]["rounds"]]
        assert offloaded.meta[r]["steps_the_anchor"] and not twin.meta[r]["steps_the_anchor"]


def test_fragments_are_contiguous_nonempty_runs_about_even_in_elements():
    """:func:`horovod_sparse.outer.fragments.cut`: for random sizes and counts, the runs are
    consecutive, cover every group once and are never empty; equal groups split evenly; a
    fragment never exceeds its even share by more than its last group; more fragments than
    groups are refused naming the fix. The offsets are distinct whenever ``every >= F``."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        numels = [int(n) for n in rng.integers(1, 1000, size=int(rng.integers(1, 12)))]
        count = int(rng.integers(1, len(numels) + 1))
        runs = fragmenting.cut(numels, count)
        assert len(runs) == count and all(runs) and sum(runs, []) == list(range(len(numels))), (numels, count, runs)
        total, done = sum(numels), 0
        for f, run in enumerate(runs[:-1]):
            done += sum(numels[i] for i in run)
            assert done - numels[run[-1]] < (f + 1) * total / count or len(run) == 1, (numels, count, runs)
    assert fragmenting.cut([5] * 12, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    with pytest.raises(ValueError, match="fragments <= 2"):
        fragmenting.cut([3, 4], 3)
    for every in range(1, 20):
        for count in range(1, every + 1):
            assert sorted(fragmenting.offsets(every, count)) == sorted(set(fragmenting.offsets(every, count)))
