"""Partition tables of MiCRO/ExDyna and ExDyna's balancers: framework-free, one process."""
import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import horovod_sparse.methods  # noqa: F401  (fills the registry)
from horovod_sparse.common import registry
from horovod_sparse.methods.micro.state import BlockPartitions, EqualPartitions, make_partitions
from horovod_sparse.methods.micro.partitions import (BlockLayout, allgather_padding, counts_by_partition, equal_bounds,
                                              load_inc, owned_partition, pairwise_rebalance, prefix_rebalance)

sizes = st.integers(1, 10 ** 7)
parts = st.integers(1, 64)


def assert_partition_of_range(bounds, numel, count):
    """Disjoint contiguous pieces covering [0, numel), in order."""
    assert len(bounds) == count + 1 and bounds[0] == 0 and bounds[-1] == numel
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))


@given(sizes, parts)
def test_equal_partitions_cover_the_buffer(numel, n):
    bounds = equal_bounds(numel, n)
    assert_partition_of_range(bounds, numel, n)
    lengths = np.diff(bounds)
    assert lengths.max() - lengths.min() <= 1
    assert list(lengths) == sorted(lengths, reverse=True)  # the first numel mod n are longer


@given(parts, st.integers(0, 10 ** 6))
def test_ownership_is_exclusive_and_rotates(n, step):
    owned = [owned_partition(step, r, n) for r in range(n)]
    assert sorted(owned) == list(range(n))
    assert [owned_partition(step + 1, r, n) for r in range(n)] == [(p + 1) % n for p in owned]
    counts = list(range(10, 10 + n))
    by_partition = counts_by_partition(counts, step)
    assert [by_partition[owned_partition(step, r, n)] for r in range(n)] == counts


@given(sizes, st.integers(1, 4096))
def test_block_layout(numel, num_blocks):
    layout = BlockLayout.for_buffer(numel, num_blocks)
    assert 1 <= layout.num_blocks <= num_blocks and layout.block_size >= 1 and layout.remainder >= 0
    if numel // num_blocks >= 32:  # the paper's case: exactly num_blocks blocks of a multiple of 32
        assert layout.num_blocks == num_blocks and layout.block_size % 32 == 0
        assert layout.block_size == numel // num_blocks - (numel // num_blocks) % 32
    elif numel < num_blocks:
        assert layout.block_size == 1 and layout.num_blocks == numel and layout.remainder == 0


def test_paper_layout_of_resnet50_size():
    layout = BlockLayout.for_buffer(25_557_032)
    assert (layout.num_blocks, layout.block_size, layout.remainder) == (1024, 24928, 30_760)
    assert layout.initial_blocks(3) == [342, 341, 341]
    assert layout.min_blocks(4) == 64.0


@st.composite
def layouts_and_tables(draw):
    """A block layout and any table of blocks per partition (a composition of num_blocks)."""
    layout = BlockLayout.for_buffer(draw(sizes), draw(st.integers(1, 1024)))
    n = draw(parts)
    cuts = sorted(draw(st.lists(st.integers(0, layout.num_blocks), min_size=n - 1, max_size=n - 1)))
    edges = [0, *cuts, layout.num_blocks]
    return layout, [b - a for a, b in zip(edges, edges[1:])]


@given(layouts_and_tables())
def test_block_partitions_cover_the_buffer(case):
    layout, blocks = case
    bounds = layout.bounds(blocks)
    assert_partition_of_range(bounds, layout.numel, len(blocks))
    assert bounds[-1] - bounds[-2] == blocks[-1] * layout.block_size + layout.remainder
    assert all(bounds[p + 1] - bounds[p] == blocks[p] * layout.block_size for p in range(len(blocks) - 1))


def test_load_inc_and_padding():
    assert load_inc([25, 25, 25, 25]) == 0.0
    assert load_inc([40, 20, 20, 20]) == pytest.approx(0.6)
    assert load_inc([0, 0]) == 0.0
    assert allgather_padding([40, 20, 20, 20]) == 60


LAYOUT = BlockLayout(numel=1024 * 64, num_blocks=1024, block_size=64)


def test_pairwise_rule_moves_one_block_from_heavy_to_light():
    # k_prev = 400, k_acc = 100: 150 > 105 and 50 < 95.2, so one block moves right
    assert pairwise_rebalance([256, 256, 256, 256], [150, 50, 100, 100], 400, LAYOUT, 64) == [255, 257, 256, 256]
    assert pairwise_rebalance([256, 256, 256, 256], [50, 150, 100, 100], 400, LAYOUT, 64) == [257, 255, 256, 256]


def test_pairwise_rule_updates_the_estimate_before_the_next_pair():
    """One block carries int(10 * 4000 / 10240) = 3 coordinates: after the first move partition 1
    holds 953 (0.953 k_acc), inside the band, so partition 2 keeps its blocks (with the counts
    as gathered, 950 < k_acc / 1.05 would have taken one)."""
    layout = BlockLayout(numel=10240, num_blocks=1024, block_size=10)
    assert pairwise_rebalance([256] * 4, [1100, 950, 1080, 1000], 4000, layout, 64) == [255, 257, 256, 256]
    assert pairwise_rebalance([256] * 4, [1000, 950, 1080, 1000], 4000, layout, 64) == [256, 257, 255, 256]


