"""What FSDP2's hook point costs the replica exchange in overlap: each unit's exchange blocks the
backward pass (``FSDPModule.set_all_reduce_hook`` returns no future), measured per step against
the same exchanges run beside the backward pass.

    torchrun --standalone --nproc-per-node 4 -m benchmarks.costs.fsdp_overlap \\
        --model vgg --batch-size 16 --shard-size 2 --compressors topk:density=0.001 micro:density=0.001
    python -m benchmarks.costs.fsdp_overlap --emulate 1gbit --workers 4 --shard-size 2 ...   # root

For each ``--compressors`` entry a fresh model is sharded as :mod:`benchmarks.emulated.synthetic_fsdp`
shards it and its replicas exchanged by :mod:`horovod_sparse.fsdp`; every unit's exchange is
timed inside its hook (start, end) and the backward pass around them. A step's backward pass is
then compute segments (before the first hook, between hooks, after the last) and the blocking
exchanges between them. Had the hook returned a future, the exchanges would have run one after
the other beside the compute (each starting when its unit's gradient is ready and the previous
exchange is done) and the backward pass would end when both had: that *overlapped* time is
simulated from the measured segments. *Lost overlap* = measured backward - overlapped: the time
an asynchronous hook point could save at most (at most: on shared CPU cores an exchange beside
the compute also slows it). Medians over ``--steps`` steps after ``--warmup`` steps; rank 0
prints one row per compressor and writes them with ``--results``. ``--emulate RATE`` (root)
runs the job itself across an emulated cluster (:mod:`benchmarks.emulated.netem`) of ``--workers``
workers, hosts of ``--shard-size``, their links shaped to ``RATE``: the replicas then exchange
across the shaped links, as HSDP's replicas do across nodes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: One step's backward pass: (start, end) of the pass and of every exchange in it, in order.
Timing = Tuple[float, float, List[Tuple[float, float]]]


def overlapped(timing: Timing) -> float:
    """Seconds the backward pass of ``timing`` would take with each exchange running beside the
    compute that follows its hook (one exchange at a time, in hook order)."""
    start, end, exchanges = timing
    compute_at, link_free, previous = 0.0, 0.0, start
    for began, finished in exchanges:
        compute_at += began - previous  # the compute before this hook
        link_free = max(link_free, compute_at) + (finished - began)
        previous = finished
    compute_at += end - previous
    return max(compute_at, link_free)


def summary(label: str, timings: Sequence[Timing], steps: Sequence[float]) -> Dict[str, Any]:
    """The row of one compressor: medians over the steps of the step, the backward pass, the
    exchanges' blocking time, the overlapped backward pass and the lost overlap (seconds)."""
    backward = [end - start for start, end, _ in timings]
    blocking = [sum(b - a for a, b in exchanges) for _, _, exchanges in timings]
    simulated = [overlapped(t) for t in timings]
    lost = [b - s for b, s in zip(backward, simulated)]
    return {"compressor": label, "units": len(timings[0][2]), "step": statistics.median(steps),
            "backward": statistics.median(backward), "exchanges": statistics.median(blocking),
            "overlapped_backward": statistics.median(simulated), "lost_overlap": statistics.median(lost),
            "lost_share_of_step": statistics.median(x / s for x, s in zip(lost, steps))}


