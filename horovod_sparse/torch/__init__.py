"""PyTorch front end of horovod_sparse.

    import horovod.torch as hvd
    import horovod_sparse.torch as hs

    opt = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=hs.Compression.topk(density=0.01))
"""
from horovod_sparse.torch import elastic
from horovod_sparse.torch.compression import Compression
from horovod_sparse.torch.functions import broadcast_optimizer_state
from horovod_sparse.torch.optimizer import DistributedOptimizer
from horovod_sparse.methods.base import Sparsifier

elastic.register()  # hvd.elastic.TorchState syncs our optimizers' shared state too

__all__ = ["Compression", "DistributedOptimizer", "Sparsifier", "broadcast_optimizer_state"]
