"""The collectives of the two-tier exchange's inside tier, timed on one host: Horovod's
reduce-scatter of a buffer, the allgather of its slices, and the allreduce of the same buffer,
side by side in one job, so the cost of the tier (reduce-scatter + allgather) is read against
the dense allreduce and against the alpha-beta fit of small allgathers.

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.emulated.node_collectives [--sizes-mb 1 8 32 107]

For each ``--sizes-mb`` buffer of float32 (107 MB: the VGG-like model's gradient), ``--repeats``
rounds of the three collectives in turn (one warm-up round first); rank 0 prints per size and
collective the median milliseconds and the rate at which a rank's bytes moved (``(L-1)/L`` of
the buffer for the reduce-scatter and the allgather, twice that for the allreduce, on ``L``
ranks: what a ring moves), and the tier (reduce-scatter + allgather) over the allreduce.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

COLLECTIVES = ("reducescatter", "allgather", "allreduce")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 8, 32, 107], help="buffer sizes, MB")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per size")
    p.add_argument("--results", type=Path, help="also write the figures to this JSON file")
    return p


def ring_bytes(collective: str, size: float, ranks: int) -> float:
    """Bytes one rank moves in a ring ``collective`` of a ``size``-byte buffer on ``ranks`` ranks."""
    share = (ranks - 1) / ranks * size
    return 2 * share if collective == "allreduce" else share


def timed(run: Callable[[], Any]) -> float:
    """Seconds one call of ``run`` takes (it returns when the collective has completed)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main(argv: Optional[Sequence[str]] = None) -> None:
    import horovod.torch as hvd
    import torch

    from benchmarks.shared.results import command_line, write_results

    args = parser().parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    ranks = hvd.size()
    rows: List[Dict[str, Any]] = []
    for megabytes in args.sizes_mb:
        numel = int(megabytes * 1e6) // 4 // ranks * ranks
        buffer = torch.rand(numel)
        piece = buffer[:numel // ranks].clone()
        runs = {"reducescatter": lambda b=buffer: hvd.reducescatter(b, op=hvd.Sum, name="rs"),
                "allgather": lambda p=piece: hvd.allgather(p, name="ag"),
                "allreduce": lambda b=buffer: hvd.allreduce(b, op=hvd.Sum, name="ar")}
        times: Dict[str, List[float]] = {c: [] for c in COLLECTIVES}
        for round_ in range(args.repeats + 1):
            for collective in COLLECTIVES:
                seconds = timed(runs[collective])
                if round_:
                    times[collective].append(seconds)
        for collective in COLLECTIVES:
            seconds = statistics.median(times[collective])
            rows.append({"megabytes": 4 * numel / 1e6, "collective": collective, "seconds": seconds,
                         "gbit_per_second": 8 * ring_bytes(collective, 4 * numel, ranks) / seconds / 1e9})
    if hvd.rank() != 0:
        return
    print(f"{ranks} ranks on one host, medians of {args.repeats} rounds")
    print(f"{'MB':>8} {'collective':14} {'ms':>9} {'Gbit/s':>7}   tier / allreduce")
    for row in rows:
        tier = ""
        if row["collective"] == "allreduce":
            same = {r["collective"]: r["seconds"] for r in rows if r["megabytes"] == row["megabytes"]}
            row["tier_over_allreduce"] = (same["reducescatter"] + same["allgather"]) / row["seconds"]
            tier = f"{row['tier_over_allreduce']:.2f}"
        print(f"{row['megabytes']:8.2f} {row['collective']:14} {1e3 * row['seconds']:9.2f} "
              f"{row['gbit_per_second']:7.2f}   {tier}")
    if args.results:
        write_results(args.results, "node_collectives", {"ranks": ranks, "rows": rows},
                      command_line(argv, "benchmarks.emulated.node_collectives"))


if __name__ == "__main__":
    main()
