"""SparseLoCo's selection in one process: its options' checks, its count, chunk by chunk, its
selection and quantizer on both backends against the slow reference (bitwise), the packing of its
codes, and whole exchanges of several ranks on a loopback communicator (PyTorch's real
communicator class, its collectives replaced by concatenation): the update and the residuals
against the reference, the bytes on the wire, and error feedback (nothing lost). No Horovod job;
the multi-process matrices run it through every front end."""
from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf
import torch

from benchmarks.costs.exchange_cost import DispatchedOps
from horovod_sparse.common import registry
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.engine.step import StepEngine
from horovod_sparse.engine.topology import Transport
from horovod_sparse.methods.sparseloco import chunk_counts, offset_width, quantize
from horovod_sparse.tensorflow import backend as tf_backend
from horovod_sparse.torch import backend as torch_backend
from horovod_sparse.torch_core.communicator import TorchCommunicator, nbytes
from horovod_sparse.torch_core import chunked
from horovod_sparse.torch_core.selection import accelerator_paths
from tests.support import reference_sparseloco as R

BACKENDS = {"torch": (torch_backend, torch.from_numpy), "tensorflow": (tf_backend, tf.constant)}


@pytest.mark.parametrize("option,value,error,says", [
    ("chunk_size", 0, ValueError, "chunk_size must be an integer >= 1"),
    ("chunk_size", 64.0, TypeError, "chunk_size must be an integer"),
    ("bits", 3, ValueError, "bits must be one of 1, 2, 4, 8"),
    ("bits", True, ValueError, "bits must be one of"),
    ("bits", 2.0, ValueError, "bits must be one of"),
    ("quantization_range", 0.0, ValueError, "quantization_range must be a finite number > 0"),
    ("quantization_range", -6.0, ValueError, "quantization_range"),
    ("density_schedule", "piecewise:0.1@3", ValueError, "give density_schedule=None"),
    ("error_decay", 0.0, ValueError, r"error_decay must be a number in \(0, 1\].*error_decay=0.95"),
    ("error_decay", 1.5, ValueError, "error_decay must be a number in"),
    ("error_decay", float("nan"), ValueError, "error_decay must be a number in"),
    ("error_decay", True, ValueError, "error_decay must be a number in"),
    ("blocks", 1, TypeError, "blocks must be True or False"),
])
def test_bad_options_are_refused_naming_the_field(option, value, error, says):
    with pytest.raises(error, match=says):
        registry.make_options("sparseloco", **{option: value})


def test_blocks_need_a_square_chunk():
    with pytest.raises(ValueError, match="chunk_size must be a square, got 1000; for example chunk_size=4096"):
        registry.make_options("sparseloco", blocks=True, chunk_size=1000)


def test_defaults_are_the_papers():
    options = registry.make_options("sparseloco")
    assert (options.density, options.chunk_size, options.bits, options.quantization_range) == (1 / 64, 4096, 2, 6.0)
    assert options.count(4096) == 64 and registry.make_options("sparseloco", bits=None).bits is None


@pytest.mark.parametrize("numel,chunk,density,expected", [
    (4096 * 3, 4096, 1 / 64, 3 * 64),
    (10000, 4096, 1 / 64, 64 + 64 + 28),  # a last chunk of 1808 keeps int(1808 / 64)
    (8193, 4096, 1 / 64, 64 + 64 + 1),  # a last chunk of one element keeps it
    (25, 10, 1 / 64, 3),  # chunks shorter than 1 / density keep one each
    (30, 10, 1.0, 30),  # a density of 1 keeps everything
    (7, 4096, 0.5, 3),  # one chunk, shorter than chunk_size
])
def test_count_is_the_sum_over_the_chunks(numel, chunk, density, expected):
    options = registry.make_options("sparseloco", chunk_size=chunk, density=density)
    assert options.count(numel) == expected
    assert registry.create("torch", "sparseloco", chunk_size=chunk, density=density).count(numel, 3) == expected
    full, k, last, k_last = chunk_counts(density, numel, chunk)
    assert full * k + k_last == expected and full * chunk + last == numel


