"""horovod_sparse's outer steps: DiLoCo-style rounds of local steps, every method on the exchange.

    import horovod_sparse.outer as hso

    outer = hso.OuterSteps(model, torch.optim.AdamW(model.parameters()),
                           compression=hso.Compression.topk(density=0.01), every=50)
    ...
    loss.backward()
    outer.step()
    outer.zero_grad()

See :mod:`horovod_sparse.outer.rounds`. It runs on ``torch.distributed`` (Gloo, NCCL) without
Horovod; end each rank with ``hso.exit_job()``, as the DDP hook's jobs. A model sharded by FSDP2
inside each replica takes ``process_group=mesh["replicate"].get_group()``: :mod:`horovod_sparse.outer.sharded`.
"""
from horovod_sparse.distributed.job_exit import exit_job
from horovod_sparse.distributed.compression import Compression
from horovod_sparse.outer.outer_optimizer import DILOCO_OUTER, diloco_outer_optimizer
from horovod_sparse.outer.rounds import OuterSteps

__all__ = ["Compression", "DILOCO_OUTER", "OuterSteps", "diloco_outer_optimizer", "exit_job"]
