"""Worker (``torchrun``, 2 processes): the DDP comm hook through PyTorch Lightning's ``Trainer``,
as Lightning documents it (``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, the state built
before the process group exists), against the same training written out with plain DDP and the
hook in the same job.

Lightning registers comm hooks only when its root device is a GPU (``DDPStrategy._register_ddp_hooks``);
on the CPU the strategy below registers through the helper Lightning uses there,
``lightning.pytorch.overrides.distributed._register_ddp_comm_hook``.

Each rank writes ``{out}/rank{r}.json``: whether the process group existed when the state was
built, both runs' final parameters and per step the density that reached each run's model (from
the states' statistics logs), and whether every rank ended with the same parameters.
"""
import io
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import horovod_sparse.ddp as hsd
from tests.workers.cli import configs_and_out

BATCH, SAMPLES = 8, 96


class CPUCommHookDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy, registering the comm hook on the CPU too (with Lightning's own helper)."""

    def _register_ddp_hooks(self) -> None:
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)


def network(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


class Regression(pl.LightningModule):
    def __init__(self, seed, lr):
        super().__init__()
        self.net, self.lr = network(seed), lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def data(seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 32, generator=generator)
    return TensorDataset(x, torch.tanh(x[:, :8] * 2.0))


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def same_everywhere(tensor):
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor)
    return all(torch.equal(tensor, other) for other in everyone)


def loader(dataset):
    """This rank's share of ``dataset``, in order (torchrun's rank: the process group may not exist yet)."""
    sampler = DistributedSampler(dataset, num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]),
                                 shuffle=False)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def plain_ddp(config, state, dataset):
    """The same training without Lightning: DDP with the hook, each rank its DistributedSampler's share."""
    model = torch.nn.parallel.DistributedDataParallel(network(config["seed"]))
    model.register_comm_hook(state, hsd.hook)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for x, y in loader(dataset):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.module


def main():
    configs, out = configs_and_out()
    (config,) = configs
    compression = hsd.Compression.create(config["method"], **config["options"])
    built_before_group = not dist.is_initialized()
    logs = [io.StringIO(), io.StringIO()]
    state = hsd.State(compression=compression, stats_log=logs[0])
    dataset = data(config["seed"])
    module = Regression(config["seed"], config["lr"])
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False,  # the loader below shards as the written-out run does
                         strategy=CPUCommHookDDPStrategy(process_group_backend="gloo", ddp_comm_state=state,
                                                         ddp_comm_hook=hsd.hook))
    trainer.fit(module, loader(dataset))
    reference_state = hsd.State(compression=hsd.Compression.create(config["method"], **config["options"]),
                                stats_log=logs[1])
    reference = plain_ddp(config, reference_state, dataset)
    lightning, written_out = flat(module.net), flat(reference)
    rank = dist.get_rank()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({
        "built_before_group": built_before_group, "lightning": lightning.tolist(), "plain": written_out.tolist(),
        "union_density": [[json.loads(line)["union_density"] for line in log.getvalue().splitlines()] for log in logs],
        "identical": same_everywhere(lightning)}))
    hsd.exit_job()


if __name__ == "__main__":
    main()
