"""Outer steps (``horovod_sparse.outer``) on real ``torchrun`` jobs over Gloo, against a written-out
reference of DiLoCo's rounds.

``tests/workers/outer_steps.py`` trains on known per-rank gradients and records, every round,
each rank's parameters before the exchange, the averaged pseudo-gradient, the parameters after
the outer step and the residuals. The reference (``tests.outer.jobs.reference_rounds``) takes
only each rank's parameters at the end of a round (what its inner optimizer did is not the
algorithm under test) and recomputes everything else: the pseudo-gradient ``anchor - θ``, the
method's exchange of it with error feedback (``tests.support.reference_grouping``'s per-method
references, a round being a step), and the outer step from the anchor.
"""
import numpy as np
import pytest

import horovod_sparse.outer as hso
from tests.outer.jobs import (BLOCKS, DECAY, DILOCO, EVERY, METHODS, RESUME, SHAPES, STEPS, STREAMED_RESUME, as32,
                              assert_rounds, config, dense_average, nesterov_reference, one_process_lines,
                              reference_rounds, round_thetas, start_params)
from tests.support.checks import Observed, assert_conserved


@pytest.mark.parametrize("method", METHODS)
def test_rounds_match_the_written_out_reference_bitwise(job, method):
    """Every round on both ranks, bitwise: the averaged pseudo-gradient is the method's exchange
    of ``anchor - θ`` plus the residual (the reference of every method), the parameters after the
    outer step (SGD, lr 1: an exact subtraction) are ``anchor - average``, the residuals carry
    over; and the rounds close where they should, after every ``every``-th inner step."""
    cfg, obs = config(method, method), Observed(job, method, 2)
    assert [r["step"] for r in obs.meta[0]["rounds"]] == [EVERY - 1, 2 * EVERY - 1, 3 * EVERY - 1]
    assert_rounds(cfg, obs)


def test_error_feedback_decay_matches_the_written_out_rounds_bitwise(job):
    """SparseLoCo's ``error_decay=0.95``: every round's average and parameters, and the final
    residuals, bitwise those of the written-out rounds whose residuals are multiplied by 0.95
    after each round (the engine's decay, applied by every PyTorch front end); what was not sent
    fades, so the residuals differ from the undecayed rounds'."""
    obs = Observed(job, DECAY["name"], 2)
    assert_rounds(DECAY, obs)
    _, undecayed = reference_rounds(config("sparseloco", "sparseloco"), obs, lambda anchor, update, i: anchor - update)
    assert not np.array_equal(as32(obs.arrays[0]["residual_2_0"]), undecayed[0][0])


def test_sparseloco_blocks_match_the_written_out_rounds_bitwise(job):
    """SparseLoCo's ``blocks=True`` in a real job (the engine hands each group's shapes to the
    method): every round's average and parameters, and the final residuals, bitwise those of the
    written-out rounds whose selection takes each block's largest (4 x 4 blocks of the matrices,
    runs of 16 of the vectors); the flat runs of 16 would have sent other coordinates."""
    obs = Observed(job, BLOCKS["name"], 2)
    assert_rounds(BLOCKS, obs)
    runs = config("sparseloco_runs", "sparseloco",
                  options={k: v for k, v in BLOCKS["options"].items() if k != "blocks"})
    _, by_runs = reference_rounds(runs, obs, lambda anchor, update, i: anchor - update)
    assert not np.array_equal(as32(obs.arrays[0]["residual_2_0"]), by_runs[0][0])


