"""MiCRO and ExDyna: exclusive rotating partitions, one threshold, allreduce at the union.

The method (:mod:`~horovod_sparse.methods.micro.exchange`), its options
(:mod:`~horovod_sparse.methods.micro.options`), per-group state (:mod:`~horovod_sparse.methods.micro.state`)
and partition tables (:mod:`~horovod_sparse.methods.micro.partitions`), its threshold controllers
(:mod:`~horovod_sparse.methods.micro.controllers`), the histogram controller's candidates
(:mod:`~horovod_sparse.methods.micro.candidates`) and its rounds on an accelerator
(:mod:`~horovod_sparse.methods.micro.device_rounds`).
"""
from horovod_sparse.methods.micro.exchange import ExDyna, Micro

__all__ = ["ExDyna", "Micro"]
