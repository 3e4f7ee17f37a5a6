"""The PyTorch layer the three PyTorch front ends share (Horovod's optimizer, the DDP hook, FSDP2):
the tensor primitives of the methods (:mod:`~horovod_sparse.torch_core.tensor_backend`,
:mod:`~horovod_sparse.torch_core.selection`), flat buffers (:mod:`~horovod_sparse.torch_core.buffers`),
the communicator base (:mod:`~horovod_sparse.torch_core.communicator`), finiteness, loss scales
and device timing. It imports neither Horovod nor ``torch.distributed``'s front ends.
"""
