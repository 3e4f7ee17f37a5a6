"""The parameters and per-rank gradients the PyTorch exchange workers train on (Horovod's and
DDP's alike, so their results compare bitwise)."""
from typing import List, Sequence

import torch

from tests.support.streams import raw_gradient


def make_params(shapes: Sequence[Sequence[int]], seed: int, dtype: torch.dtype) -> List[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=generator, dtype=dtype)) for s in shapes]


def step_gradients(params: Sequence[torch.Tensor], seed: int, step: int, rank: int,
                   stream: str = "normal") -> List[torch.Tensor]:
    """Rank ``rank``'s gradient of every parameter at ``step`` (``tests.support.streams.raw_gradient``)."""
    return [torch.from_numpy(raw_gradient(seed, step, rank, p.shape, i, stream)).to(p.dtype)
            for i, p in enumerate(params)]


def part_weights(passes: int) -> List[float]:
    """A step's gradient arrives over ``passes`` backward passes, in parts 1:2:...:passes."""
    return [part / (passes * (passes + 1) / 2) for part in range(1, passes + 1)]
