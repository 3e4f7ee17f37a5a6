"""Registration of every method's options, framework-free (one line per method).

Importing this module fills the registry; :mod:`horovod_sparse.methods` imports it before
registering the implementations.
"""
from horovod_sparse.common.options import SparsifierOptions
from horovod_sparse.common.registry import register_method

register_method("topk", SparsifierOptions,
                "exact top-k of |g+e| per group; allgather of values and indices (build-up up to n*k)")
from horovod_sparse.common.butterfly import GTopKOptions  # noqa: E402
register_method("gtopk", GTopKOptions,
                "global top-k of the sum over ranks: pairwise merges on a butterfly, k*log2(n) pairs sent per rank")
from horovod_sparse.common.lags import LagsOptions  # noqa: E402
register_method("lags", LagsOptions,
                "layer-wise top-k per merged layer group, sent from the hooks at a density fitted to the overlap")
from horovod_sparse.common.partitioned import ExDynaOptions, MicroOptions  # noqa: E402
register_method("micro", MicroOptions,
                "exclusive rotating partitions, one threshold, allreduce of values at the union (no build-up)")
register_method("exdyna", ExDynaOptions,
                "MiCRO with block partitions re-balanced every step to equalise the per-rank counts")
from horovod_sparse.common.threshold_baselines import DGCOptions  # noqa: E402
register_method("threshold", SparsifierOptions, "fixed threshold 1/(2 sqrt(k)) per group; allgather like Top-k")
register_method("dgc", DGCOptions, "sampled threshold with bounded refinement (DGC); allgather like Top-k")
register_method("gaussiank", SparsifierOptions, "threshold mean + z*std with up to 3 corrections; allgather like Top-k")
