"""How a rank waits for Horovod: ``hvd.synchronize`` (a spin) against polling and sleeping
(:func:`horovod_sparse.torch.waiting.poll_until_done`, what ``wait`` does where the host has
no cores to spare), side by side in one job.

    horovodrun -np 4 -H localhost:4 --gloo python -m benchmarks.costs.waiting [--rounds 5] [--steps 200]

Two loops per round, each run once per way of waiting, the order alternating between rounds so
drifts of a shared machine fall on both alike: *latency* (an allreduce of ``--small`` floats, no
work between them) and *work* (``--passes`` passes of ``sin`` over ``--large`` floats, then their
allreduce). Rank 0 prints per loop and way the median seconds per step over the rounds and the
ratio spin / sleep (above 1: sleeping is faster), and the process CPU seconds per
step. Run it with as many ranks as this host has cores and with more: the spin costs most where
the ranks and Horovod's background threads share cores (``wait``'s ``auto`` choice,
:func:`horovod_sparse.torch.waiting.strategy`, sleeps there).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="steps per loop and round")
    p.add_argument("--small", type=int, default=1000, help="floats of the latency loop's allreduce")
    p.add_argument("--large", type=int, default=200_000, help="floats of the work loop")
    p.add_argument("--passes", type=int, default=20, help="sin passes per step of the work loop")
    p.add_argument("--results", type=Path, help="also write the figures to this JSON file")
    return p


def loop(step: Callable[[], Any], steps: int) -> Dict[str, float]:
    """Seconds and process CPU seconds per step of ``steps`` calls of ``step``."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return {"seconds": (time.perf_counter() - start) / steps, "cpu": (time.process_time() - cpu) / steps}


def main(argv: Optional[Sequence[str]] = None) -> None:
    import horovod.torch as hvd
    import torch

    from benchmarks.shared.results import command_line, write_results
    from horovod_sparse.torch.waiting import poll_until_done

    args = parser().parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    def sleeping(handle: Any) -> Any:
        poll_until_done(handle, sleep=True)
        return hvd.synchronize(handle)

    ways = {"spin": hvd.synchronize, "sleep": sleeping}
    small, large = torch.ones(args.small), torch.rand(args.large)

    def latency(finish: Callable[[Any], Any]) -> Callable[[], Any]:
        return lambda: finish(hvd.allreduce_async(small, name="latency"))

    def work(finish: Callable[[Any], Any]) -> Callable[[], Any]:
        def step() -> Any:
            y = large
            for _ in range(args.passes):
                y = y.sin()
            return finish(hvd.allreduce_async(y, name="work"))
        return step

    loops = {"latency": latency, "work": work}
    measured: Dict[str, Dict[str, List[Dict[str, float]]]] = {name: {w: [] for w in ways} for name in loops}
    for round_ in range(args.rounds):
        order = list(ways) if round_ % 2 == 0 else list(reversed(list(ways)))
        for name, make in loops.items():
            for way in order:
                measured[name][way].append(loop(make(ways[way]), args.steps))
    if hvd.rank() != 0:
        return
    rows = [{"loop": name, "way": way, "seconds": statistics.median(r["seconds"] for r in runs),
             "cpu": statistics.median(r["cpu"] for r in runs)} for name, by_way in measured.items()
            for way, runs in by_way.items()]
    print(f"{hvd.size()} ranks, {args.rounds} rounds x {args.steps} steps; medians over rounds")
    print(f"{'loop':8} {'way':5} {'ms/step':>8} {'CPU ms/step':>12} {'spin/sleep':>10}")
    for row in rows:
        if row["way"] == "sleep":
            spin = next(r for r in rows if r["loop"] == row["loop"] and r["way"] == "spin")
            row["spin_over_sleep"] = spin["seconds"] / row["seconds"]
        ratio = f"{row['spin_over_sleep']:10.2f}" if "spin_over_sleep" in row else ""
        print(f"{row['loop']:8} {row['way']:5} {row['seconds'] * 1e3:8.3f} {row['cpu'] * 1e3:12.3f} {ratio}")
    if args.results:
        write_results(args.results, "waiting", {"ranks": hvd.size(), "rows": rows},
                      command_line(argv, "benchmarks.costs.waiting"))


if __name__ == "__main__":
    main()
