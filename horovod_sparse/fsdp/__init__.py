"""horovod_sparse for FSDP2: every method on the replica axis of sharded training.

    import horovod_sparse.fsdp as hsf

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = hsf.compress_replicas(model, compression=hsf.Compression.micro(density=0.01), mesh=mesh)

FSDP2 shards the parameters inside the ``shard`` group (a node) as usual; each FSDP unit's
reduce-scattered gradient shard is then exchanged across the replicas by the method, with an
error-feedback residual sharded like the parameter. See :mod:`horovod_sparse.fsdp.replicas`.
"""
from horovod_sparse.distributed.compression import Compression
from horovod_sparse.fsdp.replicas import State, compress_replicas

__all__ = ["Compression", "State", "compress_replicas"]
