"""ExDyna (Yoon & Oh, CCGrid 2024), TensorFlow: MiCRO with block partitions re-balanced every step
(the shared partition tables of :mod:`horovod_sparse.common.partitioned`); selection, threshold
control and exchange are MiCRO's (:mod:`horovod_sparse.tensorflow.sparsifiers.micro`)."""
from __future__ import annotations

from horovod_sparse.common.registry import implements
from horovod_sparse.tensorflow.sparsifiers.micro import Micro


@implements("tensorflow", "exdyna")
class ExDyna(Micro):
    """ExDyna on the whole model's flat buffer (``groups="model"`` by default); its ``load_inc``
    statistic is the imbalance the balancer works against. Eager mode only, like MiCRO."""
