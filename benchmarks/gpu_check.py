"""The GPU check: what a first run on a GPU must show, with PyTorch alone (no Horovod needed).

    python -m benchmarks.gpu_check --results results/gpu_check.json          # on a GPU machine
    python -m benchmarks.gpu_check --device cpu --quick                     # its CPU parts (CI)

One process, a one-rank ``torch.distributed`` group (NCCL on CUDA, Gloo on CPU), so the method
code and the DDP hook run on the device as in a job. Its parts, each printed and written to
``--results``:

* ``methods``: every method through the DDP comm hook on ``--device`` and on the CPU, on the same
  given gradients (two buckets, a few steps): the same coordinates selected every step, the
  aggregated values within the dtype's rounding (``max_rel_diff``), and the last step's
  ``select`` phase as the statistics report it (``select_ms``: CUDA events on a GPU).
* ``amp``: a ``GradScaler`` on the device with float16 autocast whose first steps overflow, DDP's
  own allreduce against the hook of every method with ``loss_scaler=``: the same skipped steps and
  scales until the first applied step, finite parameters after.
* ``fsdp``: every method through the FSDP2 front end (:mod:`horovod_sparse.fsdp`) on a one-rank
  mesh of ``--device`` and of the CPU, on the same given gradients: the same coordinates every
  step, values within rounding.
* ``layout``: ``channels_last`` and transposed parameters on the device, their gradients
  published from a group's flat buffer (:class:`horovod_sparse.torch_core.buffers.FlatGroup`) and
  stepped by fused AdamW: the gradients keep the parameters' strides, and the parameters equal a
  contiguous run's.
* ``syncs``: on CUDA, the host synchronisations of one sparse step of each method, counted by
  ``torch.cuda.set_sync_debug_mode("warn")`` (None on the CPU, which has none to count).
* ``steps``: real models (``--model``: ResNet-50 at batch 64 and a GPT-2-small-sized transformer
  at batch 8 of 1,024 tokens by default; ResNet-20 with ``--quick``), each trained
  through DDP on the device, dense (DDP's own allreduce), with what users would pick instead
  (PyTorch's ``bf16_compress_hook``, on CUDA; PowerSGD at rank 4, on the CPU one bucket after
  another: :mod:`benchmarks.shared.ddp_baselines`) and with every method's hook, bf16
  autocast on CUDA: the median step time of ``--train-steps`` steps (device synchronised) and
  its ratio to dense (and dense and Top-k with DDP's ``gradient_as_bucket_view=True``). One
  rank, so the exchange itself is trivial: the figures are what each method adds to a step
  (selection, packing, bookkeeping), not a network's saving. From them, per method, the
  *break-even link* on :data:`BREAK_EVEN_WORKERS` ranks (:func:`break_even`): the bandwidth
  below which its step beats a dense bf16 ring all-reduce
  (:func:`horovod_sparse.common.cost_model.break_even_link`), from its added time (its step
  minus the dense step, floored at 0) and the bytes its last step sent, priced by its own
  collectives (:mod:`benchmarks.emulated.wire`).
* ``fsdp_steps``: the first of those models sharded by FSDP2 on a one-rank mesh, plain and with
  every method through :func:`horovod_sparse.fsdp.compress_replicas`: the median step time and
  its ratio to the plain one (:func:`fsdp_step_times`).
* ``exchange_cost``: :mod:`benchmarks.costs.exchange_cost`'s rows of those models' parameter lists
  on the device, DDP's (dense, its baselines, every method) and FSDP2's (dense, every method):
  per row the operations dispatched in a step, the host and the device milliseconds, their
  ratios to dense (:func:`exchange_costs`).
* ``profile``: ``torch.profiler`` over three such steps, dense and with ``--profile``'s method
  (Top-k by default): per step, the host and device time of every operation, and the 20
  operations whose host time the hook grew most (a figure to read, not asserted).
* ``selection``: on the device, a read pass (``x.sum()``), ``torch.topk(x.abs(), k)``, the exact
  top-k of the methods (:func:`horovod_sparse.torch_core.top_k.top_k`) and the selections of
  the hard threshold, Gaussian-k, DGC and MiCRO as their exchanges run them there (capacity 2k)
  over float32 buffers of each of ``--numel`` elements (25.6M and 100M) at ``k = density * numel``
  for each of ``--density`` (0.001 and 0.01) (medians of ``--repeats``, each timed with the
  device synchronised; ratios to the read pass).

The check exits non-zero if a correctness part fails (``methods``, ``amp``, ``fsdp``,
``layout``); the ``syncs``, ``steps``, ``fsdp_steps``, ``exchange_cost``, ``profile`` and
``selection`` figures are measurements to report.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import horovod_sparse.ddp as hsd
from benchmarks.costs import exchange_cost
from benchmarks.emulated.wire import Payload, wire_law
from benchmarks.shared.ddp_baselines import BASELINE_HOOKS, baselines
from benchmarks.shared.models import model_spec
from benchmarks.shared.results import command_line, write_results
from horovod_sparse.common.cost_model import BF16_BYTES, INDEX_BYTES, VALUE_BYTES, break_even_link
from horovod_sparse.common.stats import StepStats
from horovod_sparse.torch_core.buffers import FlatGroup
from horovod_sparse.common.thresholds import scan_block_size
from horovod_sparse.torch_core.selection import accelerator_paths
from horovod_sparse.torch_core.top_k import top_k

SHAPES = [[64, 48], [48], [96, 64], [64], [9]]
#: Two buckets of about 3,000 float32 elements each for :data:`SHAPES`.
BUCKET_MB = 0.012
OPTIONS = {"density": 0.05, "min_numel": 0, "warmup_steps": 1}
STEPS = 4


class GivenGradients(torch.nn.Module):
    """A model whose gradient is what the caller passes: ``loss = sum(p * g)``."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(params)

    def forward(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.params, grads))


