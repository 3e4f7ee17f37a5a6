"""The digits training the torch benchmarks share: the digits MLP trained data-parallel on
scikit-learn's digits with ``hs.DistributedOptimizer`` over SGD with momentum, one rank's shard of
the training set per worker (``benchmarks.digits``, ``benchmarks.convergence``, ``benchmarks.gtopk``).

Torch and Horovod are imported when a job is built, so a driver that only launches jobs can take
:func:`add_arguments` without them.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence

from benchmarks.results import RESULTS_DIR

if TYPE_CHECKING:
    import torch


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


def distributed_sgd(spec: str, model: Any, lr: float, groups: Any = None) -> Any:
    """``hs.DistributedOptimizer`` with compressor ``spec`` (``name:key=value,...``) over SGD with
    momentum 0.9 on ``model``'s parameters; ``lr`` is per worker, scaled by the worker count."""
    import horovod.torch as hvd
    import torch

    import horovod_sparse.torch as hs
    from horovod_sparse.common.registry import parse_spec

    name, options = parse_spec(spec)
    return hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hs.Compression.create(name, **options), groups=groups)


class Step(NamedTuple):
    """One optimizer step of :meth:`DigitsJob.steps`: its epoch, its index in the epoch and the
    training loss of this rank's batch."""

    epoch: int
    step: int
    loss: torch.Tensor


class DigitsJob:
    """This rank's part of a digits run: the data split with ``split_seed`` (the same on every
    rank), this rank's shard of the training set, the MLP initialised with ``model_seed`` and
    broadcast from rank 0, and its :func:`distributed_sgd` optimizer. Call after ``hvd.init()``.
    """

    def __init__(self, spec: str, *, hidden: int, lr: float, batch_size: int, model_seed: int, split_seed: int,
                 groups: Any = None) -> None:
        import horovod.torch as hvd
        import torch

        from benchmarks.data import digits_split, shard
        from benchmarks.models import digits_mlp, seeded

        x_train, y_train, self.x_test, self.y_test = digits_split(seed=split_seed)
        self.x_local = torch.from_numpy(shard(x_train, hvd.rank(), hvd.size()))
        self.y_local = torch.from_numpy(shard(y_train, hvd.rank(), hvd.size()))
        self.model = seeded(digits_mlp, model_seed, hidden)
        self.opt = distributed_sgd(spec, self.model, lr, groups)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.batch_size = batch_size
        #: Full batches of this rank's shard per epoch (the last, partial one is dropped).
        self.steps_per_epoch = len(self.x_local) // batch_size

    def steps(self, epochs: int, order_seed: int) -> Iterator[Step]:
        """Train ``epochs`` epochs with cross-entropy, the batches in an order drawn afresh every
        epoch from a generator seeded with ``order_seed``; yields after every ``opt.step()``, so
        the caller reads ``opt.last_stats`` (or evaluates, at an epoch's last step) in between."""
        import torch
        from torch import nn

        loss_fn = nn.CrossEntropyLoss()
        generator = torch.Generator().manual_seed(order_seed)
        for epoch in range(epochs):
            order = torch.randperm(len(self.x_local), generator=generator)
            for step in range(self.steps_per_epoch):
                batch = order[step * self.batch_size:(step + 1) * self.batch_size]
                self.opt.zero_grad()
                loss = loss_fn(self.model(self.x_local[batch]), self.y_local[batch])
                loss.backward()
                self.opt.step()
                yield Step(epoch, step, loss.detach())

    def test_accuracy(self) -> float:
        """Share of the test set the model classifies correctly."""
        import torch

        with torch.no_grad():
            return float((self.model(torch.from_numpy(self.x_test)).argmax(1).numpy() == self.y_test).mean())
