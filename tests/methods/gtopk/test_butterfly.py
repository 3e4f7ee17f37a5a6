"""Properties of the gTop-k reduction schedule (fold-in, recursive doubling, fold-out) for
n = 1..64, and gTop-k's options; framework-free, one process."""
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

import horovod_sparse.methods  # noqa: F401  (fills the registry)
from horovod_sparse.common import registry
from horovod_sparse.methods.gtopk.butterfly import butterfly_schedule, largest_power_of_two, round_count

SIZES = st.integers(min_value=1, max_value=64)


def run_schedule(n):
    """Play the schedule with a commutative but non-associative merge that records the merge
    tree: ``merge(a, b) = frozenset({a, b})``. Returns what every rank holds at the end."""
    held = list(range(n))
    for phase in butterfly_schedule(n):
        sent = {phase.send_to[r]: held[r] for r in range(n) if phase.send_to[r] is not None}
        for r, source in enumerate(phase.receive_from):
            if source is not None:
                held[r] = sent[r] if phase.adopt else frozenset({held[r], sent[r]})
    return held


def leaves(tree):
    return Counter([tree]) if isinstance(tree, int) else sum((leaves(t) for t in tree), Counter())


@given(SIZES)
def test_every_phase_pairs_senders_and_receivers_consistently(n):
    for phase in butterfly_schedule(n):
        for r, target in enumerate(phase.send_to):
            if target is not None:
                assert phase.receive_from[target] == r, (n, phase.name, r)
        for r, source in enumerate(phase.receive_from):
            if source is not None:
                assert phase.send_to[source] == r, (n, phase.name, r)


@given(SIZES)
def test_rounds_are_symmetric_exchanges_among_the_largest_power_of_two(n):
    p = largest_power_of_two(n)
    rounds = [phase for phase in butterfly_schedule(n) if phase.is_round]
    assert len(rounds) == round_count(n) == p.bit_length() - 1
    for phase in rounds:
        assert phase.send_to == phase.receive_from
        for r, partner in enumerate(phase.send_to):
            if r < p:
                assert partner is not None and partner != r and partner < p and phase.send_to[partner] == r
            else:
                assert partner is None


@given(SIZES)
def test_every_rank_ends_holding_the_same_result_of_all_inputs_once(n):
    held = run_schedule(n)
    assert all(h == held[0] for h in held), "ranks end with different results"
    assert leaves(held[0]) == Counter(range(n)), "an input is missing or counted twice"


@given(SIZES)
def test_folds_exist_only_when_n_is_not_a_power_of_two(n):
    names = [phase.name for phase in butterfly_schedule(n)]
    folded = n != largest_power_of_two(n)
    assert names == ["fold-in"] * folded + [f"round{j}" for j in range(round_count(n))] + ["fold-out"] * folded
    for phase in butterfly_schedule(n):
        senders = sum(target is not None for target in phase.send_to)
        assert senders == (n - largest_power_of_two(n) if not phase.is_round else largest_power_of_two(n))


@pytest.mark.parametrize("n,p,rounds", [(1, 1, 0), (2, 2, 1), (3, 2, 1), (5, 4, 2), (6, 4, 2), (8, 8, 3),
                                         (64, 64, 6)])
def test_sizes(n, p, rounds):
    assert largest_power_of_two(n) == p and round_count(n) == rounds


def test_six_ranks_schedule_spelled_out():
    fold_in, round0, round1, fold_out = butterfly_schedule(6)
    assert fold_in.send_to == (None, None, None, None, 0, 1)
    assert round0.send_to == (1, 0, 3, 2, None, None)
    assert round1.send_to == (2, 3, 0, 1, None, None)
    assert fold_out.send_to == (4, 5, None, None, None, None) and fold_out.adopt


def test_size_below_one_is_refused():
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        butterfly_schedule(0)


# -- options --------------------------------------------------------------------------------------
def test_gtopk_options_defaults_and_spec():
    name, options = registry.parse_spec("gtopk:density=0.001,residual=paper,recall_every=10")
    made = registry.make_options(name, **options)
    assert (made.residual, made.recall_every, made.density) == ("paper", 10, 0.001)
    assert registry.make_options("gtopk").residual == "exact"


@pytest.mark.parametrize("option,value,error,match", [
    ("residual", "lossy", ValueError, "residual must be one of 'exact', 'paper'"),
    ("recall_every", -1, ValueError, "recall_every must be an integer >= 0"),
    ("recall_every", 1.5, TypeError, "recall_every"),
    ("fp16_values", True, ValueError, "fp16_values=True is not supported by gtopk"),
])
def test_gtopk_bad_options_are_refused(option, value, error, match):
    with pytest.raises(error, match=match):
        registry.make_options("gtopk", **{option: value})
