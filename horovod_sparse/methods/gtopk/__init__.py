"""gTop-k: the exactly-k global top-k by a butterfly of pairwise merges.

The method (:mod:`~horovod_sparse.methods.gtopk.exchange`) and its options and schedule
(:mod:`~horovod_sparse.methods.gtopk.butterfly`).
"""
from horovod_sparse.methods.gtopk.exchange import GTopK

__all__ = ["GTopK"]
