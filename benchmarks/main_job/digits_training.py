"""The digits training the torch benchmarks share: the digits MLP trained data-parallel on
scikit-learn's digits with SGD with momentum, one rank's shard of the training set per worker,
either with ``hs.DistributedOptimizer`` in a Horovod job (``benchmarks.main_job.digits``,
``benchmarks.main_job.convergence``, ``benchmarks.costs.gtopk``) or as ``DistributedDataParallel`` with a comm hook
in a ``torchrun`` job (:class:`DdpExchange`, ``benchmarks.main_job.convergence --ddp``); and what the
drivers of such jobs share: their options (:func:`add_arguments`), the local launches
(:func:`horovodrun`, :func:`torchrun`) and the main job's measurement of a run (:class:`Recorder`,
framework-free: :mod:`benchmarks.main_job.digits_tf` records Keras runs with it).

Torch, and Horovod for a Horovod job, are imported when a job is built, so a driver that only
launches jobs can take :func:`add_arguments`, :func:`horovodrun` and :func:`torchrun` without them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from benchmarks.shared.results import RESULTS_DIR
from horovod_sparse.common.mergecomp import MergeCompOptions

if TYPE_CHECKING:
    import torch

    from horovod_sparse.common.stats import StepStats

#: The configuration that trains without any exchange: the compute-only baseline of a step.
LOCAL = "local"
#: How rank 0 of a main-job worker starts the line it prints after every epoch, a JSON object
#: ``{"label", "seed", "epoch" (1-based), "epochs", "loss"}`` following it (the driver's progress).
EPOCH_PREFIX = "epoch-done "
#: MergeComp's search of the main job's ``SPEC@mergecomp`` configurations, shortened to fit its few
#: epochs: 1 warm-up and 3 timed steps per candidate (the reference's 5 + 20 would outlast the
#: training); the other options are the defaults.
MERGECOMP = MergeCompOptions(warmup_steps=1, timed_steps=3)
#: The suffix of a main-job configuration that runs the two-tier exchange (``hierarchical=True``:
#: dense inside a host, the method across hosts), e.g. ``topk:density=0.01+two-tier``.
TWO_TIER = "+two-tier"
#: The suffix of a main-job configuration trained in outer steps of H inner steps
#: (``horovod_sparse.outer``, DiLoCo: ``none+outer=10``; a method on the pseudo-gradients:
#: ``topk:density=0.01+outer=10``), on Horovod's collectives (``horovod_sparse.torch.OuterSteps``).
OUTER = "+outer="
#: The DDP configuration with PyTorch's PowerSGD hook (:class:`DdpExchange`).
POWERSGD = "powersgd"


def add_arguments(parser: argparse.ArgumentParser, *, seeds: Sequence[int], epochs: int, name: str) -> None:
    """The options of a benchmark that launches ``horovodrun`` jobs of digits training: the training
    (``--seeds --epochs --batch-size --lr --hidden``), where the results go (``--out --name``) and
    the hidden ``--worker --results`` the job's ranks run with."""
    parser.add_argument("--seeds", type=int, nargs="+", default=list(seeds))
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.02, help="per worker; scaled by the worker count")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default=name, help="result file name stem")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)


def horovodrun(workers: int, argv: Sequence[str], on_line: Callable[[str], None],
               timeout: Optional[float] = None, hosts: Optional[str] = None) -> None:
    """Run the command ``argv`` as a ``horovodrun --gloo`` job of ``workers`` ranks on ``hosts``
    (horovodrun's ``-H``, e.g. ``localhost:2,127.0.0.1:2``: two hosts of this machine; default all
    on ``localhost``); ``on_line`` sees rank 0's stdout lines. As :func:`_run_job` otherwise."""
    def rank0(line: str) -> None:
        if line.startswith("[0]<stdout>:"):
            on_line(line.split(":", 1)[1].rstrip("\n"))

    _run_job([str(Path(sys.executable).with_name("horovodrun")), "-np", str(workers),
              "-H", hosts or f"localhost:{workers}", "--gloo", *argv], rank0, timeout)


