"""The main job: dense Horovod and every sparse method trained on real data (scikit-learn's digits)
on this machine's workers, and what each one buys on a real cluster.

    python -m benchmarks.main_job.digits [--np 2 | --hosts localhost:2,127.0.0.1:2] [--framework torch|tensorflow]
                                [--link 1gbit] [--workers 8] [--gpus-per-node 1]

One ``horovodrun --gloo`` job of ``--np`` workers trains the digits MLP, one configuration after the
other: compute-only (no exchange), dense Horovod (``none``), every method of the framework at every
``--densities`` value, and ``--mergecomp`` methods with ``groups="mergecomp"``. Then it
prints one table: *measured* here (test accuracy and its difference to dense, payload bytes sent
per step and the reduction against dense, union density, the method's own work per step) and
*projected* by :mod:`benchmarks.emulated.scaling`'s alpha-beta model with this run's costs (step time and
speed-up over dense on 1 and 10 Gbit/s clusters of 8 and 64 workers, and on ``--link`` /
``--workers``); then the recommendation: the fastest configuration on ``--link`` / ``--workers``
whose accuracy is within ``--tolerance`` points of dense, and when to turn the two-tier exchange on
there. Links use ``<out>/alpha_beta.json`` when
this machine has one (``python -m benchmarks.emulated.scaling`` or ``--emulate`` write it), else the fits of
the emulated cluster of the benchmarks (docs/benchmarks.md).

``--emulate`` (root, network namespaces) also trains every configuration across an emulated
cluster of ``--np`` workers on 1 Gbit/s links (:mod:`benchmarks.emulated.netem`) and prints the measured step
beside the projected one; when ``<out>/alpha_beta.json`` has no 1 Gbit/s fit, it fits alpha and
beta on such a link first (:func:`benchmarks.emulated.scaling.load_fits`) and projects with them.

``--hosts`` places the job on horovodrun's hosts (``-H``; ``localhost:2,127.0.0.1:2`` makes two
hosts of this machine): with more than one host of several workers, every sparse configuration
also trains two-tier (``hierarchical=True``, rows labelled ``+two-tier``), and the table shows the
bytes a worker sent inside its host beside those it sent across. ``--gpus-per-node`` gives the
projected clusters nodes of that many workers sharing a link (NVLink-class links inside): flat
rows are projected with the node's link shared, two-tier rows with the two-tier model, and the
recommendation says for which configurations two-tier is projected faster than flat. With
``--emulate`` the emulated cluster has the same hosts.

``--framework tensorflow`` trains through Keras ``model.fit`` (:mod:`benchmarks.main_job.digits_tf`), traced
(Keras' default) for every method.
Writes ``<out>/<name>.json``, ``<out>/<name>_accuracy_bytes.png`` and ``<out>/<name>_speedup.png``.
``--worker`` is the mode the job's ranks run in.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks.emulated import scaling
from benchmarks.emulated.netem import rate_bits
from benchmarks.main_job import digits_report
from benchmarks.main_job.digits_training import (EPOCH_PREFIX, LOCAL, MERGECOMP, OUTER, Recorder, add_arguments,
                                                 groups_argument, TWO_TIER, horovodrun, parse_configuration,
                                                 process_sets, search_summary)
from benchmarks.shared.results import Progress, command_line, read_results, write_results
from benchmarks.shared.tiers import placement

FRAMEWORKS = {"torch": "PyTorch", "tensorflow": "TensorFlow, Keras model.fit"}
#: What the table's local work is, per framework (see benchmarks.main_job.digits_tf for TensorFlow's).
LOCAL_WORK = {"torch": "the method's own work per step outside the communication wait (selection, packing, "
                       "applying)",
              "tensorflow": "the step minus the compute-only step (a traced step is not timed phase by phase, so "
                            "this holds the loopback exchange too: an upper bound)"}


def link_rate(text: str) -> str:
    """``--link``: a tc rate (checked now, not after the training)."""
    try:
        rate_bits(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def host_list(text: str) -> List[Tuple[str, int]]:
    """``--hosts``: ``[(host, slots), ...]`` of horovodrun's ``-H`` form, every host with the same
    slot count (checked now, not after the training)."""
    hosts = []
    for item in text.split(","):
        host, _, slots = item.partition(":")
        if not host or not slots.isdigit() or int(slots) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: write each host as NAME:SLOTS, e.g. localhost:2,127.0.0.1:2")
        hosts.append((host, int(slots)))
    if len({slots for _, slots in hosts}) > 1:
        raise argparse.ArgumentTypeError(f"{text}: every host needs the same number of slots (the two-tier exchange "
                                         "splits the job into equal nodes)")
    return hosts


def placed(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``np`` and ``hosts`` agreed: ``--hosts`` gives ``np`` (its slots), or ``np``
    (default 2) puts every worker on ``localhost``. Exits with the fix when they disagree, or when
    ``--gpus-per-node`` does not divide the projected clusters' workers."""
    if args.hosts is None:
        args.np = 2 if args.np is None else args.np
        args.hosts = [("localhost", args.np)]
    else:
        slots = sum(n for _, n in args.hosts)
        if args.np is not None and args.np != slots:
            parser().error(f"--np {args.np} but --hosts has {slots} slots: give --hosts alone")
        args.np = slots
    projected = [n for _, n in digits_report.CLUSTERS] + [args.workers]
    if args.gpus_per_node < 1 or any(n % args.gpus_per_node for n in projected):
        parser().error(f"--gpus-per-node {args.gpus_per_node} must divide every projected cluster's workers "
                       f"({', '.join(map(str, sorted(set(projected))))}: --workers and the table's)")
    return args


