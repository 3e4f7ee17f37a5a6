"""``horovod_sparse.ddp.exit_job``: the end of a rank that cannot abort in the interpreter's
finalization (see :mod:`horovod_sparse.distributed.job_exit`).

The abort itself needs a Gloo worker thread that runs late, so no test can provoke it on
demand (``python -m benchmarks.costs.ddp_exit`` counts it over many jobs); what is tested is the
contract that rules it out: the process leaves with the given code without finalizing (no
``atexit`` handler runs), after the output written so far is flushed and the group destroyed.
Every ``torchrun`` worker of the suite ends with it too.
"""
import subprocess
import sys

import pytest

from tests.support.launch import worker_env

#: One rank in a group of one, holding a DDP model (which keeps the group alive past
#: ``destroy_process_group``): output written but not flushed (stdout is a pipe), an ``atexit``
#: handler, then ``exit_job``.
RANK = """
import atexit, sys
import torch, torch.distributed as dist
import horovod_sparse.ddp as hsd
if sys.argv[1] == "group":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.ones(1, 4)).sum().backward()
atexit.register(lambda: print("atexit ran", flush=True))
print("records written", end="")
print("to stderr", end="", file=sys.stderr)
hsd.exit_job(int(sys.argv[2]))
"""


@pytest.mark.parametrize("group,code", [("group", 3), ("none", 0)])
def test_exit_job_flushes_and_leaves_with_the_code_without_finalizing(group, code):
    env = {name: value for name, value in worker_env().items() if name != "PYTHONUNBUFFERED"}
    result = subprocess.run([sys.executable, "-c", RANK, group, str(code)], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == code, result.stderr
    assert result.stdout == "records written"  # flushed, and no atexit handler ran
    assert result.stderr.endswith("to stderr")
