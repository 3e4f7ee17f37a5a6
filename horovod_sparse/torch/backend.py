"""PyTorch's backend for the Horovod front end: the primitives of
:class:`horovod_sparse.methods.backend.Backend`, the tensor ones from
:mod:`horovod_sparse.torch_core.tensor_backend` and :mod:`horovod_sparse.torch_core.histograms` and the
host collectives over Horovod.
"""
from horovod_sparse.torch.collectives import allgather_array, allgather_bytes, allgather_payload  # noqa: F401 (backend API)
from horovod_sparse.torch_core.histograms import *  # noqa: F401,F403 (backend API)
from horovod_sparse.torch_core.tensor_backend import *  # noqa: F401,F403 (backend API)

name = "torch"

STOCK_REFUSAL = (
    "{cls} is a horovod_sparse sparsifier: it sends (values, indices) payloads and keeps an "
    "error-feedback residual per gradient, which horovod.torch.DistributedOptimizer cannot do "
    "(it allreduces one dense tensor per gradient and would silently drop what is not sent). "
    "Use horovod_sparse.torch.DistributedOptimizer(optimizer, named_parameters=..., "
    "compression=...) instead; it takes the same arguments."
)