def torchrun(workers: int, argv: Sequence[str], on_line: Callable[[str], None],
             timeout: Optional[float] = None) -> None:
    """Run the command ``argv`` as a ``torchrun --standalone`` job of ``workers`` processes on this
    machine (its own rendezvous on a free port); ``on_line`` sees every line the job prints, the
    processes' stdout and stderr unprefixed (a worker that is to be followed prints on rank 0
    only). As :func:`_run_job` otherwise."""
    _run_job([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", str(workers),
              "--no-python", *argv], lambda line: on_line(line.rstrip("\n")), timeout)


def _run_job(command: Sequence[str], on_line: Callable[[str], None], timeout: Optional[float]) -> None:
    """Run a launcher ``command`` (the repository on ``PYTHONPATH``, one thread per rank,
    TensorFlow's C++ logging silenced), handing ``on_line`` every line of its stdout and stderr.
    Raises with the job's output when it fails or runs past ``timeout`` seconds (it is killed
    then; None: no limit)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    late = threading.Event()

    def stop() -> None:
        late.set()
        process.kill()

    deadline = threading.Timer(timeout, stop) if timeout is not None else None
    if deadline is not None:
        deadline.start()
    output: List[str] = []
    assert process.stdout is not None
    try:
        for line in process.stdout:
            output.append(line)
            on_line(line)
    finally:
        if deadline is not None:
            deadline.cancel()
        if process.poll() is None:
            process.kill()
        process.wait()
    if process.returncode != 0:
        what = f"ran past {timeout:.0f} s" if late.is_set() else f"exited {process.returncode}"
        raise RuntimeError(f"{' '.join(command)} {what}:\n{''.join(output[-80:])}")


class Recorder:
    """What the main job measures of one configuration, over every seed it trains: the test
    accuracy after the last epoch, and the wall time and the optimizer's statistics of the steps
    of the second half of the epochs that follow any search (the steady state: after warm-ups,
    and after MergeComp's search). On rank 0 (``announce``) it prints an :data:`EPOCH_PREFIX`
    line after every epoch."""

    def __init__(self, label: str, epochs: int, announce: bool) -> None:
        self.label = label
        self.epochs = epochs
        self.announce = announce
        self.accuracies: List[float] = []
        self.step_seconds: List[float] = []
        self.stats: List[StepStats] = []
        #: The inner steps' own exchange of two-tier outer steps (dense, inside the host), per step.
        self.inner_stats: List[StepStats] = []

    def step(self, epoch: int, seconds: float, stats: Optional[StepStats], settled: bool = True,
             inner: Optional[StepStats] = None) -> None:
        """One training step of ``epoch`` (0-based) took ``seconds``; ``stats`` is the
        optimizer's ``last_stats`` (None without exchange; for outer steps, the round's, given at
        the step that closed it only), ``inner`` the inner steps' optimizer's of two-tier outer
        steps (every step); ``settled`` is False while the step belonged to a search
        (MergeComp's), which then does not count either."""
        if epoch >= self.epochs // 2 and settled:
            self.step_seconds.append(seconds)
            if stats is not None:
                self.stats.append(stats)
            if inner is not None:
                self.inner_stats.append(inner)

    def end_epoch(self, seed: int, epoch: int, loss: float) -> None:
        """Epoch ``epoch`` (0-based) of the run with ``seed`` ended with mean training ``loss``."""
        if self.announce:
            print(EPOCH_PREFIX + json.dumps({"label": self.label, "seed": seed, "epoch": epoch + 1,
                                             "epochs": self.epochs, "loss": loss}), flush=True)

    def end_run(self, accuracy: float) -> None:
        """One seed's run ended with test ``accuracy`` (a fraction)."""
        self.accuracies.append(accuracy)

    def row(self, parameters: int, workers: int, **extra: Any) -> Dict[str, Any]:
        """The configuration's row: ``label``, ``compressor`` (the method's name, or ``local``),
        ``options``, ``groups``, ``hierarchical`` (two-tier asked), ``accuracy`` (mean over seeds) and ``accuracies``,
        ``step_seconds`` (median steady-state step), ``stats``
        (:func:`benchmarks.emulated.synthetic_harness.summarize_stats` of the steady-state steps; empty without
        exchange), ``parameters``, ``workers``, ``extra``."""
        import numpy as np

        from benchmarks.emulated.synthetic_harness import summarize_stats
        from horovod_sparse.common.registry import parse_spec

        if not self.step_seconds:
            raise RuntimeError(f"{self.label}: no settled step in the second half of the {self.epochs} epochs "
                               "(MergeComp's search ran past it): train more epochs")
        configuration = parse_configuration(self.label)
        name, options = parse_spec(configuration.spec)
        every = configuration.every
        # An outer row's steps are H - 1 without exchange and one with: their mean is its step.
        step = np.mean if every else np.median
        stats = summarize_stats(self.stats, parameters)
        if every:
            stats = with_inner(per_step(stats, every), summarize_stats(self.inner_stats, parameters))
        return {"label": self.label, "compressor": name, "options": options, "groups": configuration.groups,
                "hierarchical": configuration.two_tier, "every": every,
                "accuracy": float(np.mean(self.accuracies)), "accuracies": self.accuracies,
                "step_seconds": float(step(self.step_seconds)), "stats": stats,
                "parameters": parameters, "workers": workers, **extra}


def per_step(summary: Dict[str, Any], every: int) -> Dict[str, Any]:
    """A summary of outer rounds (:func:`benchmarks.emulated.synthetic_harness.summarize_stats` of each round's
    statistics) per inner step: bytes, collectives and seconds divided by the ``every`` steps of a
    round (what the round cost, spread over it); densities as they are (a round's)."""
    if not summary:
        return summary
    return {**summary, "bytes_sent": summary["bytes_sent"] / every, "bytes_received": summary["bytes_received"] / every,
            "bytes_sent_by_kind": {k: v / every for k, v in summary["bytes_sent_by_kind"].items()},
            "collectives": summary["collectives"] / every,
            "seconds": {phase: v / every for phase, v in summary["seconds"].items()}}


def with_inner(summary: Dict[str, Any], inner: Dict[str, Any]) -> Dict[str, Any]:
    """An outer row's per-step ``summary`` (:func:`per_step`) with its inner steps' own exchange
    (``inner``: :func:`benchmarks.emulated.synthetic_harness.summarize_stats` of the inner
    optimizer's steps; none but in two tiers) added: its bytes are the host's (``node``), its
    collectives and seconds the step's."""
    if not inner:
        return summary
    kinds = dict(summary["bytes_sent_by_kind"])
    kinds["node"] = kinds.get("node", 0.0) + inner["bytes_sent"]
    phases = set(summary["seconds"]) | set(inner["seconds"])
    return {**summary, "bytes_sent": summary["bytes_sent"] + inner["bytes_sent"],
            "bytes_received": summary["bytes_received"] + inner["bytes_received"], "bytes_sent_by_kind": kinds,
            "collectives": summary["collectives"] + inner["collectives"],
            "seconds": {p: summary["seconds"].get(p, 0.0) + inner["seconds"].get(p, 0.0) for p in sorted(phases)}}


def scaled_sgd(model: Any, lr: float, workers: int) -> Any:
    """SGD with momentum 0.9 on ``model``'s parameters; ``lr`` is per worker, scaled by ``workers``."""
    import torch

    return torch.optim.SGD(model.parameters(), lr=lr * workers, momentum=0.9)


def distributed_sgd(spec: str, model: Any, lr: float, groups: Any = None, hierarchical: bool = False) -> Any:
    """``hs.DistributedOptimizer`` with compressor ``spec`` (``name:key=value,...``), ``groups``
    and ``hierarchical`` (never Horovod's environment switch) over :func:`scaled_sgd` on
    ``model``'s parameters (the Horovod job's size). ``spec`` :data:`LOCAL` returns that SGD
    itself: no exchange (the compute-only baseline)."""
    import horovod.torch as hvd

    import horovod_sparse.torch as hs
    from horovod_sparse.common.registry import parse_spec

    sgd = scaled_sgd(model, lr, hvd.size())
    if spec == LOCAL:
        return sgd
    name, options = parse_spec(spec)
    return hs.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                   compression=hs.Compression.create(name, **options), groups=groups,
                                   hierarchical=hierarchical)


