"""Worker: Horovod elastic training with one sparse optimizer per method, through membership
changes that rank 0 asks for by rewriting the host-discovery file.

The run goes through ``--plan``'s host lists, one phase each, ``--steps`` training steps per
phase. After a phase's last step is committed, rank 0 writes the next host list and every rank
commits without training until Horovod reports the change (``HostsUpdatedInterrupt`` from
``state.commit()``, raised on every rank at the same commit): the number of steps per world is
fixed by the plan, whenever the driver notices. Each process (a removed or added worker too)
records what the test checks, one file per event, ``<process>.<seq>.npz`` (``process``: a
random name, unlike a pid never reused by a later worker):

* ``enter``: at every entry into the training function (after Horovod's state sync): rank,
  size, step, every optimizer's residuals, parameters, step counter and shared state;
* ``step``: after each step's ``synchronize()``: the aggregated gradient each optimizer
  delivered (flat, in parameter order);
* ``commit``: after each step's commit: residuals, parameters, step counters, shared state and
  the world size each group's method state was built for.
"""
import argparse
import json
import time
import uuid
from pathlib import Path
from typing import Dict, List

import horovod.torch as hvd
import numpy as np
import torch

import horovod_sparse.torch as hs
from horovod_sparse.common.consensus import json_bytes
from tests.support.streams import raw_gradient

SHAPES = [[40, 30], [30]]
#: Seconds between two idle commits while waiting for the driver to report a membership change:
#: only how often the worker looks; what it records does not depend on it.
POLL = 0.05


def make_optimizers(methods: List[str]) -> Dict[str, torch.optim.Optimizer]:
    """One SGD optimizer per method, over its own parameters (identical on every rank)."""
    optimizers = {}
    for m, method in enumerate(methods):
        generator = torch.Generator().manual_seed(100 + m)
        params = [torch.nn.Parameter(torch.randn(*s, generator=generator)) for s in SHAPES]
        optimizers[method] = hs.DistributedOptimizer(
            torch.optim.SGD(params, lr=0.01), named_parameters=[(f"{method}.p{i}", p) for i, p in enumerate(params)],
            compression=hs.Compression.create(method, density=0.05, min_numel=0))
    return optimizers


def params_of(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


class Recorder:
    """Writes this process's events (see the module docstring) under ``out``."""

    def __init__(self, out: Path, optimizers: Dict[str, torch.optim.Optimizer]) -> None:
        self.out, self.optimizers, self.seq = out, optimizers, 0
        self.process = uuid.uuid4().hex

    def write(self, kind: str, step: int, **arrays: np.ndarray) -> None:
        meta = {"kind": kind, "process": self.process, "rank": hvd.rank(), "size": hvd.size(), "step": step,
                "opt_steps": {m: opt.steps for m, opt in self.optimizers.items()}}
        if kind != "step":
            meta["shared"] = {m: json_bytes(opt._model.record(opt._groups, opt.steps, per_rank=False)).decode()
                              for m, opt in self.optimizers.items()}
            # the world size each group's method state was built for ((world size, elements), state)
            meta["built_for"] = {m: {g.name: opt._model.states.get(g.index, ((None, None), None))[0][0]
                                     for g in opt._groups} for m, opt in self.optimizers.items()}
            for m, opt in self.optimizers.items():
                for name, residual in opt.residuals().items():
                    arrays[f"residual.{m}.{name}"] = residual.double().numpy()
                arrays[f"params.{m}"] = torch.cat([p.detach().reshape(-1) for p in params_of(opt)]).double().numpy()
        tmp = self.out / f"{self.process}.{self.seq:04d}.tmp.npz"
        np.savez(tmp, meta=np.array(json.dumps(meta)), **arrays)
        tmp.rename(self.out / f"{self.process}.{self.seq:04d}.npz")  # complete files only
        self.seq += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts-file", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan", required=True, help="JSON list of host-file contents, one per phase")
    parser.add_argument("--steps", type=int, default=3, help="training steps per phase")
    parser.add_argument("--methods", default="topk,micro,exdyna,gtopk")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    plan = json.loads(args.plan)
    hvd.init()
    torch.set_num_threads(1)
    optimizers = make_optimizers(args.methods.split(","))
    record = Recorder(Path(args.out), optimizers)
    # The models' parameters reach a new worker through TorchState's model handler (broadcast).
    models = {f"model_{m}": torch.nn.ParameterList(params_of(opt)) for m, opt in optimizers.items()}
    state = hvd.elastic.TorchState(step=0, phase=0, **models, **{f"opt_{m}": opt for m, opt in optimizers.items()})

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        record.write("enter", state.step)
        while state.step < (state.phase + 1) * args.steps:
            for opt in optimizers.values():
                opt.zero_grad()
            for m, opt in enumerate(optimizers.values()):
                sum((p * torch.from_numpy(raw_gradient(args.seed + m, state.step, hvd.rank(), p.shape, i)).float())
                    .sum() for i, p in enumerate(params_of(opt))).backward()
            delivered = {}
            for m, opt in optimizers.items():
                opt.synchronize()
                delivered[f"delivered.{m}"] = torch.cat([p.grad.reshape(-1) for p in params_of(opt)]).double().numpy()
                with opt.skip_synchronize():
                    opt.step()
            record.write("step", state.step, **delivered)
            state.step += 1
            if state.step == (state.phase + 1) * args.steps and state.phase + 1 < len(plan):
                state.phase += 1  # committed with this step: the next world starts the next phase
            state.commit()
            record.write("commit", state.step)
            if state.step == state.phase * args.steps and state.phase > 0:
                # Asked for only now, so no commit of a training step can see the change.
                if hvd.rank() == 0:  # atomically: the driver must never read a half-written list
                    hosts = Path(args.hosts_file)
                    hosts.with_suffix(".tmp").write_text(plan[state.phase])
                    hosts.with_suffix(".tmp").replace(hosts)
                while True:  # until the driver reports the change: HostsUpdatedInterrupt
                    time.sleep(POLL)
                    state.commit()

    train(state)


if __name__ == "__main__":
    main()
