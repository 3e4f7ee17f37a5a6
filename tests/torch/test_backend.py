"""The scatter-add every allgather method applies its received pairs with, and the union count it
reports, against plain Python. One process, no Horovod."""
import numpy as np
import pytest
import torch

from horovod_sparse.torch.backend import UNION_BY_MARKS, distinct, scatter_chunks


@pytest.mark.parametrize("numel,count,ranks", [(10_000, 20, 2), (10_000, 400, 4), (1_000, 1_000, 3), (64, 1, 1)])
def test_scatter_chunks_adds_every_rank_in_order_and_counts_the_union(numel, count, ranks):
    """Both ways of counting the union (sorting few indices, marking many) against a set, and
    the update against adding the pairs one by one in rank order."""
    rng = np.random.default_rng(numel + count)
    chunks = [rng.choice(numel, count, replace=False) for _ in range(ranks)]
    values = [rng.standard_normal(count).astype(np.float32) for _ in range(ranks)]
    out = torch.zeros(numel)
    indices = torch.from_numpy(np.concatenate(chunks))
    assert scatter_chunks(out, indices, torch.from_numpy(np.concatenate(values)), [count] * ranks, 0.5) is out
    union = distinct(indices, numel)
    assert union == len(set(np.concatenate(chunks).tolist()))
    expected = np.zeros(numel, dtype=np.float32)
    for index_chunk, value_chunk in zip(chunks, values):
        for i, v in zip(index_chunk, value_chunk):
            expected[i] += np.float32(0.5) * v
    np.testing.assert_array_equal(out.numpy(), expected)


def test_both_union_counts_are_exercised():
    assert 2 * 20 * UNION_BY_MARKS < 10_000 <= 4 * 400 * UNION_BY_MARKS
