"""What a step's exchange costs the host, per method, beside the dense exchange and what users
would pick instead (issue 57).

    python -m benchmarks.costs.exchange_cost [--models resnet50 gpt2small] [--methods topk micro ...] \\
        [--front-ends ddp fsdp horovod] [--device cpu|cuda] [--steps 5] [--warmup 3] [--accelerator-paths] \\
        [--per-tensor topk ...] [--threads 1] [--results results/exchange_cost.json]

One process and a one-rank ``torch.distributed`` group (Gloo on the CPU, NCCL on ``--device
cuda``; :mod:`benchmarks.gpu_check` runs it there). Per model, its parameter list
(:mod:`benchmarks.shared.models`: ResNet-50's 161 tensors, 25.6 M parameters; the
GPT-2-small-sized transformer's, 124.4 M) is trained on the loss ``sum(p * p)``, so that only the
exchange differs between the rows of a front end and its backward costs next to nothing (the
gradient is ``2p``). Every method at density 0.001 with the front end's defaults. After
``--warmup`` steps (DDP builds its buckets in the first), per row: the operations dispatched in
one step (ATen operators, views included: each a kernel launch or a host-side call on a GPU),
their excess over the front end's dense row, that excess per bucket, the host milliseconds of a
step (until it returns; median of ``--steps``; ``--steps 0`` times none: the operations only)
and on a GPU the device milliseconds (until the device finished it, synchronised), each with its
ratio to dense. One rank: the collectives move nothing, so the figures are the work each
exchange adds to a step, the fixed cost issue 57 sets budgets for. ``--accelerator-paths`` runs
the methods' accelerator code on CPU tensors
(:func:`horovod_sparse.torch_core.selection.accelerator_paths`): the operations a GPU would
launch; without it, the CPU's own paths.

``ddp``: DDP with its defaults (25 MB buckets); dense is PyTorch's ``allreduce_hook`` (DDP's
allreduce as a hook), beside it PowerSGD at rank 4 and, on CUDA, ``bf16_compress_hook``
(:mod:`benchmarks.shared.ddp_baselines`), and every method's comm hook
(:mod:`horovod_sparse.ddp`); the operations are counted inside the hook (what DDP does around it
is the same in every row), ``buckets`` is the hook's calls in a step.

``fsdp``: FSDP2's ``fully_shard`` of the parameter list on a one-rank mesh (one FSDP unit, the
root, as ``fully_shard(model)`` alone makes), dense as FSDP2 reduces it, and every method through
:func:`horovod_sparse.fsdp.compress_replicas` on a one-rank replica group; the operations are
the whole step's (``zero_grad``, forward, backward, ``step``), the same scope in every row;
``buckets`` is the state's groups (one per unit).

``horovod``: the Horovod PyTorch optimizer's rows (``hs.DistributedOptimizer`` on one Horovod
process, ``hvd.init()`` without a launcher): its dense row is Horovod's own
``DistributedOptimizer``, each method's rows are the method's default grouping and, labelled
``@tensor``, one group per tensor (``groups="tensor"``, the default before flat buckets; for the
methods ``--per-tensor`` names, by default every one); the operations are the whole step's;
``buckets`` is the optimizer's groups.

``--threads``: the CPU's threads (one by default, for steady times; the operations' count does
not depend on it)."""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

