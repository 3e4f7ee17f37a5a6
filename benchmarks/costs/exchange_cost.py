"""What a step's exchange costs the host, per method, beside the dense exchange (issue 57).

    python -m benchmarks.costs.exchange_cost [--models resnet50 gpt2small] [--methods topk micro ...] \\
        [--front-ends ddp horovod] [--steps 5] [--warmup 3] [--accelerator-paths] \\
        [--results results/exchange_cost.json]

One process and a one-rank ``torch.distributed`` Gloo group on the CPU (a GPU's figures come from
:mod:`benchmarks.gpu_check`). Per model, its parameter list (:mod:`benchmarks.shared.models`: ResNet-50's
161 tensors, 25.6 M parameters; the GPT-2-small-sized transformer's, 124.4 M) is trained on the
loss ``sum(p * p)`` through DDP with its defaults (25 MB buckets), so that only the exchange
differs between the rows: dense (PyTorch's ``allreduce_hook``, DDP's allreduce as a hook) and every
method's comm hook (:mod:`horovod_sparse.ddp`, density 0.001, its defaults). After ``--warmup``
steps (DDP builds its buckets in the first), per row: the operations its comm hook dispatches per
step, counted inside the hook (ATen operators, views included: each a kernel launch or a host-side
call on a GPU; what DDP does around the hook is the same in every row and not counted), their
excess over the dense hook's, that excess per bucket, and the host milliseconds of the whole step
(median of ``--steps``) with its ratio to dense. One rank: the collectives move nothing, so the
figures are the work each method adds to a step, the fixed cost issue 57 sets budgets for.
PowerSGD is timed beside them by :mod:`benchmarks.gpu_check` (``steps``). ``--accelerator-paths``
runs the methods' accelerator code on the CPU tensors (:func:`horovod_sparse.torch_core.selection.accelerator_paths`):
the operations a GPU would launch; without it, the CPU's own paths.

``--front-ends horovod`` adds the Horovod PyTorch optimizer's rows (``hs.DistributedOptimizer`` on
one Horovod process, ``hvd.init()`` without a launcher): its dense row is Horovod's own
``DistributedOptimizer``, each method's rows are the method's default grouping and, labelled
``@tensor``, one group per tensor (``groups="tensor"``, the default before flat buckets). There
no hook holds the exchange, so the operations counted are the whole step's (``zero_grad``,
backward with its gradient hooks, ``step``), the same scope in every row of that front end: the
excess over its dense row is the exchange's; ``buckets`` is the optimizer's groups.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

MODELS = ("resnet50", "gpt2small")
#: The front ends whose rows the benchmark can count: DDP's comm hooks, the Horovod optimizer.
FRONT_ENDS = ("ddp", "horovod")


class ParameterList(torch.nn.Module):
    """A model's parameters, in its order, whose forward is the loss ``sum(p * p)``: DDP buckets
    them as the model's and its backward costs next to nothing (the gradient is ``2p``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList([p for p in model.parameters() if p.requires_grad])

    def forward(self) -> torch.Tensor:
        return torch.stack([(p * p).sum() for p in self.params]).sum()


