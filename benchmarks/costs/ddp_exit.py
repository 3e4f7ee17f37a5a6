"""How often a 2-worker DDP job over Gloo aborts at exit, ended one way or the other.

    python -m benchmarks.costs.ddp_exit --rounds 60 --load 3 --parallel 2

Each round launches two ``torchrun --standalone`` jobs of 2 workers side by side with a tiny
model trained a few steps under three DDP configurations (dense, PyTorch's PowerSGD, our Top-k
hook), one ending as PyTorch documents (``dist.barrier()`` then ``dist.destroy_process_group()``,
then a normal exit) and one ending with :func:`horovod_sparse.ddp.exit_job`; ``--load`` processes
spin beside them, as a loaded CI machine does (the abort needs a Gloo worker thread that runs
late: see :mod:`horovod_sparse.distributed.job_exit`). ``--parallel`` rounds run at once. It prints, per
ending, the jobs run and those that failed, with each failure's signature (the launcher's exit
code and whether ``terminate called without an active exception`` was printed), and writes
them to ``--results`` (default ``results/ddp_exit.json``).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from benchmarks.shared.results import RESULTS_DIR, command_line, write_results

ENDINGS = ("destroy", "exit_job")
ABORT = "terminate called without an active exception"


def run_worker(ending: str) -> None:
    """One rank: three short DDP trainings over Gloo, then the ``ending``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    import horovod_sparse.ddp as hsd

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for config in ("dense", "powersgd", "topk"):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                                            torch.nn.Linear(32, 10)))
        if config == "powersgd":
            model.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                                 start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
        elif config == "topk":
            model.register_comm_hook(hsd.State(compression=hsd.Compression.topk(density=0.05)), hsd.hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(20):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,)))
            loss.backward()
            optimizer.step()
    if ending == "exit_job":
        hsd.exit_job()
    dist.barrier()
    dist.destroy_process_group()


def launch(ending: str) -> Dict[str, object]:
    """Run one 2-worker job ending with ``ending``: its exit code and whether it printed the abort."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH")])))
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
               "--no-python", sys.executable, "-m", "benchmarks.costs.ddp_exit", "--worker", ending]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    return {"ending": ending, "returncode": result.returncode, "abort": ABORT in result.stdout + result.stderr}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="rounds of one job per ending")
    parser.add_argument("--load", type=int, default=3, help="processes spinning beside the jobs")
    parser.add_argument("--parallel", type=int, default=2, help="rounds at once")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR / "ddp_exit.json")
    parser.add_argument("--worker", choices=ENDINGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker)
        return
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        with concurrent.futures.ThreadPoolExecutor(args.parallel * len(ENDINGS)) as pool:
            jobs = [pool.submit(launch, ending) for _ in range(args.rounds) for ending in ENDINGS]
            runs = [job.result() for job in jobs]
    finally:
        for spinner in spinners:
            spinner.kill()
    rows: List[Dict[str, object]] = []
    print(f"{'ending':<10} {'jobs':>5} {'failed':>7} {'aborted':>8}")
    for ending in ENDINGS:
        mine = [run for run in runs if run["ending"] == ending]
        failed = [run for run in mine if run["returncode"] != 0]
        rows.append({"ending": ending, "jobs": len(mine), "failed": len(failed),
                     "aborted": sum(bool(run["abort"]) for run in failed),
                     "returncodes": sorted({int(run["returncode"]) for run in failed})})  # type: ignore[call-overload]
        print(f"{ending:<10} {len(mine):>5} {len(failed):>7} {rows[-1]['aborted']:>8}")
    write_results(args.results, "ddp_exit", {"load": args.load, "parallel": args.parallel, "rows": rows},
                  command_line(argv, "benchmarks.costs.ddp_exit"))


if __name__ == "__main__":
    main()
