"""Synthetic throughput in the format of Horovod's ``pytorch_synthetic_benchmark.py``, for any
horovod_sparse method:

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.emulated.synthetic \\
        --model vgg --batch-size 16 --compressor topk --density 0.001

prints Horovod's lines (``Model:``, ``Batch size:``, ``Number of CPUs:`` (GPUs on CUDA),
``Iter #i: x img/sec per CPU``, ``Img/sec per CPU: m +-c``, ``Total img/sec on N CPU(s): t +-c``)
and then the sparsification figures averaged over the timed steps, from the optimizer's
``last_stats``: union density and density ratio, payload bytes per step per worker (against the
dense gradient), and the time of each phase (selection, communication wait, ...).

``--compressor`` takes any name of ``horovod_sparse.torch.Compression.names()``, optionally with
method options (``--compressor topk:min_numel=0``); ``--density`` sets the density of a sparse
method. ``--optimizer stock`` runs Horovod's own ``hvd.DistributedOptimizer`` (``none``/``fp16``),
``--optimizer local`` trains without any exchange: the compute-only baseline of the scaling
efficiency. ``--sweep FILE`` runs a JSON list of configurations in one launch, each object
overriding options by their long names, e.g. ``[{"compressor": "none"}, {"compressor": "topk",
"density": 0.01}]``. ``--hierarchical`` (``"hierarchical": true`` in a sweep) runs a sparse
method's two-tier exchange (``hierarchical=True``: dense inside a host, the method across hosts;
:mod:`horovod_sparse.common.tiers`); the job then starts Horovod with dynamic process sets, and
its summary splits the bytes sent by tier (``node``: inside the host; the rest across hosts).
``--framework tensorflow`` runs the same benchmark on the Keras
counterparts of the models through ``horovod_sparse.tensorflow.DistributedGradientTape``
(:mod:`benchmarks.emulated.synthetic_tf`). :mod:`benchmarks.emulated.synthetic_ddp` is the same benchmark on PyTorch
DDP (dense, PowerSGD and every method as a comm hook); the pieces every front end shares are in
:mod:`benchmarks.emulated.synthetic_harness`.
"""
from __future__ import annotations

import argparse
import importlib
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmarks.emulated.synthetic_harness import (benchmark_parser, check_stock, compressor_options, configurations,
                                                   describe, measure, run_all, topology, wants_process_sets)
from benchmarks.shared.models import count_parameters, model_spec
from benchmarks.shared.results import command_line
from horovod_sparse.common import registry

OPTIMIZERS = ("hs", "stock", "local")


def parse_groups(text: Optional[str]) -> Any:
    """``--groups``: an int (Horovod's ``groups=N``), ``tensor``, ``model``, or ``buckets`` /
    ``buckets:M`` (flat buckets of at most 25 or ``M`` MiB); None by default."""
    if text is None or text in ("tensor", "model") or text.startswith("buckets"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--groups must be an int, 'tensor', 'model', 'buckets' or 'buckets:M', "
                                         f"got {text!r}") from None


def available_methods() -> List[str]:
    """Every registered sparsification method (each runs in both frameworks)."""
    importlib.import_module("horovod_sparse.methods")  # registers them
    return registry.method_names()


def build_optimizer(model: Any, config: argparse.Namespace, size: int) -> Any:
    """SGD at Horovod's benchmark learning rate, wrapped as ``config.optimizer`` asks (``hs``:
    two-tier with ``config.hierarchical``; ``stock``: see :func:`benchmarks.emulated.synthetic_harness.check_stock`)."""
    import horovod.torch as hvd
    import torch

    import horovod_sparse.torch as hs

    base = torch.optim.SGD(model.parameters(), lr=0.01 * size)
    if config.optimizer == "local":
        return base
    name, options = compressor_options(config.compressor, config.density)
    if config.optimizer == "stock":
        check_stock(config, name)
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        compression=getattr(hvd.Compression, name), groups=config.groups)
    return hs.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=hs.Compression.create(name, **options), groups=config.groups,
                                   hierarchical=config.hierarchical)


def run_torch(config: argparse.Namespace, log: Callable[[str], None]) -> Dict[str, Any]:
    """One benchmark: Horovod's warm-up and timed iterations; returns the figures (all ranks)."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    cuda = not config.no_cuda and torch.cuda.is_available()
    device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
    spec = model_spec(config.model)
    size = config.size or spec.default_size
    torch.manual_seed(config.seed)
    model = spec.build(size).to(device)
    optimizer = build_optimizer(model, config, hvd.size())
    if config.optimizer != "local":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(config.seed + hvd.rank())
    data, target = (t.to(device) for t in spec.batch(config.batch_size, size, generator))

    log(f"Hosts: {hvd.cross_size()} x {hvd.local_size()} workers")

    def benchmark_step() -> Optional[Any]:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        return getattr(optimizer, "last_stats", None)

    figures = measure(config, benchmark_step, hvd.size(), "GPU" if cuda else "CPU", describe(config),
                      count_parameters(model), log)
    name, options = compressor_options(config.compressor, config.density)
    return {"framework": "torch", "frontend": "horovod", "size": size, "optimizer": config.optimizer,
            "compressor": name, "options": options, "groups": config.groups,
            **topology(config, hvd, getattr(optimizer, "tiers", None)), **figures}


def parser() -> argparse.ArgumentParser:
    p = benchmark_parser(__doc__, "none, fp16 or a registered method, optionally NAME:key=value,... ")
    p.add_argument("--framework", choices=("torch", "tensorflow"), default="torch",
                   help="tensorflow: benchmarks.emulated.synthetic_tf, the same benchmark with "
                        "horovod_sparse.tensorflow")
    p.add_argument("--no-cuda", action="store_true", help="disable CUDA training")
    p.add_argument("--groups", type=parse_groups, help="grouping: an int, 'tensor', 'model', 'buckets' or 'buckets:M'")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="hs",
                   help="hs: horovod_sparse's optimizer; stock: hvd.DistributedOptimizer; local: no exchange")
    p.add_argument("--hierarchical", action="store_true",
                   help="hs: the two-tier exchange (dense inside a host, the method across hosts)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parser().parse_args(argv)
    if args.framework == "tensorflow":
        import horovod.tensorflow as hvd

        from benchmarks.emulated.synthetic_tf import run
    else:
        import horovod.torch as hvd
        import torch

        torch.set_num_threads(1)
        run = run_torch
    hvd.init(process_sets="dynamic" if wants_process_sets(configurations(args)) else None)
    run_all(args, run, hvd.rank(), "synthetic", command_line(argv, "benchmarks.emulated.synthetic"))


if __name__ == "__main__":
    main()
