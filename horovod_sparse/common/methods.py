"""Registration of every method's options, framework-free (one line per method).

Importing this module fills the registry; the framework packages import it before registering
their implementations.
"""
from horovod_sparse.common.options import SparsifierOptions
from horovod_sparse.common.registry import register_method

register_method("topk", SparsifierOptions,
                "exact top-k of |g+e| per group; allgather of values and indices (build-up up to n*k)")
