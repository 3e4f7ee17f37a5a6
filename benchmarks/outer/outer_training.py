"""One rank of the outer-steps benchmark's ``torch.distributed`` job (:mod:`benchmarks.outer.outer_steps`):
every configuration trained in turn from the same initial weights, its loss or accuracy taken
against wall time and bytes.

Tasks: ``lm``, a byte-level causal transformer on the standard library's sources
(:mod:`benchmarks.outer.text`; validation loss), and ``digits``, the main job's MLP on scikit-learn's
digits (test accuracy). Configurations: per-step DDP (``ddp none``: DDP's own allreduce; ``ddp
<method>``: horovod_sparse's comm hook) and outer steps (``outer none H=…``: DiLoCo; ``outer
<method> H=…``: the method on the pseudo-gradients; each schedule of ``--schedules``: ``sync``,
``overlap`` (a round's exchange during the next round) and ``streamed`` (``--fragments``
fragments, overlapped)), all with AdamW inside. Streamed replicas differ between the fragments'
boundaries: rank 0's is evaluated. Every ``eval_every``
steps (a multiple of every H, so replicas agree) rank 0 evaluates while the others wait; the
clock stops meanwhile, so ``seconds`` is training time alone (compute and exchange). Bytes are the
payload a worker handed its collectives (the front ends' statistics; ``4 x parameters`` per step
for plain DDP). Each configuration prints one line ``OUTER-RESULT {json}`` on rank 0.
"""
from __future__ import annotations

import argparse
import json
import socket
import time
from typing import Any, Callable, Dict, List, NamedTuple, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import horovod_sparse.ddp as hsd
import horovod_sparse.outer as hso
from horovod_sparse.common.registry import parse_spec
from horovod_sparse.outer.fragments import cut
from benchmarks.outer.text import VOCABULARY, stdlib_corpus, windows
from benchmarks.shared.data import digits_split, shard
from benchmarks.shared.models import CausalTransformer, count_parameters, digits_mlp

RESULT_PREFIX = "OUTER-RESULT "
#: The outer steps' schedules and their labels' suffixes (formatted with the fragments' count).
SCHEDULE_LABELS = {"sync": "", "overlap": " overlap", "streamed": " streamed F={}"}
#: The language model: width 128, 2 blocks, 4 heads, 64 bytes of context (about 0.4 M parameters).
LM_SHAPE = {"context": 64, "width": 128, "layers": 2, "heads": 4}


