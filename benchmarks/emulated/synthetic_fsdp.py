"""Synthetic throughput of FSDP2 (``fully_shard``) with its replicas averaged densely (FSDP's own
HSDP) or by a horovod_sparse method (:mod:`horovod_sparse.fsdp`), in the format of
:mod:`benchmarks.emulated.synthetic`:

    torchrun --standalone --nproc-per-node 4 -m benchmarks.emulated.synthetic_fsdp \\
        --model vgg --batch-size 16 --shard-size 2 --compressor micro --density 0.001

The job is a 2-D mesh (``replicate`` x ``shard``): ``--shard-size`` ranks shard each unit (a
node; ``LOCAL_WORLD_SIZE`` by default, as ``torchrun`` sets it), the other dimension replicates.
Every top-level child of the model with parameters is an FSDP unit, the model the root.
``--compressor none`` is FSDP's HSDP (``fully_shard`` on the 2-D mesh: reduce-scatter in the
shard group, dense all-reduce across replicas); any other name of
``horovod_sparse.fsdp.Compression.names()`` shards on the ``shard`` dimension only and exchanges
each unit's shard across replicas with that method. Prints the same lines as
:mod:`benchmarks.emulated.synthetic` (labels start with ``fsdp``) and writes rows with ``"frontend":
"fsdp"``. One process per CPU worker, one thread each; rank 0 prints.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import horovod_sparse.ddp as hsd
import horovod_sparse.fsdp as hsf
from benchmarks.emulated.synthetic_ddp import measure_training
from benchmarks.emulated.synthetic_harness import benchmark_parser, compressor_options, run_all, spec_label
from benchmarks.shared.models import count_parameters, model_spec
from benchmarks.shared.results import command_line


def describe(config: argparse.Namespace) -> str:
    """The label of a configuration, e.g. ``fsdp none`` or ``fsdp micro(density=0.001)``."""
    return "fsdp " + spec_label(*compressor_options(config.compressor, config.density))


def shard(model: torch.nn.Module, mesh: Any) -> None:
    """``fully_shard`` every top-level child with parameters, then the model, on ``mesh``."""
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_fsdp(config: argparse.Namespace, log: Callable[[str], None]) -> Dict[str, Any]:
    """One benchmark: :func:`benchmarks.emulated.synthetic_harness.measure` on the sharded model with the
    configuration's replica exchange; returns the figures (all ranks)."""
    workers = dist.get_world_size()
    shard_size = config.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", workers))
    if workers % shard_size:
        raise ValueError(f"--shard-size {shard_size} does not divide the {workers} workers")
    mesh = init_device_mesh("cpu", (workers // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
    spec = model_spec(config.model)
    size = config.size or spec.default_size
    torch.manual_seed(config.seed)
    model = spec.build(size)
    parameters = count_parameters(model)
    name, options = compressor_options(config.compressor, config.density)
    state: Optional[hsf.State] = None
    if name == "none":
        shard(model, mesh)
    else:
        shard(model, mesh["shard"])
        state = hsf.compress_replicas(model, hsf.Compression.create(name, **options), mesh["replicate"].get_group())
    figures = measure_training(config, model, lambda: None if state is None else state.last_stats, parameters,
                               describe(config), log)
    return {"framework": "torch", "frontend": "fsdp", "size": size, "optimizer": "fsdp", "compressor": name,
            "options": options, "shard_size": shard_size, **figures}


def parser() -> argparse.ArgumentParser:
    p = benchmark_parser(__doc__, "none (FSDP's HSDP: a dense all-reduce across replicas) or a "
                                  "horovod_sparse.fsdp compressor, optionally NAME:key=value,...")
    p.add_argument("--shard-size", type=int, help="ranks sharding each unit (default: LOCAL_WORLD_SIZE)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run_all(args, run_fsdp, dist.get_rank(), "synthetic_fsdp", command_line(argv, "benchmarks.emulated.synthetic_fsdp"))
    hsd.exit_job()


if __name__ == "__main__":
    main()