MODELS = ("resnet50", "gpt2small")
#: The front ends whose rows the benchmark can count: DDP's comm hooks, FSDP2's replicas, the
#: Horovod optimizer.
FRONT_ENDS = ("ddp", "fsdp", "horovod")


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
    p.add_argument("--steps", type=int, default=5, help="steps timed per row (0: count the operations only)")
    p.add_argument("--warmup", type=int, default=3, help="steps before the measured ones")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (ddp and fsdp rows; NCCL)")
    p.add_argument("--accelerator-paths", action="store_true",
                   help="the methods' accelerator code on the CPU (the operations a GPU launches)")
    p.add_argument("--front-ends", nargs="+", choices=FRONT_ENDS, default=["ddp"],
                   help="ddp: the comm hooks; fsdp: FSDP2's replicas; horovod: the Horovod PyTorch optimizer, "
                        "default groups and per tensor")
    p.add_argument("--per-tensor", nargs="*", metavar="METHOD",
                   help="the methods with a one-group-per-tensor Horovod row (default: every one of --methods)")
    p.add_argument("--threads", type=int, default=1, help="the CPU's threads")
    p.add_argument("--results", type=Path, help="also write the rows to this JSON file")
    return p


def parameter_list(model: str, device: str) -> ParameterList:
    """``model``'s :class:`ParameterList` on ``device``, seeded."""
    from benchmarks.shared.models import model_spec

    torch.manual_seed(0)
    spec = model_spec(model)
    return ParameterList(spec.build(spec.default_size)).to(device)


def ddp_row(model: str, exchange: str, args: argparse.Namespace) -> Dict[str, Any]:
    """``exchange`` (``"dense"``, a :data:`~benchmarks.shared.ddp_baselines.BASELINE_HOOKS` name or
    a method) on ``model``'s parameter list under DDP: the operations its hook dispatched in one
    step, the hook's calls (the buckets) and the step's times (:func:`measured`)."""
    import horovod_sparse.ddp as hsd
    from benchmarks.shared.ddp_baselines import BASELINE_HOOKS
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    cuda = args.device.startswith("cuda")
    net = torch.nn.parallel.DistributedDataParallel(parameter_list(model, args.device))
    if exchange == "dense":
        hook_state, hook = None, default_hooks.allreduce_hook
    elif exchange in BASELINE_HOOKS:
        hook_state, hook = BASELINE_HOOKS[exchange](args.device)
    else:
        hook_state, hook = hsd.State(compression=hsd.Compression.create(exchange, density=0.001)), hsd.hook
    ops, calls = DispatchedOps(), []

    def counted(hook_state, bucket):  # type: ignore[no-untyped-def]  (DDP refuses string annotations)
        calls.append(bucket.index())
        with _paths(args), ops:
            return hook(hook_state, bucket)

    net.register_comm_hook(hook_state, counted)
    parameters = list(net.parameters())
    opt = torch.optim.SGD(parameters, lr=1e-6)

    def step() -> None:
        calls.clear()
        opt.zero_grad()
        net().backward()
        opt.step()

    figures = measured(step, ops, args)
    if exchange in BASELINE_HOOKS and not cuda:  # its callbacks ran on Gloo's threads, unseen by the counter
        figures["ops"] = None
    return {"model": model, "front_end": "ddp", "exchange": exchange, "parameters": sum(p.numel() for p in parameters),
            "tensors": len(parameters), **figures, "buckets": len(calls)}


def fsdp_row(model: str, exchange: str, args: argparse.Namespace) -> Dict[str, Any]:
    """``exchange`` (``"dense"`` or a method) on ``model``'s parameter list sharded by FSDP2 on a
    one-rank mesh, the root its one unit: the operations of one whole step, the state's groups
    (None for dense) and the step's times (:func:`measured`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import horovod_sparse.fsdp as hsf

    net = parameter_list(model, args.device)
    tensors = len(net.params)
    fully_shard(net, mesh=init_device_mesh(torch.device(args.device).type, (1,)))
    state = None
    if exchange != "dense":
        state = hsf.compress_replicas(net, hsf.Compression.create(exchange, density=0.001), dist.new_group([0]))
    figures = whole_steps(net, torch.optim.SGD(net.parameters(), lr=1e-6), args)
    return {"model": model, "front_end": "fsdp", "exchange": exchange,
            "parameters": sum(p.numel() for p in net.parameters()), "tensors": tensors, **figures,
            "buckets": None if state is None else len(state.last_stats.groups)}


def whole_steps(net: torch.nn.Module, opt: Any, args: argparse.Namespace) -> Dict[str, Any]:
    """:func:`measured` steps of ``net``'s loss through ``opt`` (``zero_grad``, forward, backward,
    ``step``), every operation of the step counted: the scope of the front ends that no hook
    holds (FSDP2's, the Horovod optimizer's)."""
    ops = DispatchedOps()

    def step() -> None:
        with _paths(args), ops:
            opt.zero_grad()
            net().backward()
            opt.step()

    return measured(step, ops, args)


def _paths(args: argparse.Namespace) -> ContextManager[None]:
    """The methods' accelerator paths where ``args.accelerator_paths`` asks for them."""
    from horovod_sparse.torch_core.selection import accelerator_paths

    return accelerator_paths() if args.accelerator_paths else contextlib.nullcontext()


