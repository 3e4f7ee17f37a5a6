"""Worker (``torchrun``): the DDP comm hook beside a model that makes ``torch.distributed``
collectives of its own in both passes, on the same process group (a synchronised batch norm and an
allreduce in its forward, tests/workers/own_collectives.py).

Each config: {"method"}; per rank it writes ``{index}.rank{r}.json``: the parameters after each of
4 steps with ``Compression.none`` (``dense``), with the method at density 1 (``full``) and at 0.1
(``sparse``), and per run whether every rank ended with the same parameters.
"""
import json

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as differentiable

import horovod_sparse.ddp as hsd
from tests.workers import own_collectives
from tests.workers.cli import configs_and_out


def gather(tensor):
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor.contiguous())
    return torch.stack(everyone)


def reduce(tensor):
    tensor = tensor.clone()
    dist.all_reduce(tensor)
    return tensor


def average(tensor):
    return differentiable.all_reduce(tensor) / dist.get_world_size()


def train(method, density):
    """Parameters after each of 4 steps (DDP's first is dense) and whether the replicas agree."""
    model = own_collectives.make_model(0, (gather, reduce, average))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    compression = (hsd.Compression.none if method == "none"
                   else hsd.Compression.create(method, density=density, min_numel=0))
    ddp.register_comm_hook(hsd.State(compression=compression), hsd.hook)
    history = own_collectives.train(model, ddp, torch.optim.SGD(model.parameters(), lr=0.05), 4, dist.get_rank())
    last = torch.tensor(history[-1])
    return history, bool((gather(last) == last).all())


def main():
    configs, out = configs_and_out()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for index, config in enumerate(configs):
        record = {}
        for run, method, density in (("dense", "none", None), ("full", config["method"], 1.0),
                                     ("sparse", config["method"], 0.1)):
            record[run], record[f"{run}_identical"] = train(method, density)
        (out / f"{index}.rank{dist.get_rank()}.json").write_text(json.dumps(record))
    hsd.exit_job()


if __name__ == "__main__":
    main()
