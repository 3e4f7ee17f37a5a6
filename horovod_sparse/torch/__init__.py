"""PyTorch front end of horovod_sparse.

    import horovod.torch as hvd
    import horovod_sparse.torch as hs

    opt = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=hs.Compression.topk(density=0.01))

Horovod is imported when one of the names below is first used, not with the package. The
PyTorch layer it shares with the DDP hook and FSDP2, which run without Horovod, is
:mod:`horovod_sparse.torch_core`.
"""
from __future__ import annotations

import importlib
from typing import Any

#: The front end's names and the modules that define them.
_FRONT_END = {"Compression": "compression", "DistributedOptimizer": "optimizer", "OuterSteps": "outer_steps",
              "broadcast_optimizer_state": "functions", "node_process_set": "outer_steps", "elastic": None}

__all__ = ["Compression", "DistributedOptimizer", "OuterSteps", "Sparsifier", "broadcast_optimizer_state",
           "node_process_set"]


def __getattr__(name: str) -> Any:
    if name == "Sparsifier":
        from horovod_sparse.methods.base import Sparsifier
        return Sparsifier
    if name not in _FRONT_END:
        raise AttributeError(f"module 'horovod_sparse.torch' has no attribute {name!r}")
    elastic = importlib.import_module("horovod_sparse.torch.elastic")
    elastic.register()  # hvd.elastic.TorchState syncs our optimizers' shared state too
    module = _FRONT_END[name]
    return elastic if module is None else getattr(importlib.import_module(f"horovod_sparse.torch.{module}"), name)