def test_pairwise_rule_keeps_the_minimum_and_guards_small_counts():
    assert pairwise_rebalance([64, 448, 256, 256], [50, 150, 100, 100], 400, LAYOUT, 64) == [65, 447, 256, 256]
    assert pairwise_rebalance([64, 448, 256, 256], [150, 50, 100, 100], 400, LAYOUT, 64) == [64, 448, 256, 256]
    # k_prev < n: k_acc = 0 would divide by zero in the reference; nothing moves
    assert pairwise_rebalance([256] * 4, [3, 0, 0, 0], 3, LAYOUT, 64) == [256] * 4


def test_pairwise_rule_stalls_where_the_prefix_rule_does_not():
    """Heavy, within band, light: no pair qualifies, so the pairwise rule never moves; the prefix
    rule passes the excess along (boundary 1 and boundary 2 both move toward the light end)."""
    blocks, counts = [256, 256, 256, 256], [180, 100, 20, 100]
    assert pairwise_rebalance(blocks, counts, 400, LAYOUT, 64) == blocks
    assert prefix_rebalance(blocks, counts, 64) == [255, 256, 257, 256]


def test_prefix_rule_band_minimum_and_guard():
    assert prefix_rebalance([256] * 4, [104, 100, 96, 100], 64) == [256] * 4  # within 5% of a share
    assert prefix_rebalance([256] * 4, [110, 100, 90, 100], 64) == [255, 256, 257, 256]
    assert prefix_rebalance([64, 448, 256, 256], [150, 50, 100, 100], 64) == [64, 448, 256, 256]
    assert prefix_rebalance([64, 448, 256, 256], [50, 150, 100, 100], 64) == [65, 447, 256, 256]
    assert prefix_rebalance([256] * 4, [3, 0, 0, 0], 64) == [256] * 4  # fewer selected than partitions


@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 12), st.integers(1, 2000))
def test_both_rules_move_each_boundary_at_most_one_block_and_keep_the_minimum(seed, n, num_blocks):
    rng = np.random.default_rng(seed)
    layout = BlockLayout.for_buffer(num_blocks * 64, num_blocks)
    least = layout.min_blocks(n)
    blocks = layout.initial_blocks(n)
    for _ in range(20):
        counts = (rng.exponential(100.0, n) * (rng.random(n) < 0.8)).astype(int).tolist()
        for moved in (prefix_rebalance(blocks, counts, least),
                      pairwise_rebalance(blocks, counts, sum(counts), layout, least)):
            assert sum(moved) == num_blocks
            assert np.all(np.abs(np.cumsum(moved) - np.cumsum(blocks)) <= 1)
            assert all(m >= least or m >= b for m, b in zip(moved, blocks))
        blocks = prefix_rebalance(blocks, counts, least)


def test_prefix_rule_balances_a_persistent_imbalance():
    """Partition loads proportional to a fixed density per block: the table converges."""
    density = np.concatenate([np.full(100, 5.0), np.full(824, 1.0), np.full(100, 3.0)])
    blocks = BlockLayout.for_buffer(1024 * 32).initial_blocks(4)
    for _ in range(400):
        cuts = np.concatenate([[0], np.cumsum(blocks)])
        counts = [int(density[cuts[p]:cuts[p + 1]].sum()) for p in range(4)]
        blocks = prefix_rebalance(blocks, counts, 64)
    assert load_inc(counts) < 0.08 < load_inc([int(density[p * 256:(p + 1) * 256].sum()) for p in range(4)])


def _run_observations(partitions, numel, n, steps, seed):
    rng = np.random.default_rng(seed)
    state = partitions.new_state(numel, n)
    for step in range(steps):
        assert_partition_of_range(partitions.bounds(state), numel, n)
        partitions.observe(state, step, rng.integers(0, 50, n).tolist())
    return state


@pytest.mark.parametrize("balancer", ["prefix", "paper"])
@pytest.mark.parametrize("numel,n", [(100_000, 4), (3, 5), (1, 1), (5000, 3)])
def test_exdyna_tables_stay_valid_and_state_is_plain_data(balancer, numel, n):
    partitions = BlockPartitions(1024, balancer)
    state = _run_observations(partitions, numel, n, 12, seed=numel)
    assert sum(state.blocks) == partitions.layout(state).num_blocks
    restored = json.loads(json.dumps(dataclasses.asdict(state)))
    assert restored["blocks"] == state.blocks and restored["threshold"]["steps"] == 0


def test_micro_table_is_fixed():
    partitions = EqualPartitions()
    state = _run_observations(partitions, 10_001, 3, 5, seed=0)
    assert partitions.bounds(state) == equal_bounds(10_001, 3)


def test_options_pick_the_table_and_are_validated():
    assert type(make_partitions(registry.make_options("micro"))) is EqualPartitions
    partitions = make_partitions(registry.make_options("exdyna", balancer="paper", num_blocks=16))
    assert isinstance(partitions, BlockPartitions) and partitions.num_blocks == 16
    with pytest.raises(ValueError, match="balancer must be one of 'prefix', 'paper'"):
        registry.make_options("exdyna", balancer="pairs")
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 1"):
        registry.make_options("exdyna", num_blocks=0)
    with pytest.raises(ValueError, match="controller must be one of"):
        registry.make_options("micro", controller="fast")
