"""PyTorch implementations, one module per method; importing this package registers them all."""
import horovod_sparse.common.methods  # noqa: F401  (the options must be registered first)
from horovod_sparse.torch.sparsifiers import topk  # noqa: F401
