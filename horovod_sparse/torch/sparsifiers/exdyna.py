"""ExDyna (Yoon & Oh, CCGrid 2024): MiCRO with block partitions re-balanced every step.

The buffer is cut into ``num_blocks`` blocks (a multiple of 32 elements each, the remainder to
the last partition); each partition is a run of blocks whose boundaries move between steps so
that every rank selects about ``k / n`` coordinates, computed identically on every rank from the
gathered per-rank counts (``balancer="prefix"``, the default, or ``"paper"``, the published
pairwise rule; see :mod:`horovod_sparse.common.partitions`). Selection, threshold control and
the exchange are MiCRO's (:mod:`horovod_sparse.torch.sparsifiers.micro`).
"""
from __future__ import annotations

from horovod_sparse.common.registry import implements
from horovod_sparse.torch.sparsifiers.micro import Micro


@implements("torch", "exdyna")
class ExDyna(Micro):
    """ExDyna on the whole model's flat buffer (``groups="model"`` by default); its ``load_inc``
    statistic is the imbalance the balancer works against."""
