"""Selection cost of every method against reading the buffer once, and MiCRO/ExDyna's against Top-k.

    python -m benchmarks.costs.selection_cost --numel 25600000 --workers 2 4 --density 0.001 --repeats 15

One process, one core (``torch.set_num_threads(1)``), a float32 gradient of ``--numel`` normal
elements (the size of ResNet-50 by default), or with ``--gradient MODEL`` the flat gradient of a
model of :mod:`benchmarks.shared.models` (seeded, at its default size, one batch of
``--batch-size``; ``--numel`` ignored): a real gradient is heavy-tailed, so Gaussian-k's first
threshold selects too many and its corrections run, where on normal elements it settles at once;
``k = density * numel``. First, over the whole buffer, side by
side and interleaved (medians over ``--repeats``), each as a ratio to ``sum``:

* ``sum``: ``x.sum()``, a read-only pass over the buffer;
* ``torch.topk``: ``torch.topk(x.abs(), k)``, what Top-k did before the exact top-k primitive;
* ``top_k``: :func:`horovod_sparse.torch_core.top_k.top_k`, the exact top-k of Top-k, gTop-k,
  LAGS and DGC's final pick (checked once to pick the same set as ``torch.topk``);
* ``threshold``: the hard-threshold method's selection (block scan and pick at its fixed
  ``1 / (2 sqrt(k))``), on the gradient scaled so that this threshold selects ``k``;
* ``gaussiank``: Gaussian-k's selection, statistics and corrections included
  (:func:`horovod_sparse.methods.gaussiank.gaussiank_select`);
* ``sparseloco``: SparseLoCo's selection, each chunk of 4,096 elements its own top
  ``max(1, int(density * 4096))`` (:func:`horovod_sparse.torch_core.chunked.top_k_chunks`; the
  quantizer left out): where a chunk keeps at most 8, by its blocks' maxima;
* ``sparseloco keys``: the same selection of the full chunks (the shorter last one left out) by
  each chunk's own keys (:func:`horovod_sparse.torch_core.chunked.top_k_rows` with
  ``by_blocks=False``), as it was before the blocks.

Then the same over the whole buffer in TensorFlow (one intra-op and one inter-op thread), side by
side and interleaved, each as a ratio to TensorFlow's own read pass:

* ``sum``: ``tf.reduce_sum(x)``, a read-only pass over the buffer;
* ``tf.math.top_k``: ``tf.math.top_k(tf.abs(x), k)``, what TensorFlow's Top-k did before its exact
  top-k primitive;
* ``top_k``: :func:`horovod_sparse.tensorflow.selection.top_k` called eagerly, and ``top_k traced``:
  the same inside a ``tf.function`` (checked once to pick the same set as the PyTorch ``top_k``).

Then, for each worker count ``n``, on rank 0's partition ``[0, numel / n)``:

* ``topk``: ``torch.topk(x.abs(), k)`` over the whole buffer (for the ratio ``histogram / topk``);
* ``sum``: ``x[partition].sum()``, a read-only pass over the partition;
* ``histogram``: MiCRO/ExDyna's selection with the default controller, as the exchange runs it:
  block scan, candidate read and local histogram, threshold, filter (the other ranks' histograms
  are taken equal to this one's);
* ``paper``: the selection with a given threshold (the paper controller's path): block scan and pick;
* ``naive``: ``torch.where(x[partition].abs() >= threshold)``, for orientation.

and prints each time and the ratios ``histogram / topk`` and ``histogram / sum``. Times are the
process's CPU time (``time.process_time``; everything runs on one thread), so that other load on a
shared machine, which preempts this process, does not count; they are only meaningful as ratios
measured in the same run. ``--results`` writes
``{"whole_buffer": {..., "tensorflow": {...}}, "partitions": [...]}`` (no ``"tensorflow"`` when
TensorFlow is not installed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch

from benchmarks.shared.models import model_spec
from horovod_sparse.common.thresholds import as_float32, scan_block_size
from horovod_sparse.methods.micro.controllers import HistogramController, ThresholdState, candidate_budget, reaches_bar
from horovod_sparse.common.capacity import CappedOptions, capacity_count
from horovod_sparse.common.threshold_baselines import hard_threshold
from horovod_sparse.methods.micro.candidates import Candidates
from horovod_sparse.torch_core.selection import pick, pick_capped, scan
from horovod_sparse.torch_core.top_k import top_k
from horovod_sparse.methods.gaussiank import gaussiank_select
from horovod_sparse.methods.sparseloco import SparseLoCoOptions, chunk_counts
from horovod_sparse.torch_core.chunked import top_k_chunks, top_k_rows
from horovod_sparse.torch import backend


PHASES = ("scan", "candidates", "histogram", "threshold", "filter")
#: SparseLoCo's default chunk length.
SPARSELOCO_CHUNK: int = SparseLoCoOptions.chunk_size


def histogram_selection(x: torch.Tensor, end: int, k: int, workers: int, state: ThresholdState
                        ) -> Tuple[torch.Tensor, List[float]]:
    """Rank 0's selection with the histogram controller, the global histogram emulated as
    ``workers`` copies of rank 0's (the bar markers are not summed: they hold a maximum).
    Returns the indices and the clock at the start and at the end of each of :data:`PHASES`."""
    controller = HistogramController()
    clock = [time.process_time()]
    scanned = scan(x, 0, end, scan_block_size(k / x.numel()))
    clock.append(time.process_time())
    candidates = Candidates.collect(backend, scanned, candidate_budget(k, workers, state.last_counts, 0))
    clock.append(time.process_time())
    window = controller.window(state)
    local = candidates.local_histogram(window, 0, workers).numpy()
    clock.append(time.process_time())
    bins = len(window) + 1
    summed = np.concatenate([local[:bins] * workers, local[bins:]])
    threshold = controller.next_threshold(state, k, summed)
    clock.append(time.process_time())
    selected = candidates.select(threshold, reaches_bar(window, summed, 0, threshold))
    clock.append(time.process_time())
    return selected, clock


def steady_state(x: torch.Tensor, end: int, k: int, workers: int) -> ThresholdState:
    """The controller's state after one step at the target (so the fine window is used)."""
    state = ThresholdState()
    selected, _ = histogram_selection(x, end, k, workers, state)
    state.record([selected.numel()] * workers)
    return state


