"""Worker: Horovod's outer steps (``horovod_sparse.torch.OuterSteps``) under Horovod elastic, a
round boundary the commit point, through a worker lost mid-round, one added, and one joining
with another configuration.

One :class:`OuterSteps` per config of :data:`CONFIGS` (Top-k and DiLoCo's dense average with SGD
of lr 1 outside, whose outer step is an exact subtraction; Top-k with DiLoCo's Nesterov outer
optimizer, whose momentum a joining worker must take), each over its own model, all in one
``hvd.elastic.TorchState`` committed whenever a round ends. The worlds (``--rounds`` rounds each):

1. the hosts file's three hosts of one slot each (3 workers);
2. rank 2 dies (``os._exit(1)``) one inner step into the next round, and the others pause before
   the round's last inner step (Horovod's background loops see the loss before the round-end
   exchange starts): that exchange fails, they roll back to the last commit and train the round
   again in a world of 2 (Horovod blacklists the failed host);
3. rank 0 writes the survivors' hosts, its own with 2 slots: a worker added (3 workers);
4. rank 0 marks the next joiner (a file ``mismatch`` in ``--out``) and gives the other host 2
   slots too: the new worker builds its outer steps with ``every + 1`` and the sync refuses it on
   every rank (``ValueError``), which each worker records before it ends.

The model's gradient at inner step ``t`` on rank ``r`` is ``tests.workers.given_gradients``'s
(``loss = sum(p * g)``); each process starts from parameters of its own (the first sync must
give every rank rank 0's). Every process writes its events, one file each,
``<process>.<seq>.npz`` (``process``: a random name):

* ``enter``: at every entry into the training function (after the sync): per config the
  parameters, anchor, residuals (absent: never exchanged), outer optimizer state (flat),
  position and step counter; Top-k's ``state_dict()`` key and the job size saved in it;
* ``round``: at every round's end, before its commit: the same, and per config each parameter's
  value after the round's last inner step (``theta``) and the sparse configs' averages;
* ``commit``: after every commit of a round (``round``: the rounds committed);
* ``refused``: the ``ValueError`` the last sync raised.
"""
import argparse
import io
import json
import os
import time
import uuid
from pathlib import Path
from typing import Dict

import horovod.torch as hvd
import numpy as np
import torch

import horovod_sparse.torch as hs
from tests.workers.given_gradients import make_params, step_gradients
from tests.workers.outer_steps import Given, RecordingSGD

SHAPES = [[30, 20], [20], [40, 30], [7]]
SEED = 5
#: name -> (method, outer optimizer): "sgd1" (SGD lr 1) or "diloco" (the default Nesterov SGD).
CONFIGS = {"topk": ("topk", "sgd1"), "none": ("none", "sgd1"), "diloco_topk": ("topk", "diloco")}
#: Seconds between two idle commits while waiting for the driver to report a membership change.
POLL = 0.05
#: Seconds the survivors pause in the round the lost worker leaves: only when the loss is seen.
PAUSE = 3.0
#: Gloo's timeout in the first world (seconds): Horovod's default, not the launcher's hang guard,
#: since a survivor may wait that long in a collective on another whose background loop the loss
#: stopped before it sees the loss itself. Later worlds take the launcher's (a joining worker may
#: start slowly).
FIRST_WORLD_GLOO_TIMEOUT = "30"


def build(name: str, every: int, seed: int) -> hs.OuterSteps:
    method, outer = CONFIGS[name]
    model = Given(make_params(SHAPES, seed, torch.float32))
    inner = RecordingSGD(model.parameters(), lr=0.1, momentum=0.9)
    compression = hs.Compression.none if method == "none" else hs.Compression.create(method, density=0.05,
                                                                                       min_numel=0)
    return hs.OuterSteps(model, inner, compression, every=every,
                         outer_optimizer=torch.optim.SGD(model.parameters(), lr=1.0) if outer == "sgd1" else None)


def flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors]).numpy() if tensors else np.zeros(0)