class DispatchedOps(TorchDispatchMode):
    """``with DispatchedOps() as ops: ...``; then ``ops.count``: the operations dispatched to
    kernels (ATen operators, views included), each a kernel launch or a bookkeeping call on a GPU:
    what a step costs the host beyond its kernels' own time (also the tests' count,
    ``tests/support/host_reads.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Tuple[type, ...], args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def parser() -> argparse.ArgumentParser:
    import horovod_sparse.methods  # noqa: F401  (registers the methods)
    from horovod_sparse.common.registry import method_names

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--methods", nargs="+", default=list(method_names()), help="the methods' hooks to time")
    p.add_argument("--steps", type=int, default=5, help="steps measured per row")
    p.add_argument("--warmup", type=int, default=3, help="steps before the measured ones")
    p.add_argument("--accelerator-paths", action="store_true",
                   help="the methods' accelerator code on the CPU (the operations a GPU launches)")
    p.add_argument("--front-ends", nargs="+", choices=FRONT_ENDS, default=["ddp"],
                   help="ddp: the comm hooks; horovod: the Horovod PyTorch optimizer, default groups and per tensor")
    p.add_argument("--results", type=Path, help="also write the rows to this JSON file")
    return p


def ddp_row(model: str, exchange: str, args: argparse.Namespace) -> Dict[str, Any]:
    """``exchange`` (``"dense"`` or a method) on ``model``'s parameter list under DDP: the
    operations its hook dispatched in one step, its buckets (a method's groups; None for dense)
    and the median host seconds of ``args.steps`` steps."""
    import horovod_sparse.ddp as hsd
    from horovod_sparse.torch_core.selection import accelerator_paths
    from benchmarks.shared.models import model_spec

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    spec = model_spec(model)
    net = torch.nn.parallel.DistributedDataParallel(ParameterList(spec.build(spec.default_size)))
    state = None
    if exchange == "dense":
        hook_state, hook = None, default_hooks.allreduce_hook
    else:
        hook_state = state = hsd.State(compression=hsd.Compression.create(exchange, density=0.001))
        hook = hsd.hook
    ops = DispatchedOps()

    def counted(hook_state, bucket):  # type: ignore[no-untyped-def]  (DDP refuses string annotations)
        with accelerator_paths() if args.accelerator_paths else contextlib.nullcontext(), ops:
            return hook(hook_state, bucket)

    net.register_comm_hook(hook_state, counted)
    parameters = list(net.parameters())
    opt = torch.optim.SGD(parameters, lr=1e-6)

    def step() -> None:
        opt.zero_grad()
        net().backward()
        opt.step()

    counted_ops, seconds = measured(step, ops, args)
    buckets = None if state is None or state.last_stats is None else len(state.last_stats.groups)
    return {"model": model, "front_end": "ddp", "exchange": exchange, "parameters": sum(p.numel() for p in parameters),
            "tensors": len(parameters), "ops": counted_ops, "buckets": buckets, "ms": seconds}


def horovod_row(model: str, exchange: str, args: argparse.Namespace) -> Dict[str, Any]:
    """``exchange`` (``"dense"``: Horovod's own optimizer; a method, ``"method@tensor"`` for one
    group per tensor) on ``model``'s parameter list through the Horovod PyTorch optimizer: the
    operations of one whole step, its groups and the median host seconds of ``args.steps`` steps."""
    import horovod.torch as hvd

    import horovod_sparse.torch as hs
    from horovod_sparse.torch_core.selection import accelerator_paths
    from benchmarks.shared.models import model_spec

    torch.manual_seed(0)
    spec = model_spec(model)
    net = ParameterList(spec.build(spec.default_size))
    sgd = torch.optim.SGD(net.parameters(), lr=1e-6)
    method, _, groups = exchange.partition("@")
    if method == "dense":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=net.named_parameters())
    else:
        opt = hs.DistributedOptimizer(sgd, named_parameters=net.named_parameters(), groups=groups or None,
                                      compression=hs.Compression.create(method, density=0.001))
    ops = DispatchedOps()

    def step() -> None:
        with accelerator_paths() if args.accelerator_paths else contextlib.nullcontext(), ops:
            opt.zero_grad()
            net().backward()
            opt.step()

    counted_ops, seconds = measured(step, ops, args)
    buckets = None if method == "dense" else len(opt.groups)
    return {"model": model, "front_end": "horovod", "exchange": exchange,
            "parameters": sum(p.numel() for p in net.parameters()), "tensors": len(net.params), "ops": counted_ops,
            "buckets": buckets, "ms": seconds}


def measured(step: Callable[[], None], ops: DispatchedOps, args: argparse.Namespace) -> Tuple[int, float]:
    """``step`` run ``args.warmup`` times, then once with ``ops`` counted from zero, then
    ``args.steps`` times timed: the count of that step and the median milliseconds."""
    for _ in range(args.warmup):
        step()
    ops.count = 0
    step()
    counted_ops = ops.count
    seconds = []
    for _ in range(args.steps):
        began = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - began)
    return counted_ops, 1e3 * statistics.median(seconds)


def table(rows: List[Dict[str, Any]]) -> List[str]:
    """The rows as printed, each beside its model's and front end's dense row (excess operations,
    per bucket, time ratio); the ratios are written into the rows too."""
    lines = [f"{'model':10} {'front end':9} {'exchange':14} {'ops/step':>9} {'+ops':>7} {'buckets':>7} "
             f"{'+ops/bucket':>11} {'host ms':>9} {'/ dense':>8}"]
    for r in rows:
        dense = next(d for d in rows
                     if (d["model"], d["front_end"], d["exchange"]) == (r["model"], r["front_end"], "dense"))
        r["excess_ops"] = r["ops"] - dense["ops"]
        r["excess_ops_per_bucket"] = None if not r["buckets"] else r["excess_ops"] / r["buckets"]
        r["over_dense"] = r["ms"] / dense["ms"]
        per_bucket = "-" if r["excess_ops_per_bucket"] is None else f"{r['excess_ops_per_bucket']:.1f}"
        lines.append(f"{r['model']:10} {r['front_end']:9} {r['exchange']:14} {r['ops']:9d} {r['excess_ops']:+7d} "
                     f"{r['buckets'] or '-':>7} {per_bucket:>11} {r['ms']:9.1f} {r['over_dense']:8.2f}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    from benchmarks.shared.results import command_line, write_results

    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    if "ddp" in args.front_ends:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            rows += [ddp_row(model, exchange, args) for model in args.models for exchange in ["dense", *args.methods]]
        finally:
            dist.destroy_process_group()
    if "horovod" in args.front_ends:
        import horovod.torch as hvd

        hvd.init()
        rows += [horovod_row(model, exchange, args) for model in args.models
                 for exchange in ["dense", *[f"{m}{grouping}" for m in args.methods for grouping in ("", "@tensor")]]]
    first = {r["model"]: r for r in rows}
    for model, r in first.items():
        print(f"{model}: {r['parameters']:,} parameters in {r['tensors']} tensors, one rank, "
              f"medians of {args.steps} steps after {args.warmup}, the methods' "
              f"{'accelerator' if args.accelerator_paths else 'CPU'} paths")
    print("\n".join(table(rows)))
    if args.results:
        write_results(args.results, "exchange_cost", {"steps": args.steps, "warmup": args.warmup,
                                                      "accelerator_paths": args.accelerator_paths, "rows": rows},
                      command_line(argv, "benchmarks.costs.exchange_cost"))


if __name__ == "__main__":
    main()
