"""LAGS-SGD: layer-wise adaptive densities, launched from the backward hooks.

The method (:mod:`~horovod_sparse.methods.lags.exchange`) and its options, density rule and
backward-time measurement (:mod:`~horovod_sparse.methods.lags.rule`).
"""
from horovod_sparse.methods.lags.exchange import Lags

__all__ = ["Lags"]
