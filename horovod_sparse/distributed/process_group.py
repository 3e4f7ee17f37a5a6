"""A ``torch.distributed`` process group as the shared code sees a Horovod process set."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class ProcessGroup:
    """A ``torch.distributed`` process group (None: the default, every process), which may be
    named before ``init_process_group`` runs: nothing here asks ``torch.distributed`` anything
    until the first collective.

    Collectives on NCCL groups take CUDA tensors: :attr:`device` is where host payloads go."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self._device: Optional[torch.device] = None

    @property
    def device(self) -> torch.device:
        """Where host payloads go: the current CUDA device on an NCCL group (until
        :meth:`place_payloads_with` says otherwise), else the CPU. Known once the group exists."""
        if self._device is None:
            if not dist.is_initialized():
                raise RuntimeError("horovod_sparse needs torch.distributed's process group at its first exchange: "
                                   "call torch.distributed.init_process_group before training")
            self._device = (torch.device("cuda", torch.cuda.current_device())
                            if dist.get_backend(self.group) == dist.Backend.NCCL else torch.device("cpu"))
        return self._device

    def place_payloads_with(self, tensor: torch.Tensor) -> None:
        """On an NCCL group, send host payloads to ``tensor``'s device from now on: the device
        DDP's model lives on, which need not be the current one when the group was built."""
        if self.device.type == "cuda":
            self._device = tensor.device

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def rank(self) -> int:
        return dist.get_rank(self.group)