def measure(args: argparse.Namespace, spec_text: str, mesh: Any) -> Dict[str, Any]:
    """Train a fresh model with ``spec_text``'s replica exchange; the row (all ranks)."""
    import torch
    import torch.nn.functional as F

    import horovod_sparse.fsdp as hsf
    from benchmarks.emulated.synthetic_fsdp import shard
    from benchmarks.emulated.synthetic_harness import compressor_options, spec_label
    from benchmarks.shared.models import model_spec

    spec = model_spec(args.model)
    size = args.size or spec.default_size
    torch.manual_seed(args.seed)
    model = spec.build(size)
    shard(model, mesh["shard"])
    name, options = compressor_options(spec_text, None)
    state = hsf.compress_replicas(model, hsf.Compression.create(name, **options), mesh=mesh)
    exchanges: List[Tuple[float, float]] = []
    exchange = state.exchange

    def timed(unit: str, shard_grad: Any) -> None:
        began = time.perf_counter()
        exchange(unit, shard_grad)
        exchanges.append((began, time.perf_counter()))

    state.exchange = timed
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data, target = spec.batch(args.batch_size, size, torch.Generator().manual_seed(args.seed))
    timings: List[Timing] = []
    steps: List[float] = []
    for step in range(args.warmup + args.steps):
        exchanges.clear()
        began = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        backward = time.perf_counter()
        loss.backward()
        ended = time.perf_counter()
        optimizer.step()
        if step >= args.warmup:
            timings.append((backward, ended, list(exchanges)))
            steps.append(time.perf_counter() - began)
    return summary(spec_label(name, options), timings, steps)


def parser() -> argparse.ArgumentParser:
    from benchmarks.shared.models import MODELS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--size", type=int, help="image side (default: the model's)")
    p.add_argument("--shard-size", type=int, help="ranks sharding each unit (default: LOCAL_WORLD_SIZE)")
    p.add_argument("--compressors", nargs="+", default=["topk:density=0.001"],
                   help="horovod_sparse.fsdp compressors, NAME:key=value,...")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, help="write the rows as JSON here (rank 0)")
    p.add_argument("--emulate", metavar="RATE", help="run across an emulated cluster with links of RATE (root)")
    p.add_argument("--workers", type=int, default=4, help="--emulate: workers of the emulated cluster")
    return p


def emulate(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Run this benchmark's job (``argv`` without ``--emulate`` / ``--workers``) across an
    emulated cluster of ``args.workers`` workers in hosts of ``args.shard_size``, printing
    rank 0's lines."""
    from benchmarks.emulated.netem import EmulatedCluster, inner_argv, run_torch_distributed

    if not args.shard_size or args.workers % args.shard_size:
        raise SystemExit(f"--emulate needs --shard-size dividing --workers {args.workers} (the workers of a host)")
    with EmulatedCluster(args.workers, args.emulate, workers_per_host=args.shard_size) as cluster:
        run_torch_distributed(cluster, [sys.executable, "-m", "benchmarks.costs.fsdp_overlap", *inner_argv(argv)],
                              on_line=lambda line: print(line.rstrip("\n")))


def main(argv: Optional[Sequence[str]] = None) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.shared.results import command_line, write_results
    from horovod_sparse.ddp import exit_job

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.emulate:
        emulate(args, argv)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    workers = dist.get_world_size()
    shard_size = args.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", workers))
    if workers % shard_size:
        raise ValueError(f"--shard-size {shard_size} does not divide the {workers} workers")
    mesh = init_device_mesh("cpu", (workers // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
    rows = [measure(args, spec, mesh) for spec in args.compressors]
    if dist.get_rank() == 0:
        print(f"{args.model}, batch {args.batch_size}, {workers} ranks as {workers // shard_size} replicas x "
              f"{shard_size} shards; medians of {args.steps} steps, ms")
        print(f"{'compressor':28} {'units':>5} {'step':>8} {'backward':>9} {'exchanges':>9} {'overlapped':>10} "
              f"{'lost':>8} {'lost/step':>9}")
        for r in rows:
            print(f"{r['compressor']:28} {r['units']:5d} {1e3 * r['step']:8.1f} {1e3 * r['backward']:9.1f} "
                  f"{1e3 * r['exchanges']:9.1f} {1e3 * r['overlapped_backward']:10.1f} "
                  f"{1e3 * r['lost_overlap']:8.1f} {r['lost_share_of_step']:9.2f}")
        if args.results:
            write_results(args.results, "fsdp_overlap", {"model": args.model, "rows": rows},
                          command_line(argv, "benchmarks.costs.fsdp_overlap"))
    exit_job()


if __name__ == "__main__":
    main()
