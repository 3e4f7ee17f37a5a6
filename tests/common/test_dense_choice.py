"""``dense=``: which parameters a front end keeps dense (horovod_sparse.common.dense_choice)."""
import pytest

from horovod_sparse.common.dense_choice import chosen_dense

NAMES = ["embed.weight", "block.0.attn.weight", "block.0.norm.weight", "block.0.norm.bias", "head.weight", "head.bias"]


def test_names_patterns_and_predicates_choose_whole_names():
    assert chosen_dense(None, NAMES) == frozenset()
    assert chosen_dense("head.bias", NAMES) == {"head.bias"}
    assert chosen_dense(["*.bias", "embed.*"], NAMES) == {"block.0.norm.bias", "head.bias", "embed.weight"}
    assert chosen_dense(("*norm*",), NAMES) == {"block.0.norm.weight", "block.0.norm.bias"}
    assert chosen_dense(lambda name: name.startswith("head"), NAMES) == {"head.weight", "head.bias"}
    assert chosen_dense("bias", ["bias", "head.bias"]) == {"bias"}  # whole names, not substrings


@pytest.mark.parametrize("spec,near", [
    ("head.bais", ["'head.bias'"]),
    (["*.bias", "nrom.*"], ["'block.0.norm.weight'"]),
    ("bias", ["'block.0.norm.bias'", "'head.bias'"]),
])
def test_a_name_matching_nothing_names_the_near_misses(spec, near):
    with pytest.raises(ValueError, match="matches no parameter") as error:
        chosen_dense(spec, NAMES)
    for name in near:
        assert name in str(error.value)


def test_a_name_far_from_every_parameter_says_so_without_guesses():
    with pytest.raises(ValueError, match=r"dense='zzz' matches no variable of the 6 exchanged \(names"):
        chosen_dense("zzz", NAMES, "variable")


def test_a_predicate_choosing_nothing_is_refused():
    with pytest.raises(ValueError, match="chose no parameter"):
        chosen_dense(lambda name: False, NAMES)


@pytest.mark.parametrize("spec", [3, [1, "head.bias"], {"head.bias"}])
def test_other_kinds_are_refused(spec):
    with pytest.raises(TypeError, match="dense= takes a name or pattern"):
        chosen_dense(spec, NAMES)
