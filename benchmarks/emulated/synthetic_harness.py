"""What every front end of the synthetic benchmark shares (:mod:`benchmarks.emulated.synthetic` with Horovod's
PyTorch and TensorFlow sides, :mod:`benchmarks.emulated.synthetic_ddp`, :mod:`benchmarks.emulated.synthetic_fsdp`):
their options (:func:`benchmark_parser`) and sweeps (:func:`configurations`, :func:`run_all`),
Horovod's benchmark loop and its printed lines (:func:`measure`), the labels of a configuration
and the means of the optimizer's statistics over the timed steps (:func:`summarize_stats`).

Framework-free: a front end imports it, never the other way round.
"""
from __future__ import annotations

import argparse
import gc
import json
import timeit
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks.shared.models import MODELS
from benchmarks.shared.results import write_results
from benchmarks.shared.tiers import placement, tier_bytes
from horovod_sparse.common.registry import parse_spec
from horovod_sparse.common.stats import BYTE_KINDS

#: Compressors that take no options (Horovod's own).
DENSE_COMPRESSORS = ("none", "fp16")


def compressor_options(spec: str, density: Optional[float]) -> Tuple[str, Dict[str, Any]]:
    """``(name, options)`` of a ``--compressor`` spec with ``--density`` folded in (ignored by
    the dense compressors, which take no options)."""
    name, options = parse_spec(spec)
    if density is not None and name not in DENSE_COMPRESSORS:
        options["density"] = density
    return name, options


def spec_label(name: str, options: Dict[str, Any]) -> str:
    """``name`` with its options, e.g. ``topk(density=0.001)``, or just ``name`` without any."""
    return name + (f"({', '.join(f'{k}={v}' for k, v in options.items())})" if options else "")


def describe(config: argparse.Namespace) -> str:
    """A short label of a configuration, e.g. ``topk(density=0.001)`` or ``local``."""
    if config.optimizer == "local":
        return "local (no exchange)"
    text = spec_label(*compressor_options(config.compressor, config.density))
    if config.groups is not None:
        text += f" groups={config.groups}"
    if asks_two_tier(config):
        text += " two-tier"
    return text + (" [stock Horovod]" if config.optimizer == "stock" else "")


def asks_two_tier(config: argparse.Namespace) -> bool:
    """Whether ``config`` runs horovod_sparse's optimizer two-tier (``--hierarchical`` means
    nothing without an exchange, ``local``; stock Horovod refuses it, :func:`check_stock`)."""
    return bool(config.hierarchical) and config.optimizer == "hs"


def wants_process_sets(configs: Sequence[argparse.Namespace]) -> bool:
    """Whether a job running ``configs`` needs ``hvd.init(process_sets="dynamic")``: some
    configuration asks for the two-tier exchange, whose process sets are added as it starts."""
    return any(asks_two_tier(c) for c in configs)


def summarize_stats(stats: Sequence[Any], parameters: int) -> Dict[str, Any]:
    """Means over the timed steps of the figures in ``StepStats`` records."""
    if not stats:
        return {}
    phases = sorted({phase for s in stats for g in s.groups for phase in g.seconds})
    return {
        "union_density": float(np.mean([s.union_density for s in stats])),
        "target_density": float(np.mean([s.target_density for s in stats])),
        "density_ratio": float(np.mean([s.density_ratio for s in stats])),
        "bytes_sent": float(np.mean([s.bytes_sent() for s in stats])),
        "bytes_received": float(np.mean([s.bytes_received() for s in stats])),
        "bytes_sent_by_kind": {k: float(np.mean([s.bytes_sent(k) for s in stats])) for k in BYTE_KINDS},
        "dense_bytes": 4 * parameters,
        "collectives": float(np.mean([sum(g.collectives for g in s.groups) for s in stats])),
        "seconds": {p: float(np.mean([s.seconds(p) for s in stats])) for p in phases},
    }