def emulated_per_host(args: argparse.Namespace) -> int:
    """Workers per host of the ``--emulate`` cluster: as on ``--hosts`` when it names several
    hosts, else one (every worker its own host and link)."""
    return args.hosts[0][1] if len(args.hosts) > 1 else 1


def two_tier_hosts(args: argparse.Namespace) -> bool:
    """Whether the job's hosts make a two-tier exchange: more than one, of several workers."""
    return len(args.hosts) > 1 and args.hosts[0][1] > 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch")
    p.add_argument("--np", type=int, help="workers of the job, all on this machine (default 2; with --hosts: "
                   "the hosts' slots)")
    p.add_argument("--hosts", type=host_list,
                   help="horovodrun's -H for the job, e.g. localhost:2,127.0.0.1:2 (two hosts of this machine): with "
                        "more than one host of several workers every sparse configuration also runs two-tier")
    p.add_argument("--methods", nargs="+", help="methods to train (default: every one the framework implements)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001],
                   help="every method is trained at each of these densities")
    p.add_argument("--mergecomp", nargs="*", default=["topk"],
                   help="methods also trained with groups='mergecomp' (--mergecomp alone: none)")
    p.add_argument("--outer", type=int, nargs="*", default=[10],
                   help="H values: --outer-methods also trained in outer steps of H inner steps (horovod_sparse.outer; "
                        "PyTorch only; --outer alone: none)")
    p.add_argument("--outer-methods", nargs="+", default=["none", "topk", "sparseloco"],
                   help="configurations trained in outer steps: none (DiLoCo) and methods, at the first --densities")
    p.add_argument("--compressors", nargs="+",
                   help="explicit configurations SPEC[@GROUPS] or SPEC+outer=H, e.g. none topk:density=0.01@mergecomp "
                        "none+outer=10 (replaces --methods/--densities/--mergecomp/--outer; dense is always trained)")
    p.add_argument("--link", type=link_rate, default="1gbit",
                   help="your cluster's link rate, as tc writes it (1gbit, 25gbit, 100mbit)")
    p.add_argument("--workers", type=int, default=8, help="your cluster's worker count")
    p.add_argument("--gpus-per-node", type=int, default=1,
                   help="your cluster's workers per node (NVLink-class links inside; they share the node's link): "
                        "projected flat with the node link shared and, for two-tier rows, two-tier")
    p.add_argument("--tolerance", type=float, default=1.0,
                   help="accuracy points below dense a recommended configuration may lose")
    p.add_argument("--emulate", action="store_true",
                   help="also measure every configuration on an emulated 1 Gbit/s cluster (root)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    add_arguments(p, seeds=[0], epochs=8, name="digits")
    return p


def configurations(args: argparse.Namespace) -> List[str]:
    """The job's configurations, in training order: compute-only, dense, then the methods and
    (PyTorch) the outer steps (:data:`OUTER`: ``--outer-methods`` at every ``--outer`` H), each
    followed by its two-tier twin (:data:`TWO_TIER`) when the hosts make one
    (:func:`two_tier_hosts`) or ``--compressors`` asks for it."""
    if args.compressors:
        chosen = [c for c in args.compressors if c != "none"]
    else:
        from benchmarks.emulated.synthetic import available_methods

        chosen = [f"{m}:density={d}" for m in args.methods or available_methods()
                  for d in args.densities]
        chosen += [f"{m}:density={d}@mergecomp" for m in args.mergecomp for d in args.densities]
        if args.framework == "torch":
            chosen += [f"{m if m == 'none' else f'{m}:density={args.densities[0]}'}{OUTER}{every}"
                       for every in args.outer for m in args.outer_methods]
    # A two-tier configuration is reported against its flat twin: the twin always trains too.
    asked = {c.removesuffix(TWO_TIER) for c in chosen if c.endswith(TWO_TIER)}
    flat = dict.fromkeys(c.removesuffix(TWO_TIER) for c in chosen)
    return [LOCAL, "none", *(tier for c in flat
                             for tier in ([c, c + TWO_TIER] if two_tier_hosts(args) or c in asked else [c]))]


# -- the job's ranks --------------------------------------------------------------------------------------
def train(label: str, args: argparse.Namespace) -> Dict[str, Any]:
    """Train configuration ``label`` once per seed with PyTorch; return its row (all ranks)."""
    import horovod.torch as hvd

    from benchmarks.main_job.digits_training import DigitsJob
    from benchmarks.shared.models import count_parameters

    configuration = parse_configuration(label)
    recorder = Recorder(label, args.epochs, announce=hvd.rank() == 0)
    for seed in args.seeds:
        job = DigitsJob(configuration.spec, hidden=args.hidden, lr=args.lr, batch_size=args.batch_size,
                        model_seed=seed, split_seed=0, groups=groups_argument(configuration.groups),
                        hierarchical=configuration.two_tier, every=configuration.every)
        search = getattr(job.opt, "mergecomp", None)
        settled = search is None
        loss = 0.0
        rounds = 0
        start = time.perf_counter()
        for step in job.steps(args.epochs, order_seed=seed * 1000 + hvd.rank()):
            stats = getattr(job.opt, "last_stats", None)
            if configuration.every is not None:  # a round's statistics, once: at the step that closed it
                stats, rounds = (stats if job.opt.steps != rounds else None), job.opt.steps
            inner = job.opt.inner_optimizer.last_stats if configuration.every and configuration.two_tier else None
            recorder.step(step.epoch, time.perf_counter() - start, stats, settled, inner)
            loss += float(step.loss)
            if step.step == job.steps_per_epoch - 1:
                recorder.end_epoch(seed, step.epoch, loss / job.steps_per_epoch)
                loss = 0.0
            settled = search is None or search.result is not None
            start = time.perf_counter()
        recorder.end_run(job.test_accuracy())
    return recorder.row(count_parameters(job.model), hvd.size(), **search_summary(search),
                        **placement(hvd, getattr(job.opt, "tiers", None)))


def run_worker(args: argparse.Namespace) -> None:
    """One rank of the job: every configuration of ``--compressors``; rank 0 writes the rows."""
    if args.framework == "tensorflow":
        from benchmarks.main_job import digits_tf

        rank, rows = digits_tf.run(args)
    else:
        import horovod.torch as hvd
        import torch

        hvd.init(process_sets=process_sets(args.compressors))
        torch.set_num_threads(1)
        rows = [train(label, args) for label in args.compressors]
        rank = hvd.rank()
    if rank == 0:
        write_results(args.results, "digits-job", rows, command_line(None, "benchmarks.main_job.digits"))


# -- the driver -----------------------------------------------------------------------------------------
def worker_argv(args: argparse.Namespace, configs: Sequence[str], results: Path) -> List[str]:
    """The command line of the job's ranks (rank 0 writes ``results``)."""
    return [sys.executable, "-m", "benchmarks.main_job.digits", "--worker", "--results", str(results),
            "--framework", args.framework, "--compressors", *configs, "--seeds", *map(str, args.seeds),
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
            "--hidden", str(args.hidden)]


def follower(stack: ExitStack, total: int, seeds: Sequence[int]) -> Callable[[str, str], None]:
    """``follow(where, line)``: a reader of rank 0's lines that reports every finished epoch of
    ``total`` to a progress display, opened (on ``stack``) at the first one so that the jobs'
    start-up (framework imports) does not inflate its ETA."""
    progress: List[Progress] = []

    def follow(where: str, line: str) -> None:
        if line.startswith(EPOCH_PREFIX):
            epoch = json.loads(line[len(EPOCH_PREFIX):])
            if not progress:
                progress.append(stack.enter_context(Progress(total, "digits")))
            seed = f" seed {epoch['seed']}" if len(seeds) > 1 else ""
            progress[0].done(f"{where}: {epoch['label']}{seed} epoch {epoch['epoch']}/{epoch['epochs']}",
                             f"training loss {epoch['loss']:.3f}")
    return follow


def run_jobs(args: argparse.Namespace, configs: Sequence[str]) -> Tuple[List[Dict[str, Any]],
                                                                       Optional[List[Dict[str, Any]]]]:
    """Train every configuration on this machine and, with ``--emulate``, on the emulated
    cluster; returns both jobs' rows (None for the second without ``--emulate``)."""
    jobs = 2 if args.emulate else 1
    print(f"[digits] {len(configs)} configurations (compute-only and dense included) x {args.epochs} epochs on "
          f"{args.np} workers ({FRAMEWORKS[args.framework]}): starting the job ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="hs-digits-") as tmp, ExitStack() as stack:
        follow = follower(stack, jobs * len(configs) * len(args.seeds) * args.epochs, args.seeds)
        local = Path(tmp, "local.json")
        horovodrun(args.np, worker_argv(args, configs, local), partial(follow, "this machine"), args.timeout,
                   hosts=",".join(f"{host}:{slots}" for host, slots in args.hosts))
        if not args.emulate:
            return read_results(local), None
        from benchmarks.emulated.netem import IFACE, EmulatedCluster, run_horovod

        emulated = Path(tmp, "emulated.json")
        where = f"emulated {digits_report.rate_name(digits_report.EMULATED_RATE)}"
        with EmulatedCluster(args.np, digits_report.EMULATED_RATE, workers_per_host=emulated_per_host(args)) as cluster:
            run_horovod(cluster, worker_argv(args, configs, emulated), args.timeout, partial(follow, where),
                        extra_env={"GLOO_SOCKET_IFNAME": IFACE})  # the outer steps' Gloo on the shaped link
        return read_results(local), read_results(emulated)


def link_fits(args: argparse.Namespace, command: str) -> Tuple[Dict[str, Any], str]:
    """The alpha-beta fits to project with (measuring the emulated link's first with
    ``--emulate``), and where they come from, in words."""
    fit_file = args.out / "alpha_beta.json"
    if args.emulate:
        inside = [scaling.NODE_FIT] if two_tier_hosts(args) else []
        scaling.load_fits(fit_file, [digits_report.EMULATED_RATE, *inside], False, command)
    if fit_file.exists():
        return read_results(fit_file), f"the alpha and beta fitted on this machine's emulated links ({fit_file})"
    return scaling.REFERENCE_FITS, "the alpha and beta fitted on the emulated cluster of the benchmarks"


def summary(args: argparse.Namespace, report: digits_report.Report, parameters: int) -> str:
    """The table with its title, footnotes and legend."""
    title = (f"digits MLP ({parameters:,} parameters), {FRAMEWORKS[args.framework]}, "
             f"{digits_report.where(report.dense)} (Gloo), "
             f"{args.epochs} epochs, batch {args.batch_size} per worker, seeds {' '.join(map(str, args.seeds))}")
    lines = [digits_report.table(report, title)]
    for row in report.rows:
        if "mergecomp" in row:
            groups, steps = row["mergecomp"]["groups"], row["mergecomp"]["search_steps"]
            lines.append(f"{row['label']}: MergeComp chose {groups} group{'s' * (groups != 1)} after a search of "
                         f"{steps} steps ({MERGECOMP.warmup_steps} + {MERGECOMP.timed_steps} per candidate), "
                         "measured after it.")
    job = f"{digits_report.where(report.dense)} on this machine, Gloo over loopback"
    lines.append(digits_report.legend(report, job, LOCAL_WORK[args.framework]))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = placed(parser().parse_args(argv))
    if args.worker:
        run_worker(args)
        return
    command = command_line(argv, "benchmarks.main_job.digits")
    rows, emulated_rows = run_jobs(args, configurations(args))
    fits, source = link_fits(args, command)
    target = (args.link, args.workers)
    report = digits_report.Report.build(rows, fits, source, target, emulated_rows, per_node=args.gpus_per_node,
                                        emulated_per_node=emulated_per_host(args))
    recommendation = digits_report.recommendation(report, target, args.tolerance)
    print(f"{summary(args, report, rows[0]['parameters'])}\n\n{recommendation}")
    projection = {label: [{"rate": rate, "workers": n, "step_seconds": s} for (rate, n), s in steps.items()]
                  for label, steps in report.steps.items()}
    path = write_results(args.out / f"{args.name}.json", "digits",
                         {"framework": args.framework, "epochs": args.epochs, "rows": rows,
                          "emulated_rows": emulated_rows, "fits": fits, "fits_source": source,
                          "projection": projection, "recommendation": recommendation}, command)
    figures = digits_report.figures(report, args.out, args.name, f"digits MLP, {FRAMEWORKS[args.framework]}")
    print("\n".join(f"wrote {written}" for written in [path, *figures]))


if __name__ == "__main__":
    main()
