"""A model that makes collectives of its own during the step, as synchronised batch norm and
models calling ``all_reduce`` do, for the workers that train it beside horovod_sparse's exchange.

PyTorch's ``SyncBatchNorm`` and Horovod's ``hvd.SyncBatchNorm`` refuse CPU tensors (their kernels,
``batch_norm_stats`` and the like, exist for GPUs only), so :class:`SyncBatchNorm` here makes their
collectives with plain tensor operations: in the forward pass an allgather of every rank's
per-channel mean, mean of squares and count (Horovod's and PyTorch's gather the per-rank
statistics), in the backward pass an allreduce of the per-channel sums of ``dy`` and
``dy * (x - mean)``; the affine parameters' gradients stay local, for the exchange to average.
:class:`GlobalMix` adds the batch mean averaged over every rank by a differentiable allreduce
(one more in the backward pass).

``collectives`` is ``(gather, reduce, average)``: ``gather(t)`` stacks every rank's ``t`` along a
new first axis, ``reduce(t)`` sums ``t`` over the ranks, ``average(t)`` averages it with a
gradient (the framework's differentiable allreduce).
"""
from typing import Any, Callable, List, Tuple

import torch

#: Methods that deliver every coordinate at density 1, so that they train there as the dense run
#: does. The threshold baselines select by their thresholds at any density (the hard threshold's
#: fixed 1 / (2 sqrt(k)), DGC's sampled threshold keeping 0.8-1.3 k, Gaussian-k's normal fit).
DELIVER_ALL = ("topk", "micro", "exdyna", "gtopk", "lags")

Collectives = Tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor],
                    Callable[[torch.Tensor], torch.Tensor]]


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                collectives: Collectives) -> torch.Tensor:
        gather, reduce, _ = collectives
        local = torch.cat([x.mean(0), (x * x).mean(0), torch.tensor([float(x.shape[0])])])
        everyone = gather(local)  # [world, 2C + 1]
        channels = x.shape[1]
        counts = everyone[:, -1:]
        total = counts.sum()
        mean = (everyone[:, :channels] * counts).sum(0) / total
        variance = (everyone[:, channels:2 * channels] * counts).sum(0) / total - mean * mean
        invstd = torch.rsqrt(variance + eps)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.reduce = total, reduce
        return (x - mean) * invstd * weight + bias

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        xhat = (x - mean) * invstd
        sums = ctx.reduce(torch.cat([dy.sum(0), (dy * (x - mean)).sum(0)]))
        sum_dy, sum_dy_xmu = sums[:x.shape[1]], sums[x.shape[1]:]
        dx = weight * invstd * (dy - sum_dy / ctx.total - (x - mean) * invstd * invstd * sum_dy_xmu / ctx.total)
        return dx, (dy * xhat).sum(0), dy.sum(0), None, None


class SyncBatchNorm(torch.nn.Module):
    """Batch norm over every rank's batch (training mode only), with SyncBatchNorm's collectives."""

    def __init__(self, channels: int, collectives: Collectives, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(channels))
        self.bias = torch.nn.Parameter(torch.zeros(channels))
        self.eps, self.collectives = eps, collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, self.eps, self.collectives)


class GlobalMix(torch.nn.Module):
    """``x`` plus its batch mean averaged over every rank (an allreduce in the forward pass and,
    through its gradient, one in the backward pass)."""

    def __init__(self, collectives: Collectives) -> None:
        super().__init__()
        self.average = collectives[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.average(x.mean(0, keepdim=True))


def make_model(seed: int, collectives: Collectives) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), SyncBatchNorm(32, collectives), torch.nn.Tanh(),
                               GlobalMix(collectives), torch.nn.Linear(32, 6))


def batch(step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 12, generator=generator), torch.randn(16, 6, generator=generator)


def train(model: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer,
          steps: int, rank: int) -> List[List[float]]:
    """``steps`` steps of ``opt`` on this rank's batches through ``forward`` (the model, or its
    DDP wrapper): ``model``'s parameters after each step, flattened."""
    history = []
    for step in range(steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(forward(x), y).backward()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
    return history
