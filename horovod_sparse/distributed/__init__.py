"""``torch.distributed`` as the DDP hook, FSDP2 and the outer steps use it: a process group as the
shared code sees a process set (:mod:`~horovod_sparse.distributed.process_group`), its collectives
as a method sees them (:mod:`~horovod_sparse.distributed.communicator`), the blocking ones the host
reads (:mod:`~horovod_sparse.distributed.host_collectives`), the two tiers' groups
(:mod:`~horovod_sparse.distributed.tiers`), the backend of the three
front ends (:mod:`~horovod_sparse.distributed.backend`), their ``Compression`` namespace
(:mod:`~horovod_sparse.distributed.compression`), their dense average
(:mod:`~horovod_sparse.distributed.dense`), the step engine over a process group
(:mod:`~horovod_sparse.distributed.stepping`: their steps run on :mod:`horovod_sparse.engine.step`)
and the end of a rank of a Gloo job (:mod:`~horovod_sparse.distributed.job_exit`).
"""
