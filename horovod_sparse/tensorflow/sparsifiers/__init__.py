"""TensorFlow implementations, one module per method; importing this package registers them all."""
import horovod_sparse.common.methods  # noqa: F401  (the options must be registered first)
from horovod_sparse.tensorflow.sparsifiers import topk  # noqa: F401
from horovod_sparse.tensorflow.sparsifiers import gtopk  # noqa: F401
from horovod_sparse.tensorflow.sparsifiers import lags  # noqa: F401
from horovod_sparse.tensorflow.sparsifiers import micro  # noqa: F401
from horovod_sparse.tensorflow.sparsifiers import exdyna  # noqa: F401
from horovod_sparse.tensorflow.sparsifiers import threshold  # noqa: F401
from horovod_sparse.tensorflow.sparsifiers import dgc  # noqa: F401
from horovod_sparse.tensorflow.sparsifiers import gaussiank  # noqa: F401