def partition_candidates(x: torch.Tensor, end: int, k: int, workers: int,
                         state: ThresholdState) -> Dict[str, Callable[[], object]]:
    """The ways of selecting from rank 0's partition ``x[:end]`` compared side by side: a full
    ``torch.topk``, a read pass, the histogram controller, the paper's scan and a naive ``where``."""
    threshold = state.threshold
    block = scan_block_size(k / x.numel())
    return {
        "topk": lambda: torch.topk(x.abs(), k, sorted=False),
        "sum": lambda: x[:end].sum(),
        "histogram": lambda: histogram_selection(x, end, k, workers, ThresholdState(**vars(state))),
        "paper": lambda: pick(scan(x, 0, end, block), threshold),
        "naive": lambda: torch.where(x[:end].abs() >= threshold),
    }


def model_gradient(name: str, batch_size: int, seed: int) -> torch.Tensor:
    """The flat float32 gradient of :func:`benchmarks.shared.models.model_spec` ``name`` (built
    with ``seed``, at its default size) on one batch of ``batch_size`` of its synthetic inputs."""
    spec = model_spec(name)
    torch.manual_seed(seed)
    model = spec.build(spec.default_size)
    inputs, targets = spec.batch(batch_size, spec.default_size, torch.Generator().manual_seed(seed))
    output = model(inputs)
    torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1)).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def time_side_by_side(candidates: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    """Median seconds of each callable, run in turn ``repeats`` times (after one warm-up each)."""
    samples: Dict[str, List[float]] = {name: [] for name in candidates}
    for run in candidates.values():
        run()
    for _ in range(repeats):
        for name, run in candidates.items():
            start = time.process_time()
            run()
            samples[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def whole_buffer(x: torch.Tensor, k: int, density: float, repeats: int) -> Dict[str, float]:
    """Median milliseconds of a read pass and of each method's selection over all of ``x``, and
    each selection's ratio to the read pass (``<name>_over_sum``)."""
    exact = top_k(x, k)
    if not torch.equal(exact, torch.topk(x.abs(), k).indices.sort().values):
        raise AssertionError("top_k and torch.topk picked different sets")
    threshold = as_float32(hard_threshold(k))
    scaled = x * (threshold / float(x[exact].abs().min()))  # the fixed threshold selects about k
    block = scan_block_size(density)
    capacity = capacity_count(CappedOptions(density=density), k, x.numel())
    chunk_sizes = chunk_counts(density, x.numel(), SPARSELOCO_CHUNK)[1::2]  # (k a chunk, k of the last)
    full_chunks = x[:x.numel() - x.numel() % SPARSELOCO_CHUNK].view(-1, SPARSELOCO_CHUNK)
    selections = {
        "sum": lambda: x.sum(),
        "torch.topk": lambda: torch.topk(x.abs(), k, sorted=False),
        "top_k": lambda: top_k(x, k),
        "threshold": lambda: pick_capped(scan(scaled, 0, x.numel(), block), threshold, x.numel()),  # uncapped
        "gaussiank": lambda: gaussiank_select(backend, x, k, density, capacity),
        "sparseloco": lambda: top_k_chunks(x, SPARSELOCO_CHUNK, *chunk_sizes),
    }
    if full_chunks.numel():
        if not torch.equal(top_k_rows(full_chunks, chunk_sizes[0]),
                           top_k_rows(full_chunks, chunk_sizes[0], by_blocks=False)):
            raise AssertionError("SparseLoCo's chunks by blocks and by their own keys picked different sets")
        selections["sparseloco keys"] = lambda: top_k_rows(full_chunks, chunk_sizes[0], by_blocks=False)
    seconds = time_side_by_side(selections, repeats)
    row = {f"{name}_ms": 1e3 * value for name, value in seconds.items()}
    row.update({f"{name}_over_sum": value / seconds["sum"] for name, value in seconds.items() if name != "sum"})
    return row


def single_threaded_tensorflow():
    """TensorFlow on one intra-op and one inter-op thread, or None when it is not installed."""
    try:
        import tensorflow as tf
    except ImportError:
        return None
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def tensorflow_whole_buffer(tf, x: torch.Tensor, k: int, repeats: int) -> Dict[str, float]:
    """Median milliseconds of TensorFlow's read pass, ``tf.math.top_k`` and the exact ``top_k``
    (eager and traced) over all of ``x``, each selection's ratio to the read pass (``<name>_over_sum``)."""
    from horovod_sparse.tensorflow.selection import top_k as tf_top_k
    tensor = tf.constant(x.numpy())
    traced = tf.function(tf_top_k)
    exact = top_k(x, k).numpy()
    for found in (tf_top_k(tensor, k), traced(tensor, tf.constant(k))):
        if not np.array_equal(found.numpy(), exact):
            raise AssertionError("the TensorFlow and PyTorch top_k picked different sets")
    seconds = time_side_by_side({
        "sum": lambda: tf.reduce_sum(tensor).numpy(),
        "tf.math.top_k": lambda: tf.math.top_k(tf.abs(tensor), k, sorted=False).indices.numpy(),
        "top_k": lambda: tf_top_k(tensor, k).numpy(),
        "top_k traced": lambda: traced(tensor, tf.constant(k)).numpy(),
    }, repeats)
    row = {f"{name}_ms": 1e3 * value for name, value in seconds.items()}
    row.update({f"{name}_over_sum": value / seconds["sum"] for name, value in seconds.items() if name != "sum"})
    return row


TF_METHODS = ("tf.math.top_k", "top_k", "top_k traced")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_600_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gradient", metavar="MODEL", help="a model's gradient instead of normal elements")
    parser.add_argument("--batch-size", type=int, default=16, help="the batch of --gradient's model")
    parser.add_argument("--results", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tf = single_threaded_tensorflow()
    if args.gradient is None:
        x = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.seed))
        source = "normal elements"
    else:
        x = model_gradient(args.gradient, args.batch_size, args.seed)
        args.numel, source = x.numel(), f"{args.gradient}'s gradient at batch {args.batch_size}"
    k = max(1, int(args.density * args.numel))
    print(f"selection over a float32 gradient of {args.numel} elements ({source}), density {args.density} "
          f"(k = {k}), 1 thread, medians of {args.repeats} (CPU time)")
    whole = whole_buffer(x, k, args.density, args.repeats)
    methods = [name for name in ("torch.topk", "top_k", "threshold", "gaussiank", "sparseloco", "sparseloco keys")
               if name + "_ms" in whole]
    print(f"\nwhole buffer: read pass (sum) {whole['sum_ms']:.2f} ms; each selection in ms and / read pass")
    print("".join(f"{name:>22s}" for name in methods))
    print("".join(f"{whole[name + '_ms']:13.1f} {whole[name + '_over_sum']:8.2f}" for name in methods))
    if tf is not None:
        whole["tensorflow"] = tensorflow_whole_buffer(tf, x, k, args.repeats)
        tf_whole = whole["tensorflow"]
        print(f"\nwhole buffer, TensorFlow: read pass (tf.reduce_sum) {tf_whole['sum_ms']:.2f} ms; "
              "each selection in ms and / TensorFlow read pass")
        print("".join(f"{name:>22s}" for name in TF_METHODS))
        print("".join(f"{tf_whole[name + '_ms']:13.1f} {tf_whole[name + '_over_sum']:8.2f}" for name in TF_METHODS))
    rows = []
    print(f"\nMiCRO/ExDyna on rank 0's partition\n{'n':>3s} {'topk ms':>9s} {'sum ms':>8s} {'hist ms':>8s} "
          f"{'paper ms':>9s} {'naive ms':>9s} {'hist/topk':>10s} {'hist/sum':>9s}  histogram phases (ms)")
    for workers in args.workers:
        end = args.numel // workers
        state = steady_state(x, end, k, workers)
        seconds = time_side_by_side(partition_candidates(x, end, k, workers, state), args.repeats)
        phases = time_phases(x, end, k, workers, state, args.repeats)
        row = {"workers": workers, "numel": args.numel, "density": args.density,
               **{f"{name}_ms": 1e3 * value for name, value in seconds.items()},
               "histogram_over_topk": seconds["histogram"] / seconds["topk"],
               "histogram_over_sum": seconds["histogram"] / seconds["sum"],
               "phases_ms": {name: 1e3 * value for name, value in phases.items()}}
        rows.append(row)
        print(f"{workers:3d} {row['topk_ms']:9.1f} {row['sum_ms']:8.2f} {row['histogram_ms']:8.2f} "
              f"{row['paper_ms']:9.2f} {row['naive_ms']:9.2f} {row['histogram_over_topk']:10.4f} "
              f"{row['histogram_over_sum']:9.2f}  "
              + ", ".join(f"{name} {value:.2f}" for name, value in row["phases_ms"].items()))
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"whole_buffer": {"numel": args.numel, "gradient": args.gradient,
                                                             "density": args.density, **whole},
                                            "partitions": rows}, indent=2))


def time_phases(x: torch.Tensor, end: int, k: int, workers: int, state: ThresholdState,
                repeats: int) -> Dict[str, float]:
    """Median seconds of each of :data:`PHASES` of :func:`histogram_selection`."""
    samples: Dict[str, List[float]] = {name: [] for name in PHASES}
    for _ in range(repeats):
        _, clock = histogram_selection(x, end, k, workers, ThresholdState(**vars(state)))
        for name, begin, finish in zip(PHASES, clock, clock[1:]):
            samples[name].append(finish - begin)
    return {name: statistics.median(values) for name, values in samples.items()}


if __name__ == "__main__":
    main()
