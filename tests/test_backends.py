"""The selections the two frameworks used to make differently, now one method's code on two
backends: each run on PyTorch's and TensorFlow's backend on the inputs where the old halves
differed (many tied magnitudes, Gaussian-k's corrections, the hard threshold's scan), against a
plain NumPy reference written here; and the histogram controller's candidates, one class on both
backends. One process, no Horovod."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf
import torch

from horovod_sparse.methods.gtopk.butterfly import SparseSet
from horovod_sparse.common.thresholds import as_float32
from horovod_sparse.common.threshold_baselines import gaussian_threshold
from horovod_sparse.methods.backend import PAD
from horovod_sparse.methods.gaussiank import gaussiank_select
from horovod_sparse.methods.micro.candidates import Candidates
from horovod_sparse.methods.gtopk.exchange import merge
from horovod_sparse.tensorflow import backend as tf_backend
from horovod_sparse.torch import backend as torch_backend
from horovod_sparse.torch_core.selection import accelerator_paths
from tests.reference_gtopk import merge_sets

BACKENDS = {"torch": (torch_backend, torch.from_numpy), "tensorflow": (tf_backend, tf.constant)}
#: The framework's backends and whether PyTorch's run on its accelerators' paths (on the CPU).
PATHS = [("torch", False), ("torch", True), ("tensorflow", False)]


def tied(numel: int, seed: int) -> np.ndarray:
    """Few distinct magnitudes of both signs: most coordinates tie with many others."""
    return np.random.default_rng(seed).integers(-3, 4, size=numel).astype(np.float32) / 4


def reference_gaussiank(x: np.ndarray, k: int, density: float):
    """Gaussian-k from its definition: mean and unbiased deviation in float64, ``|x| >= t``,
    then the corrections, each re-selecting from the whole buffer."""
    threshold = gaussian_threshold(float(x.mean(dtype=np.float64)), float(x.std(dtype=np.float64, ddof=1)), density)
    selected = np.flatnonzero(np.abs(x) >= as_float32(threshold))
    for _ in range(3):
        if 3 * len(selected) < 2 * k:
            threshold *= 0.5
        elif 3 * len(selected) > 4 * k:
            threshold *= 1.5
        else:
            break
        selected = np.flatnonzero(np.abs(x) >= as_float32(threshold))
    return selected, as_float32(threshold)


@pytest.mark.parametrize("framework,accelerated", PATHS)
@pytest.mark.parametrize("kind,seed", [("normal", 0), ("normal", 1), ("tied", 2), ("tied", 3)])
@pytest.mark.parametrize("capacity", [50_000, 700, 400])
def test_gaussiank_selects_as_its_definition_on_both_backends(framework, accelerated, kind, seed, capacity):
    """Tied inputs make the count jump across the correction bounds, so the corrections run; on
    the accelerators' paths the corrections are decided on the device. A capacity below the
    count sends the lowest indices (padded on the accelerators' paths) and counts the rest."""
    B, tensor = BACKENDS[framework]
    x = tied(50_000, seed) if kind == "tied" else np.random.default_rng(seed).standard_normal(50_000).astype(np.float32)
    k, density = 500, 0.01
    with accelerator_paths() if accelerated else contextlib.nullcontext():
        capped, threshold = gaussiank_select(B, tensor(x), k, density, capacity)
    expected, expected_threshold = reference_gaussiank(x, k, density)
    idx = B.to_numpy(capped.idx)
    assert capped.padded == accelerated and len(idx) == (capacity if accelerated else min(capacity, len(expected)))
    np.testing.assert_array_equal(idx[:len(expected)], expected[:capacity])
    assert (idx[len(expected):] == PAD).all()
    assert (int(capped.sent), int(capped.overflow)) == (min(capacity, len(expected)), max(0, len(expected) - capacity))
    assert float(threshold) == pytest.approx(expected_threshold, rel=1e-5)


@pytest.mark.parametrize("framework", BACKENDS)
@pytest.mark.parametrize("threshold", [0.25, 0.5, 0.75, 1.0])
def test_the_hard_threshold_scan_selects_every_coordinate_at_or_above_it(framework, threshold):
    """Thresholds exactly at the tied magnitudes (``>=``, not ``>``), with a partial last block."""
    B, tensor = BACKENDS[framework]
    x = tied(40_003, 4)
    idx = B.select(tensor(x), threshold, 1024)
    np.testing.assert_array_equal(B.to_numpy(idx), np.flatnonzero(np.abs(x) >= threshold))


@pytest.mark.parametrize("framework,accelerated", PATHS)
@pytest.mark.parametrize("seed", range(4))
def test_gtopk_merge_breaks_magnitude_ties_to_the_lower_index_on_both_backends(framework, accelerated, seed):
    """Two sets of tied values sharing some indices (among them -0.0 and index 0): the sum, then
    the k largest, ties to the lower index, as the reference merge, bitwise; and which of the
    first set's indices the merge kept (``isin``). PyTorch's accelerators' paths (a coalesce
    padded to a fixed size, a binary-search ``isin``) too."""

    B, tensor = BACKENDS[framework]
    rng = np.random.default_rng(seed)
    k = 40
    sets = []
    for _ in range(2):
        indices = np.sort(np.concatenate([[0], rng.choice(np.arange(1, 120), k - 1, replace=False)])).astype(np.int64)
        values = rng.integers(-2, 3, size=k).astype(np.float32)
        values[values == 0] = np.where(rng.random(int((values == 0).sum())) < 0.5, -0.0, 0.0)
        sets.append((indices, values))
    with accelerator_paths() if accelerated else contextlib.nullcontext():
        a, b = (SparseSet(tensor(i), tensor(v)) for i, v in sets)
        merged = merge(B, a, b, k)
        kept = B.to_numpy(B.isin(a.idx, merged.idx))
    expected = merge_sets(*[{int(i): (v, frozenset()) for i, v in zip(*s)} for s in sets], k)
    np.testing.assert_array_equal(B.to_numpy(merged.idx), sorted(expected))
    np.testing.assert_array_equal(B.to_numpy(merged.val).view(np.int32),
                                  np.array([expected[i][0] for i in sorted(expected)], dtype=np.float32).view(np.int32))
    np.testing.assert_array_equal(kept, np.isin(sets[0][0], sorted(expected)))


@pytest.mark.parametrize("framework,dtype", [("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"),
                                             ("tensorflow", "float32"), ("tensorflow", "float16")])
@pytest.mark.parametrize("budget", [1, 7, 40])
def test_candidates_filter_to_exactly_the_pick_on_both_backends(framework, dtype, budget):
    """The histogram controller's candidates (MiCRO, ExDyna) of a slice with a partial last
    block and many tied magnitudes: every coordinate at or above the bar, with its magnitude
    (float32 on the host, bfloat16 included), and for thresholds below, at and above the bar
    and at the tied magnitudes exactly the slice's ``|x| >= threshold``, as a pick selects."""
    B, tensor = BACKENDS[framework]
    x = tied(20_011, 6) * np.random.default_rng(7).choice([1.0, 0.5, 0.125], 20_011).astype(np.float32)
    start, end = 301, 19_950
    if framework == "torch":
        buffer = torch.from_numpy(x).to(getattr(torch, dtype))
        magnitudes = buffer.abs().float().numpy()
    else:
        buffer = tf.cast(tf.constant(x), dtype)
        magnitudes = np.abs(buffer.numpy()).astype(np.float32)
    scanned = B.scan(buffer, start, end, 64)
    candidates = Candidates.collect(B, scanned, budget)
    positions = np.arange(start, end)
    expected = positions[magnitudes[start:end] >= candidates.bar]
    np.testing.assert_array_equal(B.to_numpy(candidates.indices), expected)
    np.testing.assert_array_equal(B.to_numpy(candidates.magnitudes).astype(np.float32), magnitudes[expected])
    for threshold in (candidates.bar / 2, candidates.bar, candidates.bar * 1.5, 0.375, 0.75):
        for filterable in ([True, False] if threshold >= candidates.bar else [False]):
            selected = B.to_numpy(candidates.select(threshold, filterable))
            np.testing.assert_array_equal(selected, positions[magnitudes[start:end] >= threshold],
                                          err_msg=f"{threshold} {filterable}")
            np.testing.assert_array_equal(selected, B.to_numpy(B.pick(scanned, threshold)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("budget", [1, 40, 10_000])
def test_the_accelerators_bar_and_histogram_equal_the_hosts(dtype, budget):
    """PyTorch's accelerator paths (a bar and a histogram computed on the device, read by no one)
    give bitwise the host's NumPy results: the candidates' bar, the local histogram in the first
    step's window and in a fine one around a threshold (every rank's mark), DGC's threshold and
    its lowered retry. Run on CPU tensors through ``accelerator_paths``."""
    from horovod_sparse.methods.micro.controllers import HistogramWindow
    from horovod_sparse.torch_core.selection import accelerator_paths

    B = torch_backend
    x = tied(20_011, 3) * np.random.default_rng(8).standard_normal(20_011).astype(np.float32)
    buffer = torch.from_numpy(x).to(getattr(torch, dtype))
    scanned = B.scan(buffer, 301, 19_950, 64)
    host_bar = B.candidate_bar(scanned, budget)
    host = Candidates.collect(B, scanned, budget)
    with accelerator_paths():
        device_bar = B.candidate_bar(scanned, budget)
        device = Candidates.collect(B, scanned, budget)
    assert isinstance(host_bar, float)
    assert float(device_bar) == host_bar and torch.equal(device.indices, host.indices)
    for window in (HistogramWindow.everything(), HistogramWindow.around(0.3)):
        for rank, parts in ((0, 1), (2, 4)):
            expected = host.local_histogram(window, rank, parts)
            with accelerator_paths():
                computed = device.local_histogram(window, rank, parts)
            assert computed.dtype == expected.dtype == torch.int32 and torch.equal(computed, expected)
            assert int(expected[len(window) + 1 + rank]) == window.edge_at_or_above(host_bar)
    with accelerator_paths():
        threshold = B.kth_magnitude(buffer[::7], 30)
        lowered = B.scaled_threshold(threshold, 0.8)
    assert isinstance(threshold, torch.Tensor) and float(threshold) == B.kth_magnitude(buffer[::7], 30)
    assert float(lowered) == B.scaled_threshold(B.kth_magnitude(buffer[::7], 30), 0.8)
