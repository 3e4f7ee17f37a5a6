"""``torch.distributed`` as the DDP hook and FSDP2 use it: its collectives as a method sees them
(:mod:`~horovod_sparse.distributed.collectives`), the backend of both front ends
(:mod:`~horovod_sparse.distributed.backend`), their ``Compression`` namespace
(:mod:`~horovod_sparse.distributed.compression`), and their dense average
(:mod:`~horovod_sparse.distributed.dense`); their steps run on :mod:`horovod_sparse.engine.step`.
"""