def horovod_row(model: str, exchange: str, args: argparse.Namespace) -> Dict[str, Any]:
    """``exchange`` (``"dense"``: Horovod's own optimizer; a method, ``"method@tensor"`` for one
    group per tensor) on ``model``'s parameter list through the Horovod PyTorch optimizer: the
    operations of one whole step, its groups and the step's times (:func:`measured`)."""
    import horovod.torch as hvd

    import horovod_sparse.torch as hs

    net = parameter_list(model, args.device)
    sgd = torch.optim.SGD(net.parameters(), lr=1e-6)
    method, _, groups = exchange.partition("@")
    if method == "dense":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=net.named_parameters())
    else:
        opt = hs.DistributedOptimizer(sgd, named_parameters=net.named_parameters(), groups=groups or None,
                                      compression=hs.Compression.create(method, density=0.001))
    return {"model": model, "front_end": "horovod", "exchange": exchange,
            "parameters": sum(p.numel() for p in net.parameters()), "tensors": len(net.params),
            **whole_steps(net, opt, args), "buckets": None if method == "dense" else len(opt.groups)}


def measured(step: Callable[[], None], ops: DispatchedOps, args: argparse.Namespace) -> Dict[str, Any]:
    """``step`` run ``args.warmup`` times, then once with ``ops`` counted from zero, then
    ``args.steps`` times timed: that step's operations (``ops``), the median milliseconds until a
    step returned (``ms``, the host's; None for no step timed) and, on CUDA, until the device
    finished it (``device_ms``, synchronised; None elsewhere)."""
    cuda = args.device.startswith("cuda")
    for _ in range(args.warmup):
        step()
    ops.count = 0
    step()
    counted = ops.count
    host, device = [], []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        host.append(time.perf_counter() - began)
        if cuda:
            torch.cuda.synchronize()
            device.append(time.perf_counter() - began)
    return {"ops": counted, "ms": 1e3 * statistics.median(host) if host else None,
            "device_ms": 1e3 * statistics.median(device) if device else None}


def rows(models: Sequence[str], methods: Sequence[str], front_ends: Sequence[str],
         args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The ``ddp`` and ``fsdp`` rows of ``models`` (a one-rank default process group must be up),
    each front end's dense row first (DDP's then its baselines on ``args.device``), then every
    method's, with their excess over dense (:func:`compared`)."""
    from benchmarks.shared.ddp_baselines import baselines

    found = []
    for model in models:
        if "ddp" in front_ends:
            found += [ddp_row(model, exchange, args) for exchange in ["dense", *baselines(args.device), *methods]]
        if "fsdp" in front_ends:
            found += [fsdp_row(model, exchange, args) for exchange in ["dense", *methods]]
    return compared(found)


