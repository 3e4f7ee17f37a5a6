"""Synthetic throughput of PyTorch DDP (``torch.distributed`` over Gloo, no Horovod): dense DDP,
PyTorch's PowerSGD hook and every horovod_sparse method as a comm hook, in the format of
:mod:`benchmarks.emulated.synthetic`:

    torchrun --standalone --nproc-per-node 2 -m benchmarks.emulated.synthetic_ddp \\
        --model vgg --batch-size 16 --compressor micro --density 0.001

prints the same lines (``Model:``, ``Batch size:``, ``Number of CPUs:``, ``Compressor: <label>``,
``Iter #i: x img/sec per CPU``, ``Img/sec per CPU: m +-c``, ``Total img/sec on N CPU(s): t +-c``,
then the sparsification figures) and writes result rows of the same shape with ``"frontend":
"ddp"`` and ``"optimizer": "ddp"``; labels start with ``ddp``.

``--compressor``: ``none`` is DDP's own bucket allreduce (no comm hook); ``powersgd`` is
PyTorch's ``powerSGD_hook`` (``powersgd:rank=R``, matrix approximation rank R, 4 by default, with
error feedback and warm start, one bucket after another as on Gloo
(:func:`benchmarks.shared.ddp_baselines.serial_powersgd_hook`); its first :data:`POWERSGD_START_ITER` steps are dense
allreduces, so they must fall in ``--num-warmup-batches``); any other name of
``horovod_sparse.ddp.Compression.names()`` (``fp16`` and every method, options as in
:mod:`benchmarks.emulated.synthetic`) runs through ``horovod_sparse.ddp.hook``, whose first step is dense
(DDP builds its final buckets then). ``--sweep FILE`` and ``--results FILE`` as in
:mod:`benchmarks.emulated.synthetic`. One process per CPU worker, one thread each; DDP's buckets (25 MB)
are the groups. Rank 0 prints.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import horovod_sparse.ddp as hsd
from benchmarks.emulated.synthetic_harness import benchmark_parser, compressor_options, measure, run_all, spec_label
from benchmarks.shared.ddp_baselines import (POWERSGD_RANK, POWERSGD_START_ITER,  # noqa: F401  (cluster's too)
                                             SerialPowerSGDState, powersgd_baseline)
from benchmarks.shared.models import count_parameters, model_spec
from benchmarks.shared.results import command_line
from horovod_sparse.common.registry import parse_spec

#: ``--compressor`` name of PyTorch's PowerSGD hook.
POWERSGD = "powersgd"


Hook = Union[None, SerialPowerSGDState, hsd.State]


def ddp_compressor(spec: str, density: Optional[float]) -> Tuple[str, Dict[str, Any]]:
    """``(name, options)`` of a ``--compressor`` spec: ``powersgd`` with its ``rank`` (the only
    option it takes; ``density`` does not apply), else
    :func:`benchmarks.emulated.synthetic_harness.compressor_options`."""
    name, options = parse_spec(spec)
    if name != POWERSGD:
        return compressor_options(spec, density)
    unknown = set(options) - {"rank"}
    if unknown:
        raise ValueError(f"--compressor {spec!r}: powersgd takes only rank=R, not {sorted(unknown)}")
    return name, {"rank": POWERSGD_RANK, **options}


def describe(config: argparse.Namespace) -> str:
    """The label of a configuration, e.g. ``ddp none``, ``ddp powersgd(rank=4)`` or
    ``ddp micro(density=0.001)``."""
    return "ddp " + spec_label(*ddp_compressor(config.compressor, config.density))


def register_hook(ddp: DistributedDataParallel, name: str, options: Dict[str, Any],
                  warmup_batches: int) -> Hook:
    """Register the comm hook of compressor ``name`` on ``ddp`` (none for ``none``); returns
    its state. Raises ``ValueError`` when PowerSGD's dense start would reach the timed steps."""
    if name == "none":
        return None
    if name == POWERSGD:
        if warmup_batches < POWERSGD_START_ITER:
            raise ValueError(f"powersgd allreduces its first {POWERSGD_START_ITER} steps densely: "
                             f"--num-warmup-batches must be at least {POWERSGD_START_ITER}")
        state, hook = powersgd_baseline("cpu", rank=options["rank"])  # Gloo: one bucket after another
        ddp.register_comm_hook(state, hook)
        return state
    state = hsd.State(compression=hsd.Compression.create(name, **options))
    ddp.register_comm_hook(state, hsd.hook)
    return state


def powersgd_stats(state: SerialPowerSGDState, parameters: int) -> Dict[str, Any]:
    """What PowerSGD allreduced per compressed step per worker (its factors and the tensors it
    leaves whole, float32), from its own counters, against the dense gradient."""
    steps = state.iter - state.start_powerSGD_iter
    return {"bytes_sent": 4 * state.total_numel_after_compression / steps, "dense_bytes": 4 * parameters,
            "compression_rate": state.total_numel_before_compression / state.total_numel_after_compression}


def measure_training(config: argparse.Namespace, net: torch.nn.Module, last_stats: Callable[[], Optional[Any]],
                     parameters: int, label: str, log: Callable[[str], None]) -> Dict[str, Any]:
    """:func:`benchmarks.emulated.synthetic_harness.measure` of SGD training steps of ``net`` (a model wrapped by a
    ``torch.distributed`` front end) on the configuration's fixed batch, each step returning
    ``last_stats()`` (the front end's statistics, or None)."""
    rank, workers = dist.get_rank(), dist.get_world_size()
    spec = model_spec(config.model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01 * workers)
    data, target = spec.batch(config.batch_size, config.size or spec.default_size,
                              torch.Generator().manual_seed(config.seed + rank))

    def benchmark_step() -> Optional[Any]:
        optimizer.zero_grad()
        F.cross_entropy(net(data), target).backward()
        optimizer.step()
        return last_stats()

    return measure(config, benchmark_step, workers, "CPU", label, parameters, log)


def run_ddp(config: argparse.Namespace, log: Callable[[str], None]) -> Dict[str, Any]:
    """One benchmark: :func:`benchmarks.emulated.synthetic_harness.measure` on a DDP model with the configuration's
    hook; returns the figures (all ranks)."""
    spec = model_spec(config.model)
    size = config.size or spec.default_size
    torch.manual_seed(config.seed)
    model = spec.build(size)
    parameters = count_parameters(model)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters
    name, options = ddp_compressor(config.compressor, config.density)
    state = register_hook(ddp, name, options, config.num_warmup_batches)
    figures = measure_training(config, ddp, lambda: state.last_stats if isinstance(state, hsd.State) else None,
                               parameters, describe(config), log)
    if isinstance(state, SerialPowerSGDState):
        figures["stats"] = powersgd_stats(state, parameters)
        log(f"PowerSGD: {figures['stats']['bytes_sent'] / 1e6:.2f} MB sent per step per worker "
            f"(dense gradient {4 * parameters / 1e6:.1f} MB), compression {figures['stats']['compression_rate']:.0f}x")
    return {"framework": "torch", "frontend": "ddp", "size": size, "optimizer": "ddp", "compressor": name,
            "options": options, **figures}


def parser() -> argparse.ArgumentParser:
    return benchmark_parser(__doc__, "none (DDP's allreduce), powersgd[:rank=R] (PyTorch's hook) or a "
                                     "horovod_sparse.ddp compressor, optionally NAME:key=value,...")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run_all(args, run_ddp, dist.get_rank(), "synthetic_ddp", command_line(argv, "benchmarks.emulated.synthetic_ddp"))
    hsd.exit_job()


if __name__ == "__main__":
    main()