def given(step: int, device: str) -> List[torch.Tensor]:
    """The gradients of :data:`SHAPES` at ``step``: normal, with a scale per parameter."""
    generator = torch.Generator().manual_seed(step)
    return [(torch.randn(*shape, generator=generator) * 10.0 ** (i % 3 - 1)).to(device)
            for i, shape in enumerate(SHAPES)]


def hook_run(method: str, device: str) -> Tuple[List[List[torch.Tensor]], float]:
    """Every step's aggregated gradients (on the CPU) of ``method`` through the DDP hook, and
    the selection time of its last step (the statistics' ``select`` phase: CUDA events on a GPU)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, device=device)) for shape in SHAPES]
    ddp = torch.nn.parallel.DistributedDataParallel(GivenGradients(params), bucket_cap_mb=BUCKET_MB)
    state = hsd.State(compression=hsd.Compression.create(method, **OPTIONS))
    ddp.register_comm_hook(state, hsd.hook)
    steps = []
    for step in range(STEPS):
        for p in params:
            p.grad = None
        ddp(given(step, device)).backward()
        steps.append([p.grad.detach().cpu().clone() for p in params])
    assert state.last_stats is not None
    return steps, state.last_stats.seconds("select")


def check_methods(device: str) -> Dict[str, Any]:
    """Every method on ``device`` against the CPU: same selection, values within rounding."""
    results = {}
    for method in hsd.Compression.names():
        if method in ("none", "fp16"):
            continue
        (ours, select_seconds), (cpu, _) = hook_run(method, device), hook_run(method, "cpu")
        same = all(torch.equal(a != 0, b != 0) for step_a, step_b in zip(ours, cpu) for a, b in zip(step_a, step_b))
        diff = max(float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())
                   for step_a, step_b in zip(ours, cpu) for a, b in zip(step_a, step_b))
        results[method] = {"same_selection": same, "max_rel_diff": diff, "select_ms": select_seconds * 1e3,
                           "ok": same and diff <= 1e-5}
    return results


def amp_run(device: str, method: Optional[str], steps: int) -> List[Dict[str, Any]]:
    """A float16-autocast regression trained through DDP (``method``'s hook with the scaler, or
    DDP's allreduce) under a ``GradScaler`` whose first steps overflow: each step's scale and
    whether the parameters moved; finite parameters at the end."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    kind = torch.device(device).type  # autocast and GradScaler take "cuda", not "cuda:1"
    scaler = torch.amp.GradScaler(kind, init_scale=2.0 ** 24, growth_interval=4)
    if method is not None:
        ddp.register_comm_hook(hsd.State(compression=hsd.Compression.create(method, **OPTIONS), loss_scaler=scaler),
                               hsd.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(32, 32, generator=generator).to(device)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with torch.autocast(kind, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(ddp(x), x[:, :4] * 0.5)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        record.append({"scale": scale, "moved": any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))})
    record[-1]["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return record


def check_amp(device: str, steps: int) -> Dict[str, Any]:
    """Every method's AMP run skips and backs off as DDP's own, then trains."""
    stock = amp_run(device, None, steps)
    first = next((t for t, s in enumerate(stock) if s["moved"]), steps)
    results = {}
    for method in hsd.Compression.names():
        if method in ("none", "fp16"):
            continue
        ours = amp_run(device, method, steps)
        same = [(s["scale"], s["moved"]) for s in ours[:first + 1]] == [(s["scale"], s["moved"])
                                                                         for s in stock[:first + 1]]
        results[method] = {"overflows": first, "same_as_stock": same, "finite": ours[-1]["finite"],
                           "ok": same and ours[-1]["finite"] and first < steps}
    return results


def layout_run(device: str, strided: bool) -> Dict[str, Any]:
    """Three fused-AdamW steps of parameters whose gradients are published from a flat buffer."""
    torch.manual_seed(4)
    values = [torch.randn(8, 3, 3, 3), torch.randn(7, 5), torch.randn(8)]
    if strided:
        values = [values[0].contiguous(memory_format=torch.channels_last), values[1].t().contiguous().t(), values[2]]
    params = [torch.nn.Parameter(v.to(device)) for v in values]
    group = FlatGroup(0, ["a", "b", "c"], params)
    opt = torch.optim.AdamW(params, lr=0.01, fused=True)
    kept = True
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(device)
        x = group.load_gradients()
        group.zeroed_output()
        group.take_result(x.clone(), torch.zeros_like(x))  # everything delivered (density 1)
        group.publish()
        kept &= all(p.grad.stride() == p.stride() for p in params)
        opt.step()
    return {"strides_kept": kept, "params": [p.detach().cpu().contiguous() for p in params]}


def fsdp_run(method: str, device: str) -> List[List[torch.Tensor]]:
    """Every step's gradients (on the CPU) of a model of :data:`SHAPES` sharded by FSDP2 on a
    one-rank mesh of ``device``, each unit's shard exchanged by ``method`` through
    :func:`horovod_sparse.fsdp.compress_replicas` (a one-rank replicate group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import horovod_sparse.fsdp as hsf

    torch.manual_seed(0)
    model = GivenGradients([torch.nn.Parameter(torch.randn(*shape, device=device)) for shape in SHAPES])
    mesh = init_device_mesh(torch.device(device).type, (1,))
    fully_shard(model, mesh=mesh)
    hsf.compress_replicas(model, hsf.Compression.create(method, **OPTIONS), dist.new_group([0]))
    steps = []
    for step in range(STEPS):
        model(given(step, device)).backward()
        steps.append([p.grad.to_local().detach().cpu().clone() for p in model.parameters()])
        for p in model.parameters():
            p.grad = None
    return steps


def check_fsdp(device: str) -> Dict[str, Any]:
    """Every method through the FSDP2 front end on ``device`` against the CPU: the same
    coordinates every step, values within rounding."""
    results = {}
    for method in hsd.Compression.names():
        if method in ("none", "fp16"):
            continue
        ours, cpu = fsdp_run(method, device), fsdp_run(method, "cpu")
        pairs = [(a, b) for step_a, step_b in zip(ours, cpu) for a, b in zip(step_a, step_b)]
        same = all(torch.equal(a != 0, b != 0) for a, b in pairs)
        diff = max(float(((a - b).abs() / b.abs().clamp_min(1e-30)).max()) for a, b in pairs)
        results[method] = {"same_selection": same, "max_rel_diff": diff, "ok": same and diff <= 1e-5}
    return results


def check_layout(device: str) -> Dict[str, Any]:
    strided, contiguous = layout_run(device, True), layout_run(device, False)
    equal = all(torch.equal(a, b) for a, b in zip(strided["params"], contiguous["params"]))
    return {"strides_kept": strided["strides_kept"], "equal_to_contiguous": equal,
            "ok": strided["strides_kept"] and equal}


def sync_site() -> str:
    """Where a synchronisation is being reported from: the innermost three frames of this
    package (``file:line``, innermost first)."""
    frames = [f for f in traceback.extract_stack() if f"{os.sep}horovod_sparse{os.sep}" in f.filename]
    return " <- ".join(f"{f.filename.rsplit(os.sep + 'horovod_sparse' + os.sep, 1)[1]}:{f.lineno}"
                       for f in frames[::-1][:3]) or "(outside horovod_sparse)"


def count_syncs(device: str) -> Optional[Dict[str, Dict[str, Any]]]:
    """Host synchronisations of one sparse step per method (CUDA only): how many, the groups of
    the step (DDP's buckets), and where (:func:`sync_site`, with how often)."""
    if not device.startswith("cuda"):
        return None
    counts = {}
    sites: List[str] = []

    def note(message: Any, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" in str(message):
            sites.append(sync_site())  # called while the synchronising operation reports

    for method in hsd.Compression.names():
        if method in ("none", "fp16"):
            continue
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*shape, device=device)) for shape in SHAPES]
        ddp = torch.nn.parallel.DistributedDataParallel(GivenGradients(params), bucket_cap_mb=BUCKET_MB)
        state = hsd.State(compression=hsd.Compression.create(method, **OPTIONS))
        ddp.register_comm_hook(state, hsd.hook)
        for step in range(2):  # the first step is dense; the second is counted
            grads = given(step, device)
            torch.cuda.synchronize()
            sites.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = note
                torch.cuda.set_sync_debug_mode("warn" if step == 1 else "default")
                ddp(grads).backward()
                torch.cuda.set_sync_debug_mode("default")
        assert state.last_stats is not None
        counts[method] = {"count": len(sites), "groups": len(state.last_stats.groups),
                          "sites": dict(Counter(sites).most_common())}
    return counts


def timed(work: Callable[[], Any], device: str, repeats: int) -> float:
    """Median seconds of ``work``, the device synchronised around each run."""
    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    work()
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        work()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


#: The buffer sizes and densities of the ``selection`` part unless ``--numel`` and ``--density``
#: say otherwise (issue 43: 25.6M and 100M floats at 0.001 and 0.01; ``--quick``: 1M at 0.001).
SELECTION_SIZES = (25_600_000, 100_000_000)
SELECTION_DENSITIES = (0.001, 0.01)


def micro_selection(x: torch.Tensor, k: int, density: float, capacity: int) -> Callable[[], Any]:
    """MiCRO's selection on one rank as its exchange runs it on an accelerator: the scan, the
    histogram rounds on the device (the one-rank allreduce being the local histogram itself) and
    the capped pick, from the controller's state after one step at the target."""
    from horovod_sparse.distributed import backend as B
    from horovod_sparse.methods.micro.controllers import HistogramController, ThresholdState
    from horovod_sparse.methods.micro.device_rounds import device_histogram_threshold

    def select(state: ThresholdState) -> Tuple[Any, Any]:
        scanned = B.scan(x, 0, x.numel(), scan_block_size(density))
        plan = device_histogram_threshold(B, HistogramController(), state, k, 1, 0, 0, scanned)
        round_ = next(plan)
        try:
            while True:
                round_ = plan.send(round_.local)
        except StopIteration as finished:
            reading, _ = finished.value
        return B.pick_capped(scanned, reading.threshold, capacity), reading.threshold

    _, threshold = select(ThresholdState())
    steady = ThresholdState(threshold=float(threshold), steps=1, last_union=k, last_counts=[k])
    return lambda: select(steady)


def selection_row(x: torch.Tensor, density: float, device: str, repeats: int) -> Dict[str, Any]:
    """:func:`selection`'s figures for the buffer ``x`` at ``density``."""
    from horovod_sparse.common.threshold_baselines import DGCOptions
    from horovod_sparse.distributed import backend as B
    from horovod_sparse.methods.dgc import dgc_select
    from horovod_sparse.methods.gaussiank import gaussiank_select

    numel = x.numel()
    k = max(1, int(density * numel))
    capacity = 2 * k
    exact = top_k(x, k)
    assert torch.equal(exact, torch.topk(x.abs(), k).indices.sort().values), "top_k differs from torch.topk"
    kth = float(x[exact].abs().min())
    with accelerator_paths():
        work = {"sum": lambda: x.sum(), "torch.topk": lambda: torch.topk(x.abs(), k),
                "top_k": lambda: top_k(x, k),
                "threshold": lambda: B.pick_capped(B.scan(x, 0, numel, scan_block_size(density)), kth, capacity),
                "gaussiank": lambda: gaussiank_select(B, x, k, density, capacity),
                "dgc": lambda: dgc_select(B, x, DGCOptions(density=density), 0, capacity),
                "micro": micro_selection(x, k, density, capacity)}
        times = {name: timed(run, device, repeats) for name, run in work.items()}
    return {"numel": numel, "density": density, "k": k, "seconds": times,
            "ratio_to_sum": {n: t / times["sum"] for n, t in times.items()}}


def selection(device: str, sizes: Sequence[int], densities: Sequence[float], repeats: int) -> List[Dict[str, Any]]:
    """Per buffer size and density, on the device: a read pass, ``torch.topk``, the methods' exact
    top-k and the threshold family's selections as their exchanges run them on an accelerator
    (the hard threshold at a threshold that selects about ``k``, Gaussian-k, DGC and MiCRO, each
    cut to a capacity of ``2k``; the accelerators' paths, forced on a CPU), each as a ratio to
    the read pass (:func:`selection_row`)."""
    rows = []
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
        rows += [selection_row(x, density, device, repeats) for density in densities]
    return rows


def train_step(net: torch.nn.Module, opt: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """One training step (bf16 autocast on CUDA)."""
    kind = inputs.device.type
    opt.zero_grad()
    with torch.autocast(kind, dtype=torch.bfloat16, enabled=kind == "cuda"):
        loss = torch.nn.functional.cross_entropy(net(inputs), targets)
    loss.backward()
    opt.step()


@dataclasses.dataclass
class Training:
    """A training run of :func:`training`: ``step()`` runs one step; ``state`` is the hook's
    (None for dense), whose ``last_stats`` are the last step's statistics."""

    step: Callable[[], None]
    state: Optional[hsd.State]
    parameters: int


def training(device: str, model: str, batch_size: int, method: str, bucket_view: bool = False) -> Training:
    """Training steps of ``model`` (seeded) through DDP on ``device``, dense (``"dense"``:
    DDP's own allreduce), with a :data:`BASELINE_HOOKS` hook, or with ``method``'s hook at
    density 0.001; ``bucket_view``: DDP's ``gradient_as_bucket_view``."""
    spec = model_spec(model)
    inputs, targets = (t.to(device) for t in spec.batch(batch_size, spec.default_size,
                                                         torch.Generator().manual_seed(0)))
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(spec.build(spec.default_size).to(device),
                                                    gradient_as_bucket_view=bucket_view)
    state = None
    if method in BASELINE_HOOKS:
        net.register_comm_hook(*BASELINE_HOOKS[method](device))
    elif method != "dense":
        state = hsd.State(compression=hsd.Compression.create(method, density=0.001))
        net.register_comm_hook(state, hsd.hook)
    step = functools.partial(train_step, net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                             inputs, targets)
    return Training(step, state, sum(p.numel() for p in net.parameters()))


#: Ranks (one link each) the break-even links are given for.
BREAK_EVEN_WORKERS = (8, 64)


def sent_payload(stats: StepStats, fp16_values: bool) -> Tuple[Payload, str]:
    """What one rank sent in the step of ``stats``, by kind, and where the figures come from:
    the statistics (``"statistics"``), or, when the step sent nothing (one rank: gTop-k runs no
    round), the selected coordinates at the wire format (``"selected"``: a 4-byte index and a
    4-byte value each, 2-byte with ``fp16_values``)."""
    sent = {kind: float(stats.bytes_sent(kind)) for kind in ("values", "indices", "meta")}
    collectives = float(sum(g.collectives for g in stats.groups))
    if any(sent.values()):
        return Payload(sent["values"], sent["indices"], sent["meta"], collectives, 1), "statistics"
    selected = sum(g.selected for g in stats.groups)
    return Payload(float(selected * (2 if fp16_values else VALUE_BYTES)), float(selected * INDEX_BYTES), 0.0,
                   collectives, 1), "selected"


def break_even(method: str, added_seconds: float, payload: Payload, parameters: int) -> Dict[str, Optional[float]]:
    """Per worker count of :data:`BREAK_EVEN_WORKERS` (string keys, for JSON): the link in bits/s
    below which ``method``'s step, ``added_seconds`` beyond the dense step's and sending
    ``payload`` per rank through its own collectives (:func:`benchmarks.emulated.wire.wire_law`), beats a
    dense bf16 ring all-reduce of ``parameters`` (:func:`break_even_link`: ``math.inf`` on every
    link, None on none)."""
    law = wire_law(method)
    return {str(n): break_even_link(parameters, added_seconds, functools.partial(law, p=payload), n)
            for n in BREAK_EVEN_WORKERS}


def step_times(device: str, model: str, batch_size: int, steps: int) -> Dict[str, Any]:
    """Median seconds per training step of ``model`` through DDP, dense and per method (see the
    module docstring); the first two steps of each run (DDP's bucket rebuild, the methods' dense
    first step) are not timed. Dense and Top-k also with ``gradient_as_bucket_view=True``
    (``"<name>+view"``)."""
    seconds: Dict[str, float] = {}
    sent: Dict[str, Tuple[Payload, str]] = {}
    runs = [(m, False) for m in ["dense", *baselines(device)] + [m for m in hsd.Compression.names()
                                                                  if m not in ("none", "fp16")]]
    for method, view in runs + [("dense", True), ("topk", True)]:
        run = training(device, model, batch_size, method, view)
        run.step()
        seconds[method + ("+view" if view else "")] = timed(run.step, device, steps)
        if run.state is not None and not view:
            assert run.state.last_stats is not None
            sent[method] = sent_payload(run.state.last_stats, run.state.compression.options.fp16_values)
        parameters = run.parameters
    links = {}
    for method, (payload, source) in sent.items():
        added = max(0.0, seconds[method] - seconds["dense"])
        links[method] = {"added_seconds": added, "payload": dataclasses.asdict(payload), "bytes_from": source,
                         "bits_per_second": break_even(method, added, payload, parameters)}
    return {"model": model, "batch_size": batch_size, "parameters": parameters, "seconds": seconds,
            "ratio_to_dense": {m: t / seconds["dense"] for m, t in seconds.items()}, "break_even": links}


def fsdp_step_times(device: str, model: str, batch_size: int, steps: int) -> Dict[str, Any]:
    """Median seconds per training step of ``model`` sharded by FSDP2 on a one-rank mesh of
    ``device`` (the root module one unit), plain (``"dense"``) and with every method's
    :func:`horovod_sparse.fsdp.compress_replicas` on a one-rank replicate group, at density 0.001:
    what the FSDP2 front end adds to a step (the first two steps not timed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import horovod_sparse.fsdp as hsf

    spec = model_spec(model)
    inputs, targets = (t.to(device) for t in spec.batch(batch_size, spec.default_size,
                                                         torch.Generator().manual_seed(0)))
    seconds: Dict[str, float] = {}
    for method in ["dense"] + [m for m in hsf.Compression.names() if m not in ("none", "fp16")]:
        torch.manual_seed(0)
        net = spec.build(spec.default_size).to(device)
        fully_shard(net, mesh=init_device_mesh(torch.device(device).type, (1,)))
        if method != "dense":
            hsf.compress_replicas(net, hsf.Compression.create(method, density=0.001), dist.new_group([0]))
        step = functools.partial(train_step, net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                                 inputs, targets)
        step()
        seconds[method] = timed(step, device, steps)
    return {"model": model, "batch_size": batch_size, "seconds": seconds,
            "ratio_to_dense": {m: t / seconds["dense"] for m, t in seconds.items()}}


def exchange_costs(device: str, models: Sequence[str], steps: int) -> List[Dict[str, Any]]:
    """:func:`benchmarks.costs.exchange_cost.rows` of ``models`` on ``device`` (the default process
    group up), DDP's and FSDP2's, every method on its own paths, ``steps`` timed after three."""
    methods = [m for m in hsd.Compression.names() if m not in ("none", "fp16")]
    options = argparse.Namespace(device=device, steps=steps, warmup=3, accelerator_paths=False)
    return exchange_cost.rows(models, methods, ["ddp", "fsdp"], options)


#: Training steps profiled per run (after two untimed ones).
PROFILED_STEPS = 3


def profiled(device: str, model: str, batch_size: int, method: str) -> Dict[str, Tuple[float, float, float]]:
    """Per operation of ``torch.profiler``: calls, self host milliseconds and self device
    milliseconds per training step (:func:`training`)."""
    step = training(device, model, batch_size, method).step
    step()
    step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return {e.key: (e.count / PROFILED_STEPS, e.self_cpu_time_total / 1e3 / PROFILED_STEPS,
                    getattr(e, "self_device_time_total", 0.0) / 1e3 / PROFILED_STEPS)
            for e in prof.key_averages()}


def profile(device: str, model: str, batch_size: int, method: str) -> Dict[str, Any]:
    """What ``method``'s hook adds to a training step, operation by operation: the profiles of
    the dense and the hooked steps (:func:`profiled`) side by side, the 20 operations whose
    self host time grew most, with the growth of their calls and host and device times per
    step, and the totals."""
    dense, hooked = profiled(device, model, batch_size, "dense"), profiled(device, model, batch_size, method)
    zero = (0.0, 0.0, 0.0)
    added = {name: tuple(h - d for h, d in zip(hooked.get(name, zero), dense.get(name, zero)))
             for name in set(dense) | set(hooked)}
    top = sorted(added.items(), key=lambda item: -item[1][1])[:20]
    return {"method": method,
            "host_ms": {"dense": sum(v[1] for v in dense.values()), method: sum(v[1] for v in hooked.values())},
            "device_ms": {"dense": sum(v[2] for v in dense.values()), method: sum(v[2] for v in hooked.values())},
            "added": [{"op": name, "calls": calls, "host_ms": host, "device_ms": dev}
                      for name, (calls, host, dev) in top]}


def below_link(bits_per_second: Optional[float]) -> str:
    """Where a compressed step wins, given its break-even link: ``below 12.3 Gbit/s``, ``on any
    link`` (``math.inf``), ``never (no fewer bytes)`` (None)."""
    if bits_per_second is None:
        return "never (no fewer bytes)"
    return "on any link" if math.isinf(bits_per_second) else f"below {bits_per_second / 1e9:.3g} Gbit/s"


def break_even_line(row: Dict[str, Any], parameters: int) -> str:
    """One method's break-even figures (a row of ``steps.break_even``) in words."""
    payload = row["payload"]
    kilobytes = (payload["values"] + payload["indices"] + payload["meta"]) / 1e3
    links = ", ".join(f"on {n} ranks {below_link(bw)}" for n, bw in row["bits_per_second"].items())
    return (f"+{row['added_seconds'] * 1e3:.2f} ms a step, {kilobytes:.3g} kB sent per rank ({row['bytes_from']}), "
            f"dense bf16 {BF16_BYTES * parameters / 1e6:.3g} MB: beats a dense bf16 ring all-reduce {links}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, nargs="+", default=list(SELECTION_SIZES),
                        help="the selection part's buffer sizes")
    parser.add_argument("--density", type=float, nargs="+", default=list(SELECTION_DENSITIES),
                        help="the selection part's densities")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--amp-steps", type=int, default=16)
    parser.add_argument("--model", nargs="+", default=["resnet50", "gpt2small"],
                        help="the training-step part's models (the first one profiled)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 8],
                        help="the training-step part's batch per model")
    parser.add_argument("--train-steps", type=int, default=20, help="timed steps per method")
    parser.add_argument("--profile", default="topk", help="the method whose training steps are profiled")
    parser.add_argument("--quick", action="store_true", help="a small buffer and few repeats (CI)")
    parser.add_argument("--results", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.numel, args.density, args.repeats = [1_000_000], [0.001], 3
        args.model, args.batch_sizes, args.train_steps = ["resnet20"], [4], 2
    device = args.device
    if device == "cuda":  # set_device needs an index
        device = f"cuda:{torch.cuda.current_device()}"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    # NCCL for the device, Gloo for the CPU reference runs
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    results = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
               "torch": torch.__version__, "methods": check_methods(device),
               "amp": check_amp(device, args.amp_steps), "layout": check_layout(device), "fsdp": check_fsdp(device),
               "syncs": count_syncs(device),
               "steps": [step_times(device, model, batch, args.train_steps)
                         for model, batch in zip(args.model, args.batch_sizes, strict=True)],
               "fsdp_steps": fsdp_step_times(device, args.model[0], args.batch_sizes[0], args.train_steps),
               "exchange_cost": exchange_costs(device, args.model, args.train_steps),
               "profile": profile(device, args.model[0], args.batch_sizes[0], args.profile),
               "selection": selection(device, args.numel, args.density, args.repeats)}
    dist.destroy_process_group()
    for part in ("methods", "amp", "fsdp"):
        for method, row in results[part].items():
            print(f"{part:8s} {method:10s} " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                        for k, v in row.items()))
    print("layout  ", " ".join(f"{k}={v}" for k, v in results["layout"].items()))
    if results["syncs"] is None:
        print("syncs    n/a (CUDA only)")
    else:
        for method, row in results["syncs"].items():
            print(f"syncs    {method:10s} {row['count']} over {row['groups']} groups: {row['sites']}")
    prof = results["profile"]
    print(f"profile {prof['method']} vs dense, per step: host {prof['host_ms']}, device {prof['device_ms']} ms; "
          "most added:")
    for row in prof["added"]:
        print(f"  {row['op'][:60]:60s} calls {row['calls']:+8.1f}  host {row['host_ms']:+8.3f} ms  "
              f"device {row['device_ms']:+8.3f} ms")
    for train in results["steps"]:
        print(f"steps {train['model']} batch={train['batch_size']} " + " ".join(
            f"{m}={t * 1e3:.1f}ms ({train['ratio_to_dense'][m]:.2f}x)" for m, t in train["seconds"].items()))
        for method, row in train["break_even"].items():
            print(f"break-even {train['model']} {method:10s} {break_even_line(row, train['parameters'])}")
    fsdp = results["fsdp_steps"]
    print(f"fsdp steps {fsdp['model']} batch={fsdp['batch_size']} " + " ".join(
        f"{m}={t * 1e3:.1f}ms ({fsdp['ratio_to_dense'][m]:.2f}x)" for m, t in fsdp["seconds"].items()))
    print("exchange cost, one rank:\n" + "\n".join(exchange_cost.table(results["exchange_cost"])))
    for sel in results["selection"]:
        figures = [f"{name}={seconds * 1e3:.3f}ms ({sel['ratio_to_sum'][name]:.1f}x sum)"
                   for name, seconds in sel["seconds"].items()]
        print(f"selection numel={sel['numel']} density={sel['density']} k={sel['k']} " + " ".join(figures))
    if args.results:
        write_results(args.results, "gpu_check", results, command_line(argv, "benchmarks.gpu_check"))
    ok = (all(row["ok"] for part in ("methods", "amp", "fsdp") for row in results[part].values())
          and results["layout"]["ok"])
    print("gpu_check:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