class Task:
    """A model, its data and its metric (``lm``: validation loss; ``digits``: test accuracy, %)."""

    def __init__(self, name: str, batch: int, seed: int) -> None:
        self.name, self.batch = name, batch
        rank, size = dist.get_rank(), dist.get_world_size()
        self.generator = torch.Generator().manual_seed(seed + 1000 * rank)
        if name == "lm":
            self.train, self.validation = stdlib_corpus()
            self.metric, self.lower_is_better = "validation loss", True
            held = torch.Generator().manual_seed(seed + 99)
            self.held_out = [windows(self.validation, 32, LM_SHAPE["context"], held) for _ in range(8)]
        elif name == "digits":
            x_train, y_train, x_test, y_test = digits_split()
            self.x = torch.from_numpy(shard(x_train, rank, size)).float()
            self.y = torch.from_numpy(shard(y_train, rank, size)).long()
            self.held_out = [(torch.from_numpy(x_test).float(), torch.from_numpy(y_test).long())]
            self.metric, self.lower_is_better = "test accuracy (%)", False
        else:
            raise ValueError(f"unknown task {name!r}: lm or digits")

    def model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        if self.name == "digits":
            return digits_mlp()
        model = CausalTransformer(VOCABULARY, LM_SHAPE["context"], LM_SHAPE["width"], LM_SHAPE["layers"],
                                  LM_SHAPE["heads"])
        for embedding in (model.tokens, model.positions):  # GPT-2's scale (the decoder is tied to it)
            torch.nn.init.normal_(embedding.weight, std=0.02)
        return model

    def batch_of(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.name == "lm":
            return windows(self.train, self.batch, LM_SHAPE["context"], self.generator)
        rows = torch.randint(0, len(self.x), (self.batch,), generator=self.generator)
        return self.x[rows], self.y[rows]

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        model.eval()
        if self.name == "lm":
            value = sum(float(F.cross_entropy(model(x), y)) for x, y in self.held_out) / len(self.held_out)
        else:
            x, y = self.held_out[0]
            value = 100.0 * float((model(x).argmax(1) == y).float().mean())
        model.train()
        return value


def stats_bytes(stats: Any) -> int:
    """Payload bytes this rank sent in a step's (or round's) statistics."""
    return 0 if stats is None else sum(sum(g.sent.values()) for g in stats.groups)


#: Ports of the torchft anchor's lighthouse (on rank 0) and of each replica group's store (its own).
LIGHTHOUSE_PORT, TORCHFT_STORE_PORT = 29710, 29720


def fragment_modules(model: torch.nn.Module, count: int) -> List[torch.nn.Module]:
    """``model`` itself for one fragment, else ``count`` modules each holding (sharing, not copying)
    a run of its trainable parameters, cut as :class:`horovod_sparse.outer.OuterSteps` cuts them."""
    if count == 1:
        return [model]
    params = [p for p in model.parameters() if p.requires_grad]
    parts = []
    for run in cut([p.numel() for p in params], count):
        part = torch.nn.Module()
        for i in run:
            part.register_parameter(f"p{i}", params[i])
        parts.append(part)
    return parts


class TorchftDiloco:
    """torchft's DiLoCo (``torchft.local_sgd.DiLoCo``; the anchor): every rank a replica group of
    one process, a ``Manager`` on a Gloo group, the lighthouse served by rank 0 for the whole job.
    Dense: torchft's ``should_quantize`` (fp8) needs Triton and is a dense allreduce without it.
    With ``fragments`` F > 1, Streaming DiLoCo: the parameters cut as ours are
    (:func:`horovod_sparse.outer.fragments.cut`), fragment ``f`` synchronised at inner step
    ``(f + 1) * every / F`` of each round, its allreduce waited for ``every / F - 1`` inner steps
    later (torchft's ``fragment_sync_delay``, the longest it allows: ours lands one fragment
    period later), one outer optimizer per fragment."""

    lighthouse: Any = None

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, every: int, index: int,
                 fragments: int = 1) -> None:
        import datetime
        import os

        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo

        rank, size = dist.get_rank(), dist.get_world_size()
        if rank == 0 and TorchftDiloco.lighthouse is None:
            TorchftDiloco.lighthouse = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT}", min_replicas=size)
        dist.barrier()
        port = TORCHFT_STORE_PORT + index * size + rank  # ranks may share a host
        # The quorum hands the first replica's store address to the others: this host's own address.
        address = socket.gethostbyname(socket.gethostname())
        self.store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False)
        timeout = datetime.timedelta(seconds=120)
        self.manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=size, load_state_dict=None,
                               state_dict=None, replica_id=f"replica{rank}-{index}", rank=0, world_size=1,
                               lighthouse_addr=f"http://{os.environ['MASTER_ADDR']}:{LIGHTHOUSE_PORT}",
                               store_addr=address, store_port=port, use_async_quorum=False, timeout=timeout,
                               quorum_timeout=timeout, init_sync=False)  # every rank builds the same model
        parts = fragment_modules(model, fragments)
        outers = [torch.optim.SGD(part.parameters(), **hso.DILOCO_OUTER) for part in parts]
        self.diloco = DiLoCo(self.manager, parts, inner, outers, sync_every=every,
                             fragment_sync_delay=every // fragments - 1 if fragments > 1 else 0)
        self.diloco.__enter__()  # hooks the inner optimizer's step: every H-th synchronises

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown()


def create(namespace: Any, spec: str, density: float) -> Any:
    """The method of ``spec`` (``sparseloco`` or ``sparseloco:blocks=true``, options as
    :func:`horovod_sparse.common.registry.parse_spec` reads them) at ``density`` unless it names one."""
    name, options = parse_spec(spec)
    return namespace.create(name, **{"density": density, **options})


class Run(NamedTuple):
    """A configuration ready to train: its ``model`` (what the forward pass calls), its ``step``
    after the backward pass, ``sent()`` (the bytes the step sent), its ``optimizers`` (zeroed
    before each backward pass) and ``close()`` (after the last step)."""

    model: torch.nn.Module
    step: Callable[[], Any]
    sent: Callable[[], int]
    optimizers: List[torch.optim.Optimizer]
    close: Callable[[], None] = lambda: None


def build(task: Task, config: Dict[str, Any], args: argparse.Namespace) -> Run:
    """The :class:`Run` of ``config``."""
    model = task.model(args.seed)
    if config["kind"] == "torchft":
        parameters = count_parameters(model)
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
        anchor = TorchftDiloco(model, inner, config["every"], config["index"], config["fragments"])
        steps = [0]

        def torchft_sent() -> int:  # torchft keeps no statistics: its allreduce of every parameter a round
            steps[0] += 1
            return 4 * parameters if steps[0] % config["every"] == 0 else 0

        return Run(model, inner.step, torchft_sent, [inner], anchor.close)
    if config["kind"] == "ddp":
        parameters = count_parameters(model)
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        state = None
        if config["method"] != "none":
            state = hsd.State(compression=create(hsd.Compression, config["method"], args.density))
            ddp.register_comm_hook(state, hsd.hook)

        def sent() -> int:
            return 4 * parameters if state is None else stats_bytes(state.last_stats)

        return Run(ddp, optimizer.step, sent, [optimizer])
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    compression = (hso.Compression.none if config["method"] == "none"
                   else create(hso.Compression, config["method"], args.density))
    outer_optimizer = (torch.optim.SGD(model.parameters(), lr=1.0)
                       if config["method"] != "none" and args.sparse_outer == "sgd" else None)
    outer = hso.OuterSteps(model, inner, compression, every=config["every"], outer_optimizer=outer_optimizer,
                           overlap=config["schedule"] != "sync", fragments=config["fragments"])
    closed = [0]

    def round_sent() -> int:
        if outer.steps == closed[0]:
            return 0
        closed[0] = outer.steps
        return stats_bytes(outer.last_stats)

    return Run(model, outer.step, round_sent, [inner])


def train(task: Task, config: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """Train ``config`` for ``args.steps`` steps (an outer configuration, ours or torchft's, for
    ``args.outer_steps`` when given); its curve and totals (on rank 0)."""
    model, step, sent, optimizers, close = build(task, config, args)
    curve: List[Dict[str, float]] = []
    seconds, sent_bytes = 0.0, 0
    steps = args.outer_steps if config["kind"] in ("outer", "torchft") and args.outer_steps else args.steps
    dist.barrier()
    for number in range(1, steps + 1):
        x, y = task.batch_of()
        start = time.perf_counter()
        for optimizer in optimizers:
            optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        step()
        seconds += time.perf_counter() - start
        sent_bytes += sent()
        if number % args.eval_every == 0:
            start = time.perf_counter()
            dist.barrier()
            seconds += time.perf_counter() - start
            value = task.evaluate(model.module if isinstance(model, DistributedDataParallel) else model)
            curve.append({"step": number, "seconds": seconds, "bytes": sent_bytes, "value": value})
            dist.barrier()
    close()
    return {**config, "task": task.name, "metric": task.metric, "curve": curve, "seconds": seconds,
            "bytes": sent_bytes, "final": curve[-1]["value"], "parameters": count_parameters(model)}


def configurations(methods: List[str], outer_methods: List[str], every: List[int],
                   torchft: bool = False, schedules: Sequence[str] = ("sync",),
                   fragments: int = 4) -> List[Dict[str, Any]]:
    """Per-step DDP (dense, then ``methods``), then at every H of ``every`` and each of
    ``schedules`` (``sync``; ``overlap``; ``streamed``: ``fragments`` fragments, overlapped) outer
    steps (dense DiLoCo, then ``outer_methods``); with ``torchft``, torchft's DiLoCo at every H
    instead, synchronous and streamed where ``schedules`` name them (a job of its own: a failure
    of torchft's quorum loses none of the others' rows).
    Each with its ``label`` and ``index``."""
    if torchft:  # torchft's schedules: synchronous, and streamed (its own overlap is per fragment)
        configs = [{"kind": "torchft", "method": "none", "every": h, "schedule": schedule,
                    "fragments": fragments if schedule == "streamed" else 1,
                    "label": f"torchft diloco H={h}" + SCHEDULE_LABELS[schedule].format(fragments)}
                   for h in every for schedule in schedules if schedule != "overlap"]
    else:
        configs = [{"kind": "ddp", "method": m, "label": f"ddp {m}"} for m in ["none", *methods]]
        configs += [{"kind": "outer", "method": m, "every": h, "schedule": schedule,
                     "fragments": fragments if schedule == "streamed" else 1,
                     "label": f"outer {m} H={h}" + SCHEDULE_LABELS[schedule].format(fragments)}
                    for h in every for schedule in schedules for m in ["none", *outer_methods]]
    return [{**c, "index": i} for i, c in enumerate(configs)]


def run_worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for task_name in args.tasks:
        task = Task(task_name, args.batch_size if task_name == "lm" else args.digits_batch_size, args.seed)
        for config in configurations(args.methods, args.outer_methods, args.every, args.torchft, args.schedules,
                                     args.fragments):
            result = train(task, config, args)
            if rank == 0:
                print(RESULT_PREFIX + json.dumps(result), flush=True)
    hsd.exit_job()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", nargs="+", default=["lm", "digits"], choices=["lm", "digits"])
    parser.add_argument("--steps", type=int, default=300, help="inner steps of every configuration")
    parser.add_argument("--outer-steps", type=int, default=None,
                        help="inner steps of the outer configurations, torchft's too (default --steps): more, to see "
                             "when they reach per-step DDP's final metric")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (a multiple of --every)")
    parser.add_argument("--every", type=int, nargs="+", default=[10, 50], help="inner steps per round (H)")
    parser.add_argument("--methods", nargs="*", default=["topk", "micro"],
                        help="per-step methods (DDP hook), besides dense DDP (none: dense DDP alone); a method may "
                             "give options: sparseloco:blocks=true")
    parser.add_argument("--outer-methods", nargs="+", default=["topk", "micro", "gtopk", "sparseloco"],
                        help="methods on the pseudo-gradients (options as --methods')")
    parser.add_argument("--density", type=float, default=1 / 64)
    parser.add_argument("--sparse-outer", choices=["sgd", "diloco"], default="sgd",
                        help="the outer optimizer with a method: SGD at lr 1 (SparseLoCo's: the residual is the "
                             "momentum) or DiLoCo's Nesterov SGD (dense DiLoCo always takes DiLoCo's)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (every configuration)")
    parser.add_argument("--batch-size", type=int, default=16, help="the language model's windows per step")
    parser.add_argument("--digits-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schedules", nargs="+", default=["sync"], choices=list(SCHEDULE_LABELS),
                        help="the outer steps' schedules: sync, overlap (a round's exchange during the next round), "
                             "streamed (--fragments fragments, overlapped)")
    parser.add_argument("--fragments", type=int, default=4, help="fragments of the streamed schedule")
    parser.add_argument("--torchft", action="store_true",
                        help="also train torchft's DiLoCo (dense) at every H, the anchor, in a job of its own after "
                             "the others (pip install torchft)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what cannot give a fair comparison (with the fix)."""
    bad = [h for h in args.every if args.eval_every % h]
    if bad:
        parser.error(f"--eval-every {args.eval_every} is not a multiple of --every {bad}: evaluations must fall "
                     "at the end of a round, where every replica holds the same parameters")
    for option, steps in (("--steps", args.steps), ("--outer-steps", args.outer_steps or args.steps)):
        if steps % args.eval_every:
            parser.error(f"{option} {steps} must be a multiple of --eval-every {args.eval_every}")
    if args.torchft and "streamed" in args.schedules and any(h % args.fragments for h in args.every):
        parser.error(f"torchft's streamed DiLoCo needs --fragments {args.fragments} to divide every --every "
                     f"{args.every}: give --fragments 2 or 5 with --every 10 50")
    for method in sorted(set(args.methods) | set(args.outer_methods)):
        create(hso.Compression, method, args.density)  # raises naming the known methods and options