def compared(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each row beside its model's and front end's dense row: its excess operations, per bucket,
    and its times' ratios to dense's, written into the row; returns ``rows``."""
    for r in rows:
        dense = next(d for d in rows
                     if (d["model"], d["front_end"], d["exchange"]) == (r["model"], r["front_end"], "dense"))
        r["excess_ops"] = None if r["ops"] is None else r["ops"] - dense["ops"]
        r["excess_ops_per_bucket"] = None if not r["buckets"] or r["ops"] is None else r["excess_ops"] / r["buckets"]
        r["over_dense"] = None if r["ms"] is None else r["ms"] / dense["ms"]
        r["device_over_dense"] = None if r["device_ms"] is None else r["device_ms"] / dense["device_ms"]
    return rows


def table(rows: List[Dict[str, Any]]) -> List[str]:
    """The :func:`compared` rows as printed."""
    lines = [f"{'model':10} {'front end':9} {'exchange':14} {'ops/step':>9} {'+ops':>7} {'buckets':>7} "
             f"{'+ops/bucket':>11} {'host ms':>9} {'/ dense':>8} {'device ms':>9} {'/ dense':>8}"]
    for r in rows:
        per_bucket = "-" if r["excess_ops_per_bucket"] is None else f"{r['excess_ops_per_bucket']:.1f}"
        device = ("-", "-") if r["device_ms"] is None else (f"{r['device_ms']:.1f}", f"{r['device_over_dense']:.2f}")
        ops = ("-", "-") if r["ops"] is None else (f"{r['ops']:d}", f"{r['excess_ops']:+d}")
        host = ("-", "-") if r["ms"] is None else (f"{r['ms']:.1f}", f"{r['over_dense']:.2f}")
        lines.append(f"{r['model']:10} {r['front_end']:9} {r['exchange']:14} {ops[0]:>9} {ops[1]:>7} "
                     f"{r['buckets'] or '-':>7} {per_bucket:>11} {host[0]:>9} {host[1]:>8} "
                     f"{device[0]:>9} {device[1]:>8}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    from benchmarks.shared.results import command_line, write_results

    from benchmarks.shared.ddp_baselines import POWERSGD_START_ITER

    p = parser()
    args = p.parse_args(argv)
    if "ddp" in args.front_ends and args.warmup < POWERSGD_START_ITER:
        p.error(f"--warmup {args.warmup}: PowerSGD's first {POWERSGD_START_ITER} steps are dense; warm up at least "
                f"{POWERSGD_START_ITER}")
    if args.steps < 0 or args.threads < 1:
        p.error(f"--steps {args.steps} --threads {args.threads}: steps are 0 or more, threads 1 or more")
    if set(args.per_tensor or ()) - set(args.methods):
        p.error(f"--per-tensor {' '.join(args.per_tensor)}: name methods of --methods ({' '.join(args.methods)})")
    torch.set_num_threads(args.threads)
    found = []
    if {"ddp", "fsdp"} & set(args.front_ends):
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            found += rows(args.models, args.methods, args.front_ends, args)
        finally:
            dist.destroy_process_group()
    if "horovod" in args.front_ends:
        import horovod.torch as hvd

        hvd.init()
        per_tensor = args.methods if args.per_tensor is None else args.per_tensor
        found += compared([horovod_row(model, exchange, args) for model in args.models
                           for exchange in ["dense", *[f"{m}{grouping}" for m in args.methods
                                                       for grouping in ("", "@tensor")
                                                       if not grouping or m in per_tensor]]])
    first = {r["model"]: r for r in found}
    timed = f"medians of {args.steps} steps" if args.steps else "no step timed"
    for model, r in first.items():
        print(f"{model}: {r['parameters']:,} parameters in {r['tensors']} tensors, one rank on {args.device}, "
              f"{timed} after {args.warmup}, the methods' "
              f"{'accelerator' if args.accelerator_paths else 'own'} paths")
    print("\n".join(table(found)))
    if args.results:
        write_results(args.results, "exchange_cost", {"steps": args.steps, "warmup": args.warmup,
                                                      "device": args.device,
                                                      "accelerator_paths": args.accelerator_paths, "rows": found},
                      command_line(argv, "benchmarks.costs.exchange_cost"))


if __name__ == "__main__":
    main()
