"""``torch.distributed`` as the DDP hook, FSDP2 and the outer steps use it: its collectives as a
method sees them (:mod:`~horovod_sparse.distributed.collectives`), the backend of the three
front ends (:mod:`~horovod_sparse.distributed.backend`), their ``Compression`` namespace
(:mod:`~horovod_sparse.distributed.compression`), their dense average
(:mod:`~horovod_sparse.distributed.dense`), the step engine over a process group
(:mod:`~horovod_sparse.distributed.stepping`: their steps run on :mod:`horovod_sparse.engine.step`)
and the end of a rank of a Gloo job (:mod:`~horovod_sparse.distributed.job_exit`).
"""
