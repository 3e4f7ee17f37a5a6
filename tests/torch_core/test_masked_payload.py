"""The primitives of a masked payload (``Sparsifier.masked_exchange``: every rank's whole group,
+0.0 where it selected nothing) against those of the indexed payload they replace, on the same
selections: the sum of the chunks is bitwise the scatter of their (index, value) pairs, and the
union counted from the values is the distinct count of the indices."""
from __future__ import annotations

import pytest
import torch

from horovod_sparse.torch_core.tensor_backend import distinct, masked_union, scatter_chunks, sum_chunks

NUMEL = 1000


def masked_chunks(size: int, dtype: torch.dtype, seed: int):
    """``size`` ranks' masked payloads of a group of :data:`NUMEL` (about a third of each
    selected, at |x| >= 0.5, some coordinates selected by several ranks) and the same selections
    as indices and values."""
    generator = torch.Generator().manual_seed(seed)
    chunks = [torch.randn(NUMEL, generator=generator).to(dtype) for _ in range(size)]
    masked = [torch.where(c.abs() >= 0.5, c, torch.zeros((), dtype=dtype)) for c in chunks]
    indices = [torch.nonzero(m).squeeze(1) for m in masked]
    return masked, indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size, scale", [(1, 1.0), (2, 0.5), (3, 1 / 3)])
def test_the_masked_chunks_sum_is_the_scatter_of_their_pairs_bitwise(size, scale, dtype):
    """Each chunk scaled by the scale in its dtype, then added, in rank order: what ``index_add_``
    with ``alpha`` does to every rank's nonzero rows (a fused multiply-add of a scale such as 1/3
    differs, and so does a bfloat16 product by the float32 scale)."""
    masked, indices = masked_chunks(size, dtype, seed=size)
    summed = sum_chunks(torch.zeros(NUMEL, dtype=dtype), torch.cat(masked), size, scale)
    scattered = scatter_chunks(torch.zeros(NUMEL, dtype=dtype), torch.cat(indices),
                               torch.cat([m[i] for m, i in zip(masked, indices)]), [i.numel() for i in indices],
                               scale)
    assert torch.equal(summed, scattered)
    assert summed.count_nonzero() > 0


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_masked_union_counts_what_any_rank_sent(size):
    masked, indices = masked_chunks(size, torch.float32, seed=10 + size)
    union = masked_union(torch.cat(masked), size)
    assert union.dim() == 0
    assert int(union) == int(distinct(torch.cat(indices), NUMEL)) == len(set(torch.cat(indices).tolist()))