def test_the_engines_plan_targets_the_chunked_count():
    """What the front ends use as the group's target: 129 for 8193 elements (chunks of 4096, 4096
    and 1), where a density over the whole group would give 128."""
    method = registry.create("torch", "sparseloco", min_numel=0)
    engine = StepEngine(method, SimpleNamespace(sparse=True), Transport(None, None))
    plan, stats = engine.plan("g", 8193, dense_step=False)
    assert plan.sparse and plan.target == stats.target == 129 != int(8193 / 64)


def buffer(numel: int, seed: int) -> np.ndarray:
    """Normal values with runs of ties (equal magnitudes of both signs) across chunk boundaries."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(numel).astype(np.float32)
    x[3:40:2], x[4:40:2] = 2.5, -2.5
    return x


CASES = [(1000, 64, 1 / 16, 2), (4096 * 2 + 100, 4096, 1 / 64, 2), (37, 10, 0.05, 1), (500, 100, 0.3, 4),
         (300, 7, 0.5, 8), (1, 4096, 1 / 64, 2)]


@pytest.mark.parametrize("framework", list(BACKENDS))
@pytest.mark.parametrize("numel,chunk,density,bits", CASES)
def test_selection_and_quantizer_match_the_reference_bitwise(framework, numel, chunk, density, bits):
    B, tensor = BACKENDS[framework]
    x = buffer(numel, numel)
    full, k, last, k_last = chunk_counts(density, numel, chunk)
    idx = B.top_k_chunks(tensor(x), chunk, k, k_last)
    expected = R.chunk_select(x, density, chunk)
    assert B.to_numpy(idx).tolist() == expected
    codes, table = quantize(B, B.gather(tensor(x), idx), bits, 6.0)
    ref_codes, ref_table = R.quantize([np.float32(v) for v in x[expected]], bits, 6.0)
    assert B.to_numpy(codes).tolist() == ref_codes
    assert B.to_numpy(table).tobytes() == np.array(ref_table, np.float32).tobytes()
    _, ref_values = R.delivered(x, {"density": density, "chunk_size": chunk, "bits": bits})
    assert B.to_numpy(B.dequantize(codes, table, len(expected))).tobytes() == np.array(ref_values, np.float32).tobytes()


@pytest.mark.parametrize("framework", BACKENDS)
@pytest.mark.parametrize("scale", [0.0, math.inf, math.nan])
def test_a_scale_that_is_zero_or_not_finite_reads_as_one(framework, scale):
    """A quantizer's scale of 0 (one value, or all equal), +inf (values near float32's largest)
    or NaN codes the values as a scale of 1 does: the codes of ``round(c + levels // 2)``, clamped."""
    B, tensor = BACKENDS[framework]
    centred = np.float32([-2.6, -1.5, -0.5, 0.0, 0.4, 0.5, 1.5, 3.0])
    codes = B.to_numpy(B.level_codes(tensor(centred), tensor(np.float32([scale])), 4))
    assert codes.tolist() == [0, 0, 2, 2, 2, 2, 3, 3]


#: A 1 B-element group's selection at the default density (1/64): 2**24 values.
MANY = 2 ** 24


@pytest.fixture(scope="module")
def many_values():
    """:data:`MANY` seeded normal float32 values (mean 1, std 1), their exact mean and std
    (``math.fsum``), and the std that float32 sums added one value after another give."""
    v = (np.random.default_rng(59).standard_normal(MANY) + 1).astype(np.float32)
    mean = math.fsum(v.tolist()) / MANY
    centred = v.astype(np.float64) - mean
    std = math.sqrt(math.fsum((centred * centred).tolist()) / (MANY - 1))
    in_order = np.cumsum(v, dtype=np.float32)[-1] / np.float32(MANY)  # np.cumsum adds one after another
    c = v - in_order
    in_order_std = np.sqrt(np.cumsum(c * c, dtype=np.float32)[-1]) / np.float32(math.sqrt(MANY - 1))
    return v, mean, std, float(in_order_std)


@pytest.mark.parametrize("framework", list(BACKENDS))
def test_the_quantizers_sums_of_16m_values_are_exact_to_float32(framework, many_values):
    """At 16 M values a float32 sum added in order loses percents (the sum of squares comes out
    2.8% low here); the float64 sums give the exact statistics to float32's precision: the mean,
    the std and each level's mean within 1e-6 of the exact ones (relative)."""
    B, tensor = BACKENDS[framework]
    v, exact_mean, exact_std, in_order_std = many_values
    assert abs(in_order_std / exact_std - 1) > 1e-3  # what the test tells apart
    mean, std = (float(B.to_numpy(t)[0]) for t in B.moments(tensor(v))[:2])
    assert abs(mean / exact_mean - 1) < 1e-6 and abs(std / exact_std - 1) < 1e-6
    centred = v - np.float32(mean)
    codes = B.to_numpy(B.level_codes(tensor(centred), tensor(np.float32([std * 6 / 4])), 4))
    means = B.to_numpy(B.bin_means(tensor(centred), tensor(codes), 4))
    counts = np.bincount(codes, minlength=4)
    exact = [math.fsum(centred[codes == b].astype(np.float64).tolist()) / counts[b] for b in range(4)]
    assert counts.min() > MANY // 100  # every level sums many values
    np.testing.assert_allclose(means, exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("paths", ["host", "accelerators"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel,chunk,density", [case[:3] for case in CASES])
def test_chunk_selection_of_every_dtype_is_the_reference_set(paths, dtype, numel, chunk, density):
    """float64 rows (no ranked keys: the k-th magnitude, all above it, the first ties) and
    float32, float16 and bfloat16 ones (keys of their magnitudes) select the reference's set of
    the same values, ties to the lower index; on the accelerators' paths too (run on the CPU),
    where a buffer of full chunks that ends in a shorter one is padded to whole ones (four of the
    cases: a last chunk of 40, 100, 7 and 6 elements; a buffer of one element keeps its chunk's
    own pass)."""
    values = torch.from_numpy(buffer(numel, numel)).to(dtype)
    _, k, _, k_last = chunk_counts(density, numel, chunk)
    expected = R.chunk_select(values.double().numpy(), density, chunk)
    with accelerator_paths() if paths == "accelerators" else contextlib.nullcontext():
        chosen = torch_backend.top_k_chunks(values, chunk, k, k_last)
    assert chosen.tolist() == expected


def test_the_accelerators_chunk_selection_takes_one_topk_for_the_chunks_and_the_shorter_last():
    """On the accelerators' paths a buffer of full chunks and a shorter last one is selected in
    14 dispatched operations once its constants are made (one ``torch.topk`` of the padded rows'
    keys; a pass for the full chunks and one for the last took 21); its indices are the
    reference's (above)."""
    values = torch.from_numpy(buffer(4096 * 2 + 100, 7))
    _, k, _, k_last = chunk_counts(1 / 64, values.numel(), 4096)
    with accelerator_paths():
        first = torch_backend.top_k_chunks(values, 4096, k, k_last)
        with DispatchedOps() as ops:
            again = torch_backend.top_k_chunks(values, 4096, k, k_last)
    assert ops.count <= 14 and torch.equal(first, again), ops.count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_selection_across_the_hosts_slabs_is_the_reference_set(dtype):
    """The host keys its rows a slab of ``SCAN_CHUNK`` elements at a time (64 rows of 4096): 67
    rows span two slabs (64 and 3), then a shorter chunk; negative values keep their magnitude's
    key (the sign bit cleared)."""
    numel, chunk, density = 4096 * 67 + 5, 4096, 1 / 64
    values = torch.from_numpy(buffer(numel, 67)).to(dtype)
    values[4096 * 64 - 3:4096 * 64 + 3] = -9.0  # ties across the slabs' boundary, of the largest magnitude
    _, k, _, k_last = chunk_counts(density, numel, chunk)
    expected = R.chunk_select(values.double().numpy(), density, chunk)
    assert torch_backend.top_k_chunks(values, chunk, k, k_last).tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_hosts_rows_keeping_few_select_the_reference_set_by_blocks(dtype, k):
    """Rows of 4096 keeping at most 8 (an eighth of their 64 blocks) are selected on the host by
    their blocks' maxima (16 rows and a shorter chunk: the fewest elements that take that path),
    the reference's set: the largest magnitude in three blocks of row 0 (two in block 2, one
    each in blocks 5 and 7, of both signs: the lower blocks and indices win), a row of equal
    magnitudes (its first ``k``), a row whose ``k`` largest share one block, and one whose block
    of the largest ``k - 1`` holds a magnitude equal to a lower block's largest (the lower
    wins)."""
    chunk, rows = 4096, chunked.SUB_BLOCKS_FROM // 4096
    values = torch.from_numpy(buffer(chunk * rows + 5, k)).to(dtype)
    for place, value in [(7 * 64 + 1, 9.0), (5 * 64 + 60, -9.0), (2 * 64 + 10, 9.0), (2 * 64 + 3, -9.0)]:
        values[place] = value
    values[chunk:2 * chunk] = -1.0
    values[2 * chunk + 640:2 * chunk + 640 + k] = torch.arange(k, dtype=torch.float32).to(dtype) + 20.0
    values[3 * chunk + 11 * 64:3 * chunk + 11 * 64 + k - 1] = 30.0
    values[3 * chunk + 11 * 64 + 40] = values[3 * chunk + 3 * 64 + 2] = 25.0
    density = k / chunk
    _, kept, _, k_last = chunk_counts(density, values.numel(), chunk)
    expected = R.chunk_select(values.double().numpy(), density, chunk)
    assert kept == k and chunked._host_top_k_rows_by_blocks(values[:chunk * rows].view(rows, chunk), k) is not None
    assert torch_backend.top_k_chunks(values, chunk, kept, k_last).tolist() == expected


@pytest.mark.parametrize("framework", list(BACKENDS))
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [1, 3, 8, 13])
def test_packing_round_trips_and_puts_each_code_in_its_place(framework, bits, count):
    B, tensor = BACKENDS[framework]
    codes = np.random.default_rng(count).integers(0, 2 ** bits, size=count).astype(np.uint8)
    packed = B.to_numpy(B.pack_codes(tensor(codes), bits))
    per = 8 // bits
    assert packed.dtype == np.uint8 and packed.size == R.packed_size(count, bits) == math.ceil(count * bits / 8)
    expected = np.zeros(packed.size, np.int64)
    for i, code in enumerate(codes):  # code i in byte i // per, at bit (i % per) * bits
        expected[i // per] |= int(code) << ((i % per) * bits)
    assert packed.tolist() == expected.tolist()
    rows = np.concatenate([packed, packed[::-1].copy(), packed])
    assert B.to_numpy(B.unpack_codes(tensor(rows), bits, count)).tolist() == (
        codes.tolist() + B.to_numpy(B.unpack_codes(tensor(packed[::-1].copy()), bits, count)).tolist()
        + codes.tolist())


@pytest.mark.parametrize("numel,chunk,density", [
    (4096 * 2 + 100, 4096, 1 / 64),  # 12 bits; a last chunk of 100
    (1000, 7, 0.5),  # a chunk that is no power of two (3 bits), a last one of 6
    (10, 1, 1.0),  # chunks of one element: 1 bit, every offset 0
    (37, 10, 0.05),  # 4 bits, a last chunk of 7 keeping one
    (555, 100, 0.3),  # 7 bits, k of 30 and k_last of 16
    (300, 64, 1.0),  # every index, 6 bits: 8 offsets to 6 bytes
    (5, 2 ** 20 + 3, 0.5),  # one short chunk, 21 bits
    (100, 2 ** 33, 0.1),  # 34 bits: offsets held in int64
])
def test_offsets_pack_to_the_reference_bytes_and_unpack_to_the_indices(numel, chunk, density):
    """Both frameworks pack the selection's offsets inside their chunks to the bytes of the
    reference's bit string (which takes each index's chunk from the index itself; the packing
    from its position), and unpack rows of them (as allgathered) to the global indices."""
    _, k, _, k_last = chunk_counts(density, numel, chunk)
    width = offset_width(chunk)
    assert width == R.offset_width(chunk)
    rows = [buffer(numel, seed) for seed in range(3)]
    selections = [R.chunk_select(x, density, chunk) for x in rows]
    for B, tensor in BACKENDS.values():
        packed = []
        for x, expected in zip(rows, selections):
            row = B.to_numpy(B.pack_offsets(B.top_k_chunks(tensor(x), chunk, k, k_last), chunk, width))
            assert row.dtype == np.uint8 and row.size == math.ceil(len(expected) * width / 8)
            assert row.tolist() == R.packed_offsets(expected, chunk, width)
            packed.append(row)
        indices = B.unpack_offsets(tensor(np.concatenate(packed)), chunk, k, width, len(selections[0]))
        assert B.to_numpy(indices).dtype == np.int64
        assert B.to_numpy(indices).tolist() == [i for expected in selections for i in expected]


def test_groups_of_one_count_unpack_with_their_own_chunks():
    """Groups of the same count and ``k`` but other chunk lengths, then another ``k``, in one
    process, each packed to the reference's bytes and unpacked to its own indices: the chunk
    starts kept for a group are not another group's, and making them changes no shared constant
    (an ``arange`` of the count)."""
    count = 12
    for chunk, k in ((16, 4), (64, 4), (16, 6)):
        indices = [j // k * chunk + (5 * j + 3) % chunk for j in range(count)]
        width = offset_width(chunk)
        for B, tensor in BACKENDS.values():
            packed = B.pack_offsets(tensor(np.array(indices, dtype=np.int64)), chunk, width)
            assert B.to_numpy(packed).tolist() == R.packed_offsets(indices, chunk, width)
            unpacked = B.unpack_offsets(tensor(np.concatenate([B.to_numpy(packed)] * 2)), chunk, k, width, count)
            assert B.to_numpy(unpacked).tolist() == indices * 2, (chunk, k)


class Loopback(TorchCommunicator):
    """PyTorch's communicator with its allgathers done by concatenation across the ranks of one
    process (the exchanges run in lockstep: every rank launches, then every rank waits)."""

    def __init__(self, board: dict, rank: int, size: int, numel: int, target: int) -> None:
        super().__init__(None, "g", GroupStats("g", numel, target), 1.0 / size, size=size, rank=rank)
        self.board = board

    def allgather(self, tensor, tag, kind, rows=None):
        self.board.setdefault(tag, {})[self.rank] = tensor.clone()
        return self._launched(tag, tag, kind, sent=nbytes(tensor), own=nbytes(tensor))

    def _complete(self, handle, timeout):
        return torch.cat([self.board[handle][r] for r in range(self.size)])


def loopback_exchange(method, xs, shapes=None):
    """Every rank's exchange of its buffer ``xs[r]`` (holding parameters of ``shapes``, as the
    engine hands them): ``(updates, residuals, comms)``."""
    board: dict = {}
    numel = xs[0].numel()
    comms = [Loopback(board, r, len(xs), numel, method.count(numel, 0)) for r in range(len(xs))]
    for comm in comms:
        comm.shapes = shapes
    runs = [method.exchange(x, comm, None, 0) for x, comm in zip(xs, comms)]
    pendings = [next(run) for run in runs]
    results = []
    for run, comm, pending in zip(runs, comms, pendings):
        with pytest.raises(StopIteration) as done:
            run.send(comm.wait(pending))
        results.append(done.value.value)
    return [u for u, _ in results], [e for _, e in results], comms


@pytest.mark.parametrize("options", [{}, {"chunk_size": 64, "density": 0.1, "bits": 1},
                                     {"chunk_size": 100, "density": 0.05, "bits": 4, "quantization_range": 3.0},
                                     {"chunk_size": 50, "density": 0.1, "bits": 8}, {"chunk_size": 64, "bits": None}])
def test_exchange_matches_the_reference_bitwise_and_loses_nothing(options):
    ranks, numel = 3, 4096 * 2 + 333
    method = registry.create("torch", "sparseloco", **options)
    xs = [buffer(numel, 10 + r) * (r + 1) for r in range(ranks)]
    updates, residuals, comms = loopback_exchange(method, [torch.from_numpy(x.copy()) for x in xs])
    ref_xs = [x.copy() for x in xs]
    expected = R.sparseloco_step(ref_xs, 0, options, np.float32(1 / ranks))
    m = registry.make_options("sparseloco", **options).count(numel)
    bits = registry.make_options("sparseloco", **options).bits
    for r in range(ranks):
        assert updates[r].numpy().tobytes() == expected.tobytes()
        assert residuals[r].numpy().tobytes() == ref_xs[r].tobytes()
        stats = comms[r].stats
        assert stats.selected == m and stats.collectives == (3 if bits else 2)
        if bits:  # packed codes, the table (2**bits + 1 float32) and the packed offsets
            width = R.offset_width(registry.make_options("sparseloco", **options).chunk_size)
            assert stats.sent == {"values": math.ceil(m * bits / 8), "meta": (2 ** bits + 1) * 4,
                                  "indices": math.ceil(m * width / 8), "node": 0}
            assert stats.received["values"] == (ranks - 1) * math.ceil(m * bits / 8)
        # Error feedback: the residual is x less what was delivered, one float32 subtraction at
        # each selected index (so delivered + residual == x up to that rounding, exactly where
        # Sterbenz's lemma makes the subtraction exact) and x itself everywhere else.
        idx, values = R.delivered(xs[r], options)
        delivered = np.zeros(numel, np.float32)
        delivered[idx] = values
        residual = residuals[r].numpy()
        assert np.array_equal(residual, xs[r] - delivered)
        others = np.setdiff1d(np.arange(numel), idx)
        assert np.array_equal(residual[others], xs[r][others])
        exact = np.abs(residual.astype(np.float64) + delivered - xs[r])
        assert np.all(exact <= np.spacing(np.abs(residual)) / 2)
        if bits:  # the quantization error stays in the residual
            assert np.any(residual[idx] != 0)
    # Nothing lost: the update and the mean residual add up to the mean buffer (up to rounding).
    kept = sum(e.numpy().astype(np.float64) for e in residuals) / ranks
    np.testing.assert_allclose(kept + updates[0].numpy(), sum(x.astype(np.float64) for x in xs) / ranks,
                               rtol=0, atol=1e-6)


def test_a_bfloat16_group_quantizes_in_float32_and_keeps_the_rounding():
    method = registry.create("torch", "sparseloco", chunk_size=64, density=0.1)
    xs = [torch.from_numpy(buffer(640, r)).to(torch.bfloat16) for r in range(2)]
    originals = [x.clone() for x in xs]
    updates, residuals, _ = loopback_exchange(method, xs)
    assert updates[0].dtype == residuals[0].dtype == torch.bfloat16
    assert torch.equal(updates[0], updates[1])
    for x, e in zip(originals, residuals):
        idx, values = R.delivered(x.float().numpy(), {"chunk_size": 64, "density": 0.1})
        delivered = torch.zeros(640, dtype=torch.bfloat16)
        delivered[idx] = torch.tensor(values).to(torch.bfloat16)
        assert torch.equal(e, x - delivered)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_bytes_per_coordinate_on_the_wire(bits):
    """The defaults' chunks of 4096 on a group of 2**20 elements (16384 coordinates a rank): what
    the statistics count as sent, per coordinate, is the formula's ``ceil(m * 12 / 8)`` of offsets,
    ``ceil(m * bits / 8)`` of codes and ``4 * (2**bits + 1)`` of table: 1.75 bytes at 2 bits
    (it was 4.25 with int32 indices). Printed with ``-s``."""
    numel, ranks = 2 ** 20, 2
    method = registry.create("torch", "sparseloco", bits=bits)
    m = method.count(numel, 0)
    _, _, comms = loopback_exchange(method, [torch.from_numpy(buffer(numel, r)) for r in range(ranks)])
    for comm in comms:
        sent = sum(comm.stats.sent.values())
        assert sent == math.ceil(m * 12 / 8) + math.ceil(m * bits / 8) + 4 * (2 ** bits + 1)
    print(f"bits={bits}: {sent / m:.4f} bytes per coordinate ({sent} bytes for {m} coordinates)")


#: Groups of parameters cut into blocks: edge blocks shorter and narrower, a 4-D tensor seen as its
#: first dimension's rows, a scalar, a vector longer than a chunk; at the defaults (64 x 64) and small;
#: with the offsets' width on the wire (the bits of the largest block's offsets).
BLOCK_CASES = [([(130, 70), (70,), (16, 3, 3, 3), (), (5000,)], {}, 12),
               ([(5, 7), (10,), (3,)], {"chunk_size": 4, "density": 0.5, "bits": 1}, 2),
               ([(3, 10), (9,)], {"chunk_size": 16, "density": 0.2, "bits": 4}, 4),  # blocks of 3 x 4 and 3 x 2
               ([(40, 30), (9,)], {"chunk_size": 16, "density": 0.2, "bits": None}, None)]


@pytest.mark.parametrize("shapes,options,width", BLOCK_CASES)
def test_blocks_exchange_matches_the_reference_bitwise_and_loses_nothing(shapes, options, width):
    """``blocks=True`` on 3 ranks: the update and every residual bitwise the reference's (each
    block's largest, written with loops over each parameter's block rows and columns), the count
    the sum over the blocks, recorded as the target, the offsets on the wire as wide as the
    largest block needs; the delivered values plus the residual are the buffer (nothing lost)."""
    ranks, options = 3, {"blocks": True, **options}
    numel = sum(int(np.prod(s)) for s in shapes)
    method = registry.create("torch", "sparseloco", **options)
    xs = [buffer(numel, 20 + r) * (r + 1) for r in range(ranks)]
    updates, residuals, comms = loopback_exchange(method, [torch.from_numpy(x.copy()) for x in xs], shapes)
    ref_xs = [x.copy() for x in xs]
    expected = R.sparseloco_step(ref_xs, 0, options, np.float32(1 / ranks), shapes)
    idx, _ = R.delivered(xs[0], options, shapes)
    assert idx != R.chunk_select(xs[0], options.get("density", 1 / 64), options.get("chunk_size", 4096))
    for r in range(ranks):
        assert updates[r].numpy().tobytes() == expected.tobytes()
        assert residuals[r].numpy().tobytes() == ref_xs[r].tobytes()
        assert comms[r].stats.selected == comms[r].stats.target == len(idx)
    if width is not None:
        assert comms[0].stats.sent["indices"] == math.ceil(len(idx) * width / 8)
    kept = sum(e.numpy().astype(np.float64) for e in residuals) / ranks
    np.testing.assert_allclose(kept + updates[0].numpy(), sum(x.astype(np.float64) for x in xs) / ranks,
                               rtol=0, atol=1e-6)


def test_blocks_without_the_groups_shapes_are_refused_naming_the_fix():
    method = registry.create("torch", "sparseloco", blocks=True)
    with pytest.raises(ValueError, match="needs their shapes.*give blocks=False"):
        loopback_exchange(method, [torch.zeros(100), torch.zeros(100)])
