"""The exact top-k primitive of both frameworks (``horovod_sparse.torch_core.top_k.top_k`` and
``horovod_sparse.tensorflow.selection.top_k``) against a slow independent reference, a stable
NumPy argsort of ``-|x|`` (ties to the lower index), on adversarial inputs: ties, all-equal,
zeros, k at or above the number of non-zeros, heavy tails, infinities, every float dtype, tiny
to whole-buffer k, non-contiguous input; and large enough buffers that the sampled candidate
level, its exact fallback and the chunked search for tied coordinates all run."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from horovod_sparse.common.thresholds import SCAN_CHUNK
from horovod_sparse.torch_core.top_k import DEVICE_TOP_K_BELOW, device_top_k, scanned_top_k, top_k
from tests.support.host_reads import HostReads
from tests.support.reference import topk_indices

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
KINDS = ("normal", "ties", "all_equal", "sparse", "zeros", "heavy_tail", "infinities", "blocky")


def make(kind: str, numel: int, seed: int, dtype: str) -> np.ndarray:
    """``numel`` values of the given kind, as float64 values exactly representable in ``dtype``."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(numel)
    elif kind == "ties":  # few distinct magnitudes, both signs
        x = rng.integers(-3, 4, size=numel).astype(np.float64)
    elif kind == "all_equal":
        x = np.full(numel, -1.5)
    elif kind == "sparse":  # mostly zeros (and negative zeros): k often exceeds the non-zeros
        x = np.where(rng.random(numel) < 0.01, rng.standard_normal(numel), 0.0) * rng.choice([-1.0, 1.0], numel)
    elif kind == "zeros":
        x = -np.zeros(numel) if seed % 2 else np.zeros(numel)
    elif kind == "heavy_tail":
        x = rng.standard_cauchy(numel) * 1e3
    elif kind == "infinities":
        x = rng.standard_normal(numel)
        x[rng.integers(0, numel, size=max(1, numel // 50))] = rng.choice([-np.inf, np.inf])
    else:  # "blocky": the large magnitudes packed into a few runs, ties inside them
        x = rng.standard_normal(numel) * 1e-3
        for start in rng.integers(0, numel, size=4):
            x[start:start + max(1, numel // 20)] = rng.choice([4.0, -4.0, 8.0])
    return torch.from_numpy(x).to(DTYPES[dtype]).double().numpy()


def expected(x: np.ndarray, k: int) -> list:
    """The reference set, ascending."""
    return sorted(topk_indices(x, max(0, k)).tolist())


def torch_top_k(x: np.ndarray, k: int, dtype: str) -> list:
    """``top_k``'s indices, after checking that its block scan (``scanned_top_k``, a CPU buffer's
    path from ``DEVICE_TOP_K_BELOW`` elements) picks the same, whatever the size."""
    tensor = torch.from_numpy(x).to(DTYPES[dtype])
    chosen = top_k(tensor, k).tolist()
    if 0 < k < x.size:
        assert scanned_top_k(tensor, k).tolist() == chosen
    return chosen


K_CHOICES = st.one_of(st.sampled_from(["0", "1", "numel", "above_numel", "nonzeros", "nonzeros+1"]),
                      st.floats(0.0, 1.0))


def resolve(choice, x: np.ndarray) -> int:
    """A k from a choice: a name of a special value, or a fraction of the buffer."""
    nonzeros = int(np.count_nonzero(x))
    named = {"0": 0, "1": 1, "numel": x.size, "above_numel": x.size + 3, "nonzeros": nonzeros,
             "nonzeros+1": min(x.size, nonzeros + 1)}
    return named[choice] if isinstance(choice, str) else int(choice * x.size)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(KINDS), numel=st.integers(1, 3000), choice=K_CHOICES,
       dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**31))
def test_torch_top_k_is_the_stable_sort_prefix(kind, numel, choice, dtype, seed):
    x = make(kind, numel, seed, dtype)
    k = resolve(choice, x)
    assert torch_top_k(x, k, dtype) == expected(x, k)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel,k", [(300_001, 1), (300_001, 37), (300_001, 5_000), (300_001, 30_000),
                                     (300_001, 150_000), (300_001, 299_999)])
def test_torch_top_k_on_large_buffers(kind, numel, k):
    """Here the candidate level comes from a sample of the block maxima (k >= 4096), the buffer
    spans more than one scan chunk and the blocks are smaller than the default (large k)."""
    x = make(kind, numel, numel + k, "float32")
    assert torch_top_k(x, k, "float32") == expected(x, k)


def test_torch_top_k_when_the_sampled_level_is_too_high_or_too_low():
    """Block maxima built so that a strided sample of them misleads: the level falls back to
    the exact k-th largest maximum, and the result is still exact."""
    numel, k = 1 << 21, 8192
    block, stride = 32, 4  # scan_block_size(k / numel); the sample takes every 4th block maximum
    too_high = np.zeros(numel).reshape(-1, block)
    too_high[:, 0] = 1.0
    too_high[:4 * 2400:stride, 0] = 2.0  # more than the sample's share of k, fewer than k in all
    too_low = np.full(numel, 1.0).reshape(-1, block)
    too_low[::stride] = 0.5  # the sampled blocks are smaller: more than 2k maxima exceed the sample
    for x in (too_high.reshape(-1), too_low.reshape(-1)):
        assert torch_top_k(x, k, "float32") == expected(x, k)


def test_ties_at_the_level_are_found_past_the_first_scan_chunk():
    x = np.zeros(3 * SCAN_CHUNK + 5)
    x[-7:] = [1.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    x[SCAN_CHUNK // 2] = 1.0
    for k in range(1, 9):
        assert torch_top_k(x, k, "float32") == expected(x, k)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_non_contiguous_input_indexes_the_flattened_tensor(dtype):
    base = torch.from_numpy(make("ties", 4000, 3, dtype)).to(DTYPES[dtype])
    for view in (base[::3], base.view(40, 100).t(), base.view(40, 100)[:, 7:50]):
        flat = view.reshape(-1).double().numpy()
        for k in (0, 1, 17, 900, view.numel()):
            assert top_k(view, k).tolist() == expected(flat, k)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(KINDS), numel=st.integers(2, 3000), fraction=st.floats(0.0, 1.0),
       dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**31))
def test_device_top_k_is_the_same_set_without_a_host_read(kind, numel, fraction, dtype, seed):
    """The accelerators' path (:func:`device_top_k`, run here on the CPU) selects the reference
    set, ties and infinities included, and reads nothing on the host (:mod:`tests.support.host_reads`),
    where the host path reads several values."""
    x = make(kind, numel, seed, dtype)
    k = min(numel - 1, max(1, int(fraction * numel)))
    tensor = torch.from_numpy(x).to(DTYPES[dtype])
    with HostReads() as reads:
        chosen = device_top_k(tensor, k)
    assert reads.names == [] and chosen.tolist() == expected(x, k)
    with HostReads() as reads:
        scanned_top_k(tensor, k)
    assert reads.count > 0  # the counter sees the host path's reads


@pytest.mark.parametrize("numel", [DEVICE_TOP_K_BELOW - 1, DEVICE_TOP_K_BELOW])
def test_a_cpu_buffer_below_the_bound_takes_the_device_path(numel):
    """Below ``DEVICE_TOP_K_BELOW`` elements a CPU buffer's top-k is ``device_top_k``'s, which
    reads nothing on the host (faster there: ``benchmarks.costs.top_k_paths``); from the bound on,
    the block scan's, which reads."""
    x = make("ties", numel, 5, "float32")
    with HostReads() as reads:
        chosen = top_k(torch.from_numpy(x).float(), numel // 100)
    assert chosen.tolist() == expected(x, numel // 100)
    assert (reads.count == 0) == (numel < DEVICE_TOP_K_BELOW), reads.names


def test_torch_topk_agrees_whenever_its_set_is_unambiguous():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    for k in (1, 100, 5_000):
        assert torch.equal(top_k(x, k), torch.topk(x.abs(), k).indices.sort().values)


# -- TensorFlow: the same sets --------------------------------------------------------------------
@settings(max_examples=120, deadline=None)
@given(kind=st.sampled_from(KINDS), numel=st.integers(1, 2000), choice=K_CHOICES,
       dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**31))
def test_tensorflow_top_k_is_the_same_set_as_torch_and_the_reference(kind, numel, choice, dtype, seed):
    tf = pytest.importorskip("tensorflow")
    from horovod_sparse.tensorflow.selection import top_k as tf_top_k
    x = make(kind, numel, seed, dtype)
    k = resolve(choice, x)
    found = tf_top_k(tf.cast(tf.constant(x), getattr(tf, dtype)), k)
    assert found.dtype == tf.int64
    assert found.numpy().tolist() == expected(x, k) == torch_top_k(x, k, dtype)


def test_tensorflow_top_k_traced_with_a_tensor_k():
    tf = pytest.importorskip("tensorflow")
    from horovod_sparse.tensorflow.selection import top_k as tf_top_k
    traced = tf.function(tf_top_k, input_signature=[tf.TensorSpec([None, None], tf.float32),
                                                    tf.TensorSpec([], tf.int32)])
    x = make("ties", 600, 5, "float32")
    for k in (0, 1, 250, 600, 601):
        assert traced(tf.constant(x.reshape(20, 30), tf.float32), k).numpy().tolist() == expected(x, k)


# -- TensorFlow's block path (2k <= numel): block maxima, a level, the blocks that reach it, the tail --
def tf_top_k(x: np.ndarray, k, dtype: str = "float32", traced: bool = False) -> list:
    """``horovod_sparse.tensorflow.selection.top_k`` of ``x`` cast to ``dtype``, eager or inside a
    ``tf.function`` of any length with a tensor ``k``."""
    tf = pytest.importorskip("tensorflow")
    from horovod_sparse.tensorflow.selection import top_k as tf_top_k_
    tensor = tf.cast(tf.constant(x), getattr(tf, dtype))
    if traced:
        run = tf.function(tf_top_k_, input_signature=[tf.TensorSpec([None], tensor.dtype), tf.TensorSpec([], tf.int32)])
        found = run(tensor, tf.constant(k, tf.int32))
    else:
        found = tf_top_k_(tensor, k)
    assert found.dtype == tf.int64
    return found.numpy().tolist()


def tf_block_length(numel: int, k: int) -> int:
    tf = pytest.importorskip("tensorflow")
    from horovod_sparse.tensorflow.selection import _block_length
    return int(_block_length(tf.constant(numel, tf.int64), tf.constant(k, tf.int64)))


def test_tensorflow_blocks_are_as_long_as_torchs():
    from horovod_sparse.common.thresholds import scan_block_size
    for numel, k in [(2, 1), (1000, 1), (1000, 500), (300_001, 37), (300_001, 5_000), (25_600_000, 25_600),
                     (25_600_000, 1), (1 << 20, 1 << 14), (1 << 20, 1 << 13), (999_999, 7_777)]:
        assert tf_block_length(numel, k) == min(scan_block_size(k / numel), numel // k), (numel, k)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel,k", [(300_001, 1), (300_001, 37), (300_001, 5_000), (300_001, 30_000),
                                     (300_001, 150_000), (262_144, 4_096)])
def test_tensorflow_top_k_on_large_buffers(kind, numel, k):
    """The block path with a partial tail (300,001 is odd) and without one, several scan chunks,
    a sampled level (k >= 4096) and the exact one (small k)."""
    x = make(kind, numel, numel + k, "float32")
    assert tf_top_k(x, k) == expected(x, k)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", ("normal", "ties", "heavy_tail", "blocky"))
def test_tensorflow_top_k_on_large_buffers_in_every_dtype(kind, dtype):
    x = make(kind, 200_003, 11, dtype)
    for k in (1, 600, 9_000):
        assert tf_top_k(x, k, dtype) == expected(x, k)


def test_tensorflow_ties_at_the_level_spread_over_many_blocks():
    """More blocks reach the level than k, every one of them at exactly the level, several tied
    coordinates in some of them: the lowest indices among the tied ones win, across blocks."""
    numel, k = (1 << 16) + 5, 100
    block = tf_block_length(numel, k)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1e-3, 1e-3, numel)
    blocks = rng.choice(numel // block, 300, replace=False)
    x[blocks * block + rng.integers(0, block, 300)] = rng.choice([-1.0, 1.0], 300)  # ties at the level
    x[blocks[:30] * block] = 1.0  # a second tie in some blocks, at their first coordinate
    x[rng.choice(numel, 40, replace=False)] = 2.0  # some above it
    x[-2] = 1.0  # and one in the tail
    for kk in (1, 39, 40, 41, 100, 330, 341, 342):
        assert tf_top_k(x, kk) == expected(x, kk), kk


def test_tensorflow_answer_in_the_partial_tail_block():
    """The largest magnitudes, or ties with the level, sit in the tail that no full block covers."""
    numel, k = (1 << 16) + 17, 5
    block = tf_block_length(numel, k)
    assert numel % block == 17
    x = np.random.default_rng(1).uniform(-1e-3, 1e-3, numel)
    x[-17:-10] = [-3.0, 4.0, 1.0, 1.0, 2.0, 4.0, 1.0]
    x[[100, 5000]] = 1.0  # ties with the tail's 1.0, at lower indices
    for kk in range(1, 12):
        assert tf_top_k(x, kk) == expected(x, kk), kk
        assert tf_top_k(x, kk, traced=True) == expected(x, kk), kk


def test_tensorflow_top_k_traced_with_a_tensor_k_on_large_buffers():
    for kind in ("normal", "ties", "zeros", "blocky"):
        x = make(kind, 100_003, 4, "float32")
        for k in (0, 1, 2_000, 50_001, 50_002, 100_003, 100_004):
            assert tf_top_k(x, k, traced=True) == expected(x, k), (kind, k)


def test_tensorflow_top_k_when_the_sampled_level_is_too_high_or_too_low():
    """The estimate from a strided sample of the block maxima is reached by fewer than k maxima
    (too high) or by more than 2k (too low): the level is then the exact k-th largest maximum."""
    numel, k = 1 << 21, 8192
    block, stride = 32, 4
    assert tf_block_length(numel, k) == block
    too_high = np.zeros(numel).reshape(-1, block)
    too_high[:, 0] = 1.0
    too_high[:4 * 2400:stride, 0] = 2.0
    too_low = np.full(numel, 1.0).reshape(-1, block)
    too_low[::stride] = 0.5
    too_low[1::stride, 3] = 0.75
    for x in (too_high.reshape(-1), too_low.reshape(-1)):
        assert tf_top_k(x, k) == expected(x, k)