@pytest.mark.parametrize("method", METHODS)
def test_identical_replicas_nothing_lost_and_the_round_statistics(job, method):
    """Every rank starts from rank 0's parameters and holds bitwise the same after every outer
    step; nothing is lost (the averages delivered plus the mean residual are the mean of every
    rank's pseudo-gradients, to within float32's rounding bound); each round's statistics say
    what moved: every group sparse with its target, bytes of values and indices sent."""
    cfg, obs = config(method, method), Observed(job, method, 2)
    start = start_params()
    for r in range(2):
        for i in range(len(SHAPES)):
            np.testing.assert_array_equal(as32(obs.arrays[r][f"start_{i}"]).reshape(-1), start[i])
    rounds = obs.meta[0]["rounds"]
    for j in range(len(rounds)):
        for i in range(len(SHAPES)):
            np.testing.assert_array_equal(obs.arrays[1][f"param_{j}_{i}"], obs.arrays[0][f"param_{j}_{i}"])
    method_options = hso.Compression.create(method, **cfg["options"]).options
    for i in range(len(SHAPES)):
        anchors = [start[i]] + [as32(obs.arrays[0][f"param_{j}_{i}"]).reshape(-1) for j in range(len(rounds) - 1)]
        raw = np.stack([np.stack([(anchors[j] - round_thetas(obs, j)[r][i]).astype(np.float64) for r in range(2)])
                        for j in range(len(rounds))])
        delivered = sum(obs.arrays[0][f"agg_{j}_{i}"] for j in range(len(rounds)))
        final = [obs.arrays[r][f"residual_{len(rounds) - 1}_{i}"] for r in range(2)]
        assert_conserved(delivered, final, raw, "float32", f"{method} parameter {i}")
    for j, entry in enumerate(rounds):
        groups = entry["stats"]["groups"]
        assert [g["name"] for g in groups] == [f"params.{i}" for i in range(len(SHAPES))]
        for g in groups:
            assert not g["dense"] and g["target"] == method_options.count(g["numel"], j), g
        assert sum(g["sent"]["values"] + g["sent"]["indices"] for g in groups) > 0, groups


@pytest.mark.parametrize("name", [c["name"] for c in DILOCO])
def test_diloco_outer_optimizer_by_default(job, name):
    """Without ``outer_optimizer`` the outer step is DiLoCo's Nesterov SGD (lr 0.7, momentum
    0.9) from the anchor, dense (``Compression.none``: plain DiLoCo) or sparse, to within a few
    float32 roundings of the float64 reference; a final :meth:`sync` after a part round closes it
    and leaves identical replicas."""
    cfg = next(c for c in DILOCO if c["name"] == name)
    obs = Observed(job, name, 2)
    assert [r["step"] for r in obs.meta[0]["rounds"]] == [2, 5, 8, STEPS + 1]
    exchanges = dense_average if cfg["method"] == "none" else None
    expected, _ = reference_rounds(cfg, obs, nesterov_reference(), exchanges)
    for j, (_, params) in enumerate(expected):
        for i in range(len(SHAPES)):
            got = [as32(obs.arrays[r][f"param_{j}_{i}"]).reshape(-1) for r in range(2)]
            np.testing.assert_array_equal(got[0], got[1])
            np.testing.assert_allclose(got[0], params[i], rtol=1e-6, atol=1e-6 * float(np.abs(params[i]).max()),
                                       err_msg=f"{name} round {j} parameter {i}")


@pytest.mark.parametrize("name", sorted({c["name"].rsplit("_", 1)[0] for c in RESUME + STREAMED_RESUME}))
def test_exact_resume_mid_round(job, name):
    """Saved one inner step into a round (``torch.save``, or ``torch.distributed.checkpoint``) and
    loaded into a fresh model, inner optimizer and ``OuterSteps`` built from other parameters,
    training goes on bitwise as without the interruption: every round's parameters, averages
    and residuals on both ranks. Overlapped over 2 fragments too, saved with fragment 0's
    exchange in flight (ended by the save; its outer step taken at the next boundary)."""
    whole, resumed = Observed(job, f"{name}_whole", 2), Observed(job, f"{name}_resumed", 2)
    for r in range(2):
        assert sorted(whole.arrays[r]) == sorted(resumed.arrays[r])
        for key, value in whole.arrays[r].items():
            np.testing.assert_array_equal(resumed.arrays[r][key], value, err_msg=f"{name} rank {r} {key}")
        assert [x["step"] for x in whole.meta[r]["rounds"]] == [x["step"] for x in resumed.meta[r]["rounds"]]


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_round_abandoned_everywhere(job, policy):
    """Rank 1's NaN in the second round: the round is abandoned on both ranks (no outer step:
    both back at the round's anchor, bitwise), ``"raise"`` raises ``FloatingPointError`` on
    both at the round's end, every finite pseudo-gradient stays in its residual (nothing lost:
    rank 0's, and rank 1's of the other parameters) and rank 1's residual of the NaN's parameter
    is untouched (the NaN never reaches it); the third round runs normally."""
    obs = Observed(job, f"nan_{policy}", 2)
    for r in range(2):
        rounds = obs.meta[r]["rounds"]
        assert [x["stats"]["abandoned"] for x in rounds] == [False, True, False]
        errors = obs.meta[r]["errors"]
        if policy == "raise":
            assert [e[0] for e in errors] == [2 * EVERY - 1] and "rank(s) [1]" in errors[0][1], errors
        else:
            assert errors == []
        for i in range(len(SHAPES)):
            np.testing.assert_array_equal(obs.arrays[r][f"param_1_{i}"], obs.arrays[r][f"param_0_{i}"])
            np.testing.assert_array_equal(obs.arrays[r][f"param_2_{i}"], obs.arrays[1 - r][f"param_2_{i}"])
            assert np.isfinite(obs.arrays[r][f"residual_2_{i}"]).all()
    for r in range(2):
        for i in range(len(SHAPES)):
            before = obs.arrays[r][f"residual_0_{i}"]
            if (r, i) == (1, 0):  # the NaN
                np.testing.assert_array_equal(obs.arrays[r][f"residual_1_{i}"], before)
                continue
            anchor = as32(obs.arrays[r][f"param_0_{i}"]).reshape(-1)
            kept = as32(before) + (anchor - as32(obs.arrays[r][f"theta_1_{i}"]).reshape(-1))
            np.testing.assert_array_equal(as32(obs.arrays[r][f"residual_1_{i}"]), kept, err_msg=f"rank {r} {i}")


