"""Which of the exact top-k's two paths is faster on a CPU buffer of each size: what sets
``horovod_sparse.torch_core.top_k.DEVICE_TOP_K_BELOW``.

    python -m benchmarks.costs.top_k_paths [--keys] [--sizes 2570 16640 32768 49152 65792 85002 262144 1048576] \
        [--densities 0.01 0.001] [--repeats 31] [--results results/top_k_paths.json]

One process, one thread (``torch.set_num_threads(1)``), a float32 normal buffer per size,
``k = max(1, int(density * numel))``. Per size and density, side by side and interleaved
(medians of ``--repeats`` of the process's CPU time, so that other load on a shared machine does
not count; only the ratio is meant to be read):

* ``host``: :func:`~horovod_sparse.torch_core.top_k.scanned_top_k`, the block scan (the path
  a CPU buffer of ``DEVICE_TOP_K_BELOW`` elements or more takes: several small operations and
  host reads, and nothing of the buffer's size allocated);
* ``device``: :func:`~horovod_sparse.torch_core.top_k.device_top_k` (whole-buffer passes
  and one ``torch.topk`` of int64 keys, no host read; what a GPU runs, and a smaller CPU buffer);

and ``device / host``, below 1 where the device path is faster. The default sizes are the main
job's groups (the digits MLP's three layers, 2,570, 16,640 and 65,792 elements, and its one
flat bucket of 85,002), the sizes around the bound, and larger buffers. Both paths are checked
once to pick the same set.

``--keys``: instead, the two ways of forming the tie rule's int64 keys
(:func:`~horovod_sparse.torch_core.top_k.ranked_keys`) from ``|x|`` in rows of 4,096 (SparseLoCo's
chunks) of each size: ``add``, the accelerators' one ``torch.add`` of the int32 bits to the int64
positions, and ``widen``, the host's widening, shift and or; the same keys, checked.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from horovod_sparse.torch_core import selection, top_k


def cpu_ms(run: Callable[[], object]) -> float:
    start = time.process_time()
    run()
    return (time.process_time() - start) * 1e3


def interleaved_medians(runs: List[Callable[[], torch.Tensor]], repeats: int, differ: str) -> List[float]:
    """The median CPU ms of each of ``runs``, run in turn ``repeats`` times, after checking that
    they return the same tensor (``AssertionError(differ)`` otherwise)."""
    first = runs[0]()
    if not all(torch.equal(first, run()) for run in runs[1:]):
        raise AssertionError(differ)
    times: List[List[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for taken, run in zip(times, runs):
            taken.append(cpu_ms(run))
    return [statistics.median(taken) for taken in times]


def row(numel: int, density: float, repeats: int) -> Dict[str, float]:
    """The medians of both paths on one buffer, interleaved, and their ratio."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    k = max(1, int(density * numel))
    host, device = interleaved_medians(
        [lambda: top_k.scanned_top_k(x, k), lambda: top_k.device_top_k(x, k)], repeats,
        f"the paths picked different sets for {numel} elements, k={k}")
    return {"numel": numel, "density": density, "k": k, "host_ms": host, "device_ms": device,
            "device_over_host": device / host}


def keys_row(numel: int, repeats: int) -> Dict[str, float]:
    """The medians of both ways of forming the keys of ``numel`` magnitudes in rows of 4,096
    (the last row dropped when short), interleaved, and their ratio."""
    width = min(numel, 4096)
    rows = torch.randn(numel // width, width, generator=torch.Generator().manual_seed(numel)).abs()

    def keys(forced: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            if not forced:
                return top_k.ranked_keys(rows)
            with selection.accelerator_paths():
                return top_k.ranked_keys(rows)
        return run

    add, widen = interleaved_medians([keys(True), keys(False)], repeats,
                                     f"the two ways formed different keys for {numel} elements")
    return {"numel": rows.numel(), "add_ms": add, "widen_ms": widen, "widen_over_add": widen / add}


def print_keys(rows: List[Dict[str, float]], repeats: int) -> None:
    print(f"CPU ms of forming the keys of rows of 4,096, medians of {repeats}")
    print(f"{'elements':>10} {'add ms':>9} {'widen ms':>9} {'widen/add':>10}")
    for r in rows:
        print(f"{r['numel']:>10,} {r['add_ms']:>9.3f} {r['widen_ms']:>9.3f} {r['widen_over_add']:>10.2f}")


def print_paths(rows: List[Dict[str, float]], repeats: int) -> None:
    print(f"CPU ms of one top-k, medians of {repeats}; DEVICE_TOP_K_BELOW = {top_k.DEVICE_TOP_K_BELOW:,}")
    print(f"{'elements':>10} {'density':>8} {'k':>7} {'host ms':>9} {'device ms':>10} {'device/host':>12}")
    for r in rows:
        print(f"{r['numel']:>10,} {r['density']:>8} {r['k']:>7,} {r['host_ms']:>9.3f} {r['device_ms']:>10.3f} "
              f"{r['device_over_host']:>12.2f}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[2570, 16640, 32768, 49152, 65792, 85002, 262144, 1048576])
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    p.add_argument("--repeats", type=int, default=31)
    p.add_argument("--results", type=Path, help="also write the rows to this JSON file")
    p.add_argument("--keys", action="store_true", help="time the two ways of forming the keys instead")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.keys:
        rows = [keys_row(numel, args.repeats) for numel in args.sizes]
        print_keys(rows, args.repeats)
    else:
        rows = [row(numel, density, args.repeats) for numel in args.sizes for density in args.densities]
        print_paths(rows, args.repeats)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        benchmark = "top_k_keys" if args.keys else "top_k_paths"
        args.results.write_text(json.dumps({"benchmark": benchmark, "rows": rows}, indent=1))
        print(f"wrote {args.results}")

if __name__ == "__main__":
    main()