def _size(num_bytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def sparsification_lines(summary: Dict[str, Any], step_seconds: float) -> List[str]:
    """The lines printed after Horovod's, from :func:`summarize_stats`."""
    lines = []
    if summary:
        ratio = f", density ratio {summary['density_ratio']:.2f}" if summary["density_ratio"] else ""
        lines.append(f"Union density: {summary['union_density']:.6f} (target {summary['target_density']:.6f}{ratio})")
        lines.append(f"Bytes per step per worker: sent {_size(summary['bytes_sent'])}, received "
                     f"{_size(summary['bytes_received'])} (dense gradient {_size(summary['dense_bytes'])})")
        across, node = tier_bytes(summary)
        if node:
            lines.append(f"Bytes sent per step per worker by tier: {_size(across)} across hosts, "
                         f"{_size(node)} inside the host")
    phases = ", ".join(f"{p} {1e3 * s:.1f} ms" for p, s in summary.get("seconds", {}).items())
    lines.append(f"Time per step: {1e3 * step_seconds:.1f} ms" + (f" ({phases})" if phases else ""))
    return lines


def check_stock(config: argparse.Namespace, name: str) -> None:
    """``ValueError`` unless stock Horovod can run ``config`` with compressor ``name``: a dense
    compressor, and no ``--hierarchical`` (Horovod's own is ``HOROVOD_HIERARCHICAL_ALLREDUCE=1``)."""
    if name not in DENSE_COMPRESSORS:
        raise ValueError(f"--optimizer stock takes --compressor none or fp16, not {name!r}")
    if config.hierarchical:
        raise ValueError("--hierarchical is horovod_sparse's two-tier exchange; stock Horovod's is "
                         "HOROVOD_HIERARCHICAL_ALLREDUCE=1")


def topology(config: argparse.Namespace, hvd: Any, tiers: Any) -> Dict[str, Any]:
    """The fields of a result row that say where it ran: ``hierarchical`` (:func:`asks_two_tier`)
    and :func:`placement`'s."""
    return {"hierarchical": asks_two_tier(config), **placement(hvd, tiers)}


def measure(config: argparse.Namespace, step: Callable[[], Optional[Any]], workers: int, kind: str, label: str,
            parameters: int, log: Callable[[str], None]) -> Dict[str, Any]:
    """Horovod's benchmark loop around ``step`` (one training step; returns its ``StepStats``, or
    None where the exchange keeps none): prints Horovod's lines (``Compressor: <label>``) and
    the sparsification lines, after ``config.num_warmup_batches`` untimed steps and
    ``config.num_iters`` timed iterations of ``config.num_batches_per_iter`` steps. Returns the
    figures every front end's result row has (``stats`` summarises the timed steps' records)."""
    log(f"Model: {config.model}")
    log(f"Batch size: {config.batch_size}")
    log(f"Number of {kind}s: {workers}")
    log(f"Compressor: {label}")
    log("Running warmup...")
    timeit.timeit(step, number=config.num_warmup_batches)
    log("Running benchmark...")
    recorded: List[Any] = []

    def timed_step() -> None:
        stats = step()
        if stats is not None:
            recorded.append(stats)

    img_secs = []
    for i in range(config.num_iters):
        seconds = timeit.timeit(timed_step, number=config.num_batches_per_iter)
        img_secs.append(config.batch_size * config.num_batches_per_iter / seconds)
        log(f"Iter #{i}: {img_secs[-1]:.1f} img/sec per {kind}")
    mean, conf = float(np.mean(img_secs)), float(1.96 * np.std(img_secs))
    log(f"Img/sec per {kind}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {workers} {kind}(s): {workers * mean:.1f} +-{workers * conf:.1f}")
    summary = summarize_stats(recorded, parameters)
    step_seconds = config.batch_size / mean
    for line in sparsification_lines(summary, step_seconds):
        log(line)
    return {"model": config.model, "parameters": parameters, "batch_size": config.batch_size, "workers": workers,
            "device": kind, "label": label, "img_sec_per_worker": mean, "img_sec_conf": conf, "iters": img_secs,
            "total_img_sec": workers * mean, "step_seconds": step_seconds, "stats": summary}


def benchmark_parser(description: str, compressor_help: str) -> argparse.ArgumentParser:
    """The options every front end's synthetic benchmark takes: the model and its batch, Horovod's
    warm-up and timed iterations, ``--compressor`` and ``--density``, ``--seed``, ``--sweep`` and
    ``--results`` (read by :func:`configurations` and :func:`run_all`)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", choices=sorted(MODELS),
                   help="; ".join(f"{k}: {v.summary}" for k, v in sorted(MODELS.items())))
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    p.add_argument("--size", type=int, help="image side / sequence length (default: the model's)")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--compressor", default="none", help=compressor_help)
    p.add_argument("--density", type=float, help="density of a sparse method")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", type=Path, help="JSON list of configurations (option overrides) to run")
    p.add_argument("--results", type=Path, help="write the figures as JSON here (rank 0)")
    return p


def configurations(args: argparse.Namespace) -> List[argparse.Namespace]:
    """The configuration of the command line, or one per entry of ``--sweep``."""
    if args.sweep is None:
        return [args]
    configs = []
    for overrides in json.loads(args.sweep.read_text()):
        unknown = set(overrides) - set(vars(args))
        if unknown:
            raise ValueError(f"{args.sweep}: unknown options {sorted(unknown)}")
        configs.append(argparse.Namespace(**{**vars(args), **overrides}))
    return configs


def run_all(args: argparse.Namespace, run: Callable[[argparse.Namespace, Callable[[str], None]], Dict[str, Any]],
            rank: int, benchmark: str, command: str) -> None:
    """Run every configuration of ``args`` (:func:`configurations`) with ``run(config, log)``;
    rank 0 prints and, with ``--results``, rewrites the result file after every configuration
    (a failure keeps the rows before it): the list of rows with ``--sweep``, else the one row."""

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    rows = []
    for config in configurations(args):
        rows.append(run(config, log))
        log("")
        gc.collect()  # the previous configuration's model and buffers, before the next one's
        if args.results and rank == 0:
            write_results(args.results, benchmark, rows if args.sweep else rows[0], command)