def test_a_configuration_that_differs_between_ranks_raises_everywhere(job):
    """``every`` differs on rank 1: construction raises the same ``ValueError`` on both ranks,
    naming it, before anything trains."""
    obs = Observed(job, "mismatch", 2)
    messages = [obs.meta[r]["errors"] for r in range(2)]
    assert messages[0] == messages[1] and messages[0][0][0] == -1 and "every" in messages[0][0][1], messages


REFUSALS = """
refused(lambda: hso.OuterSteps(model, inner, every=0))
refused(lambda: hso.OuterSteps(model, inner, hs.Compression.topk(density=0.1)))
refused(lambda: hso.OuterSteps(model, inner, outer_optimizer=torch.optim.SGD([model.weight], lr=1.0)))
refused(lambda: hso.OuterSteps(torch.nn.ReLU(), inner))
refused(lambda: hso.OuterSteps(model, inner, every=1, fragments=2))
refused(lambda: hso.OuterSteps(model, inner, every=4, fragments=3))
refused(lambda: hso.OuterSteps(model, inner, overlap="yes"))
refused(lambda: hso.OuterSteps(model, inner, offload=True, outer_optimizer=torch.optim.SGD(model.parameters(), lr=1.0)))
saved = hso.OuterSteps(model, inner, every=3).state_dict()
refused(lambda: hso.OuterSteps(model, inner, every=4).load_state_dict(saved))
refused(lambda: hso.OuterSteps(torch.nn.Linear(4, 3), inner, every=3).load_state_dict(saved))
built = hso.OuterSteps(model, inner, outer_optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
print("factory", [p is q for p, q in zip(built.outer_optimizer.param_groups[0]["params"], model.parameters())])
"""


def test_what_cannot_work_is_refused_with_the_fix():
    """``every`` below 1, a method built for Horovod, an outer optimizer over other parameters, a
    model without parameters, more fragments than ``every`` or than parameters, an ``overlap``
    that is not a bool, an optimizer instance with ``offload`` (it must step the anchor), and a
    state saved with another ``every`` or model are refused, each
    naming the fix; an outer optimizer given as a function is built over the parameters."""
    lines = one_process_lines(REFUSALS, 29533, 11)
    every, horovod, outer, empty, over_every, over_params, overlap, offload, other_every, other_model, factory = lines
    assert "every must be an integer >= 1" in every, every
    assert "horovod_sparse.outer.Compression.topk" in horovod, horovod
    assert "exactly the model's trainable parameters" in outer and "['bias']" in outer, outer
    assert "no trainable parameters" in empty, empty
    assert "fragments=2 needs every >= fragments" in over_every and "fragments <= every=1" in over_every, over_every
    assert "the model has 2" in over_params and "fragments <= 2" in over_params, over_params
    assert "overlap" in overlap and "'yes'" in overlap, overlap
    assert "offload=True" in offload and "outer_optimizer=lambda params" in offload, offload
    assert "every=3" in other_every and "every=4" in other_every, other_every
    assert "checkpoint does not match the model's groups" in other_model, other_model
    assert factory == "factory [True, True]", factory
