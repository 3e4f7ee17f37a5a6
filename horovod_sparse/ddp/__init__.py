"""horovod_sparse for ``torch.distributed``: every method as a DDP comm hook, without Horovod.

    import horovod_sparse.ddp as hsd

    state = hsd.State(compression=hsd.Compression.micro(density=0.01))
    ddp_model.register_comm_hook(state, hsd.hook)

See :mod:`horovod_sparse.ddp.hook` for what the hook does and how it differs from the Horovod
front ends. End each rank with ``hsd.exit_job()`` (:mod:`horovod_sparse.distributed.job_exit`:
a Gloo job may otherwise abort at exit, after its work is done).
"""
from horovod_sparse.distributed.compression import Compression
from horovod_sparse.ddp.hook import State, hook
from horovod_sparse.distributed.job_exit import exit_job

__all__ = ["Compression", "State", "exit_job", "hook"]
