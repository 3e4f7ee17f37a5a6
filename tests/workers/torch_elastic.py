"""Worker: Horovod elastic training with the sparse optimizer. Rank 0 shrinks the host list
(via the discovery file) after a few committed steps; the survivors must carry on with
sparsifier state rebuilt for the new size, residuals kept, replicas identical."""
import argparse
import json
import time
from pathlib import Path

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hs
from tests.streams import raw_gradient

SHAPES = [[40, 30], [30]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts-file", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--shrink-at", type=int, default=5)
    parser.add_argument("--method", default="topk")
    # Only so that a job whose world never shrinks (a hang) ends by itself: at >= 0.1 s per step
    # once the shrink is asked for, it lasts longer than the test's process timeout.
    parser.add_argument("--max-steps", type=int, default=10000)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(*s, generator=generator)) for s in SHAPES]
    opt = hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.01),
                                  named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                  compression=hs.Compression.create(args.method, density=0.05, min_numel=0))
    model = torch.nn.ParameterList(params)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    sizes = []

    def done(state):
        # Enough steps, and the last few ran on the shrunk world (the driver polls the
        # discovery script, so the change lands some steps after the file is rewritten: however
        # many a busy machine needs; the test's process timeout only guards against a hang).
        return (state.step >= args.steps and sizes[-3:] == [2, 2, 2]) or state.step >= args.max_steps

    @hvd.elastic.run
    def train(state):
        while not done(state):
            if state.step > args.shrink_at and hvd.size() == 3:
                time.sleep(0.1)  # give the driver time to notice the new host list
            opt.zero_grad()
            sum((p * torch.from_numpy(raw_gradient(3, state.step, hvd.rank(), p.shape, i)).float()).sum()
                for i, p in enumerate(params)).backward()
            opt.step()
            sizes.append(hvd.size())
            state.step += 1
            if state.step == args.shrink_at and hvd.rank() == 0 and hvd.size() == 3:
                Path(args.hosts_file).write_text("localhost:2\n")
            state.commit()

    train(state)
    record = {"rank": hvd.rank(), "size": hvd.size(), "sizes": sizes, "steps": opt.steps,
              "params": [p.detach().double().numpy().tolist() for p in params],
              "residual_norms": [float(r.norm()) for r in opt.residuals().values()],
              "state_sizes": sorted({built_for for built_for, _ in opt._states.values()})}
    (Path(args.out) / f"elastic.rank{hvd.rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