class Recorder:
    """Writes this process's events (the module docstring) under ``out``."""

    def __init__(self, out: Path, outers: Dict[str, hs.OuterSteps]) -> None:
        self.out, self.outers, self.seq = out, outers, 0
        self.process = uuid.uuid4().hex

    def write(self, kind: str, round_: int, **meta) -> None:
        arrays, meta = {}, {"kind": kind, "process": self.process, "rank": hvd.rank(), "size": hvd.size(),
                            "round": round_, **meta}
        if kind in ("enter", "round"):
            meta["steps"] = {name: outer.steps for name, outer in self.outers.items()}
            meta["position"] = {name: outer.position for name, outer in self.outers.items()}
            if kind == "enter":
                ((key, saved),) = self.outers["topk"].state_dict().items()
                meta["state_dict"] = [key, torch.load(io.BytesIO(saved), weights_only=True)["world_size"]]
            for name, outer in self.outers.items():
                arrays[f"params.{name}"] = flat(outer.model.parameters())
                arrays[f"anchor.{name}"] = flat(outer.anchor.flat)
                momenta = [s["momentum_buffer"] for s in outer.outer_optimizer.state.values()
                           if s.get("momentum_buffer") is not None]
                arrays[f"outer.{name}"] = flat(momenta)
                for i, group in enumerate(outer.groups):
                    if group.residual is not None:
                        arrays[f"residual.{name}.{i}"] = group.residual.double().numpy()
                    if kind == "round":
                        arrays[f"theta.{name}.{i}"] = outer.inner_optimizer.last[i].double().numpy()
                        if group.output is not None:
                            arrays[f"agg.{name}.{i}"] = group.output.double().numpy()
        tmp = self.out / f"{self.process}.{self.seq:04d}.tmp.npz"
        np.savez(tmp, meta=np.array(json.dumps(meta)), **arrays)
        tmp.rename(self.out / f"{self.process}.{self.seq:04d}.npz")  # complete files only
        self.seq += 1


def ask_for(hosts_file: Path, hosts: str) -> None:
    """Rank 0 writes the next host list (atomically: the driver never reads a half-written one)."""
    if hvd.rank() == 0:
        hosts_file.with_suffix(".tmp").write_text(hosts)
        hosts_file.with_suffix(".tmp").replace(hosts_file)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts-file", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per world")
    args = parser.parse_args()
    out, hosts_file, rounds = Path(args.out), Path(args.hosts_file), args.rounds
    mismatched = (out / "mismatch").exists()  # the last joiner: built with another every
    launcher_timeout = os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"]
    if not (out / "lost").exists():  # a worker of the first world
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = FIRST_WORLD_GLOO_TIMEOUT
    hvd.init()
    torch.set_num_threads(1)
    outers = {name: build(name, args.every + int(mismatched), SEED + 1 + hvd.rank()) for name in CONFIGS}
    record = Recorder(out, outers)
    state = hvd.elastic.TorchState(round=0, hosts=None, **outers)
    first = outers["topk"]
    started_here = None

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        nonlocal started_here
        started_here = state.round if started_here is None else started_here
        record.write("enter", state.round)
        while state.round < 3 * rounds:
            step = state.round * args.every + first.position
            if started_here == 0 and hvd.size() == 3 and state.round == rounds and first.position in (1, 2):
                if hvd.rank() == 2:
                    os._exit(1)  # lost mid-round, its residuals with it
                if first.position == 2:
                    os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = launcher_timeout  # the next worlds'
                    if hvd.rank() == 0:
                        (out / "lost").write_text("")
                    time.sleep(PAUSE)
            for outer in outers.values():
                params = list(outer.model.parameters())
                outer.model(step_gradients(params, SEED, step, hvd.rank())).backward()
                outer.step()
                outer.zero_grad()
            if first.position != 0:
                continue
            record.write("round", state.round)
            state.round += 1
            state.commit()  # the round boundary: the commit point
            record.write("commit", state.round)
            if state.round in (2 * rounds, 3 * rounds):
                if state.round == 2 * rounds:
                    state.hosts = hvd.allgather_object(os.environ["HOROVOD_HOSTNAME"])
                elif hvd.rank() == 0:
                    (out / "mismatch").write_text("every + 1")
                ask_for(hosts_file, f"{state.hosts[0]}:2\n{state.hosts[1]}:{1 if state.round == 2 * rounds else 2}\n")
                while True:  # until the driver reports the change: HostsUpdatedInterrupt
                    time.sleep(POLL)
                    state.commit()

    try:
        train(state)
    except ValueError as error:  # the mismatched joiner, refused by the sync on every rank
        record.write("refused", state.round, error=str(error))


if __name__ == "__main__":
    main()
