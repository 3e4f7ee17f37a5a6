"""PyTorch's backend for the ``torch.distributed`` front end: the primitives of
:class:`horovod_sparse.methods.backend.Backend`, the tensor ones from
:mod:`horovod_sparse.torch_core.tensor_backend` and :mod:`horovod_sparse.torch_core.histograms` and the
host collectives over ``torch.distributed``.
"""
from horovod_sparse.distributed.host_collectives import allgather_array, allgather_bytes, allgather_payload  # noqa: F401 (backend API)
from horovod_sparse.torch_core.histograms import *  # noqa: F401,F403 (backend API)
from horovod_sparse.torch_core.tensor_backend import *  # noqa: F401,F403 (backend API)

name = "ddp"

STOCK_REFUSAL = (
    "{cls} is a horovod_sparse sparsifier for DDP: it sends (values, indices) payloads and keeps "
    "an error-feedback residual per bucket, which only its comm hook can do. Register it with "
    "ddp_model.register_comm_hook(horovod_sparse.ddp.State(compression=...), horovod_sparse.ddp.hook)."
)