class DdpExchange:
    """``DistributedDataParallel`` around ``model`` (DDP's default buckets) exchanging with the DDP
    configuration ``spec``, and the payload a rank sends per step. Call after
    ``dist.init_process_group``.

    ``spec`` is ``none`` (DDP's own bucket allreduce, no comm hook), :data:`POWERSGD`
    ``powersgd:rank=R,start=S`` (PyTorch's ``powerSGD_hook`` with ``matrix_approximation_rank`` R
    and ``start_powerSGD_iter`` S, its other options at their defaults: error feedback, warm
    start), or a horovod_sparse method spec ``name:key=value,...`` (:func:`horovod_sparse.ddp.hook`;
    each bucket is one group, so a model in one bucket is exchanged as one group).
    """

    def __init__(self, spec: str, model: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        import horovod_sparse.ddp as hsd
        from benchmarks.shared.ddp_baselines import SerialPowerSGDState
        from horovod_sparse.common.registry import parse_spec

        self.module = DistributedDataParallel(model)
        #: Bytes of every gradient: what a dense allreduce sends per step.
        self.dense_bytes: int = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        #: horovod_sparse's hook state (a method spec), else None.
        self.state: Optional[hsd.State] = None
        #: PowerSGD's hook state (:data:`POWERSGD`), else None.
        self.powersgd: Optional[SerialPowerSGDState] = None
        #: PowerSGD's count of what it allreduced when this step's first bucket started.
        self._powersgd_start = 0
        self._element_size = next(p for p in model.parameters() if p.requires_grad).element_size()
        name, options = parse_spec(spec)
        if name == POWERSGD:
            self.powersgd = SerialPowerSGDState(process_group=None, matrix_approximation_rank=options["rank"],
                                                start_powerSGD_iter=options["start"])
            self.module.register_comm_hook(self, _counted_powersgd)
        elif name != "none":
            self.state = hsd.State(compression=hsd.Compression.create(name, **options))
            self.module.register_comm_hook(self.state, hsd.hook)

    def traffic(self) -> Tuple[int, Optional[float]]:
        """The last step's payload bytes this rank sent and its union density, as the Horovod
        optimizer's ``last_stats.bytes_sent()`` and ``union_density`` count them (a collective's
        input, once): horovod_sparse's hook reports them itself; DDP's allreduce sends every
        gradient (union density 1); PowerSGD sends its P and Q matrices and the tensors it does
        not compress (1-D ones among them), and every gradient before its start iteration, and has
        no union density (None: its update is low-rank, not a set of coordinates)."""
        if self.state is not None:
            assert self.state.last_stats is not None
            return self.state.last_stats.bytes_sent(), self.state.last_stats.union_density
        if self.powersgd is not None:
            compressed = self.powersgd.total_numel_after_compression - self._powersgd_start
            return (compressed * self._element_size if compressed else self.dense_bytes), None
        return self.dense_bytes, 1.0


# DDP refuses a hook whose ``bucket`` or return annotation is not the object itself (postponed
# annotations are strings): they are left out here.
def _counted_powersgd(exchange: DdpExchange, bucket):
    """PyTorch's ``powerSGD_hook`` on ``exchange.powersgd`` for ``bucket`` (a ``dist.GradBucket``;
    returns its future), one bucket after another as on Gloo
    (:func:`benchmarks.shared.ddp_baselines.serial_powersgd_hook`), marking where a step's count of
    what it allreduced starts: DDP calls hooks in bucket order, and a step's buckets have finished
    before the next step's first one starts."""
    from benchmarks.shared.ddp_baselines import serial_powersgd_hook

    state = exchange.powersgd
    assert state is not None
    if bucket.index() == 0:
        exchange._powersgd_start = state.total_numel_after_compression
    return serial_powersgd_hook(state, bucket)


class Configuration(NamedTuple):
    """A main-job configuration ``SPEC[@GROUPS][+two-tier]`` or ``SPEC+outer=H[+two-tier]`` taken apart: the
    compressor ``spec`` (``name:key=value,...``, or :data:`LOCAL`), the optimizer's ``groups``
    (None: Horovod's own grouping), whether it asks for the two-tier exchange
    (``hierarchical=True``) and the inner steps of its outer steps (:data:`OUTER`; None: per step)."""

    spec: str
    groups: Optional[str]
    two_tier: bool
    every: Optional[int] = None


def parse_configuration(label: str) -> Configuration:
    """The :class:`Configuration` of a main-job label, e.g. ``topk:density=0.01@mergecomp+two-tier``
    -> ``("topk:density=0.01", "mergecomp", True, None)``, ``none+outer=10`` -> ``("none", None,
    False, 10)``, ``none+outer=10+two-tier`` -> ``("none", None, True, 10)``."""
    two_tier = label.endswith(TWO_TIER)
    spec, outer, every = label.removesuffix(TWO_TIER).partition(OUTER)
    if outer:
        return Configuration(spec, None, two_tier, int(every))
    spec, _, groups = spec.partition("@")
    return Configuration(spec, groups or None, two_tier)


def process_sets(labels: Sequence[str]) -> Optional[str]:
    """``hvd.init``'s ``process_sets``: ``"dynamic"`` when a configuration runs two-tier (its
    node and slice process sets are added as it starts), else None."""
    return "dynamic" if any(parse_configuration(label).two_tier for label in labels) else None


def groups_argument(groups: Optional[str]) -> Any:
    """The optimizer's ``groups=`` for a configuration's ``GROUPS``: :data:`MERGECOMP` for
    ``mergecomp``, any other form as it is."""
    return MERGECOMP if groups == "mergecomp" else groups


def search_summary(scheduler: Any) -> Dict[str, Any]:
    """A row's ``mergecomp`` entry (``groups`` chosen, ``search_steps``) once ``scheduler`` (an
    optimizer's MergeComp scheduler, or None) has chosen; else nothing."""
    if scheduler is None or scheduler.result is None:
        return {}
    return {"mergecomp": {"groups": len(scheduler.result.groups), "search_steps": scheduler.result.search_steps}}


class Step(NamedTuple):
    """One optimizer step of :meth:`DigitsJob.steps`: its epoch, its index in the epoch and the
    training loss of this rank's batch."""

    epoch: int
    step: int
    loss: torch.Tensor


class DigitsJob:
    """This rank's part of a digits run: the data split with ``split_seed`` (the same on every
    rank), this rank's shard of the training set, the MLP initialised with ``model_seed`` (the same
    on every rank, and broadcast from rank 0) and its optimizer. In a Horovod job (call after
    ``hvd.init()``) that is :func:`distributed_sgd` with compressor ``spec``, ``groups`` and
    ``hierarchical``; with ``every`` (in a Horovod job too) it is trained in outer steps of
    ``every`` inner :func:`scaled_sgd` steps (Horovod's ``horovod_sparse.torch.OuterSteps`` with
    compressor ``spec``; outside, DiLoCo's Nesterov SGD for ``none``, SGD at lr 1 for a
    method, as SparseLoCo; with ``hierarchical`` across the hosts, the inner steps averaged
    inside each host by ``hs.DistributedOptimizer`` over ``hs.node_process_set()``); with
    ``ddp`` (call after ``dist.init_process_group``) the model is trained as
    ``DistributedDataParallel`` exchanging with the DDP configuration ``spec``
    (:class:`DdpExchange`, kept in ``exchange``) and :func:`scaled_sgd` steps it; ``groups`` must
    then be None (DDP's buckets are the groups) and ``hierarchical`` False. Both train the same:
    the same data, batches, model and learning rate, the gradients averaged over the workers.
    """

    def __init__(self, spec: str, *, hidden: int, lr: float, batch_size: int, model_seed: int, split_seed: int,
                 groups: Any = None, hierarchical: bool = False, ddp: bool = False,
                 every: Optional[int] = None) -> None:
        import torch

        from benchmarks.shared.data import digits_split, shard
        from benchmarks.shared.models import digits_mlp, seeded

        self.model = seeded(digits_mlp, model_seed, hidden)
        #: The DDP job's exchange (``ddp``), else None.
        self.exchange: Optional[DdpExchange] = None
        if every is not None:
            import horovod.torch as hvd

            import horovod_sparse.torch as hs
            from horovod_sparse.common.registry import parse_spec

            self.rank, self.size = hvd.rank(), hvd.size()
            name, options = parse_spec(spec)
            compression = hs.Compression.none if name == "none" else hs.Compression.create(name, **options)
            # DiLoCo's Nesterov SGD outside for the dense rounds, SparseLoCo's SGD at lr 1 for a method's.
            outer = None if name == "none" else torch.optim.SGD(self.model.parameters(), lr=1.0)
            inner = scaled_sgd(self.model, lr, self.size)
            if hierarchical:  # the inner steps averaged inside the host (each host one replica)
                inner = hs.DistributedOptimizer(inner, named_parameters=self.model.named_parameters(),
                                                compression=hs.Compression.none, process_set=hs.node_process_set())
            self.opt = hs.OuterSteps(self.model, inner, compression, every=every, outer_optimizer=outer,
                                     hierarchical=hierarchical)
            self.network = self.model
        elif ddp:
            import torch.distributed as dist

            if groups is not None or hierarchical:
                raise ValueError(f"groups={groups!r}, hierarchical={hierarchical}: a DDP job's groups are DDP's "
                                 "buckets and its exchange flat")
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self.exchange = DdpExchange(spec, self.model)
            self.opt = scaled_sgd(self.model, lr, self.size)
            #: What the training steps call: the DDP module, or the model itself.
            self.network: torch.nn.Module = self.exchange.module
        else:
            import horovod.torch as hvd

            self.rank, self.size = hvd.rank(), hvd.size()
            self.opt = distributed_sgd(spec, self.model, lr, groups, hierarchical)
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
            self.network = self.model
        x_train, y_train, self.x_test, self.y_test = digits_split(seed=split_seed)
        self.x_local = torch.from_numpy(shard(x_train, self.rank, self.size))
        self.y_local = torch.from_numpy(shard(y_train, self.rank, self.size))
        self.batch_size = batch_size
        #: Full batches of this rank's shard per epoch (the last, partial one is dropped).
        self.steps_per_epoch = len(self.x_local) // batch_size

    def steps(self, epochs: int, order_seed: int) -> Iterator[Step]:
        """Train ``epochs`` epochs with cross-entropy, the batches in an order drawn afresh every
        epoch from a generator seeded with ``order_seed``; yields after every ``opt.step()``, so
        the caller reads :meth:`traffic` or the Horovod optimizer's ``opt.last_stats`` (or
        evaluates, at an epoch's last step) in between."""
        import torch
        from torch import nn

        loss_fn = nn.CrossEntropyLoss()
        generator = torch.Generator().manual_seed(order_seed)
        for epoch in range(epochs):
            order = torch.randperm(len(self.x_local), generator=generator)
            for step in range(self.steps_per_epoch):
                batch = order[step * self.batch_size:(step + 1) * self.batch_size]
                self.opt.zero_grad()
                loss = loss_fn(self.network(self.x_local[batch]), self.y_local[batch])
                loss.backward()
                self.opt.step()
                yield Step(epoch, step, loss.detach())

    def traffic(self) -> Tuple[int, Optional[float]]:
        """The last step's payload bytes this rank sent and union density: the optimizer's
        ``last_stats`` in a Horovod job (not :data:`LOCAL`, which has none), else
        :meth:`DdpExchange.traffic`."""
        if self.exchange is not None:
            return self.exchange.traffic()
        return self.opt.last_stats.bytes_sent(), self.opt.last_stats.union_density

    def test_accuracy(self) -> float:
        """Share of the test set the model classifies correctly."""
        import torch

        with torch.no_grad():
            return float((self.model(torch.from_numpy(self.x_test)).argmax(1).numpy() == self.y_test).mean())
