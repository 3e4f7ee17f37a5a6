"""Models the benchmarks train, defined here (torchvision has no CPU build on these machines)."""
from __future__ import annotations

import torch
from torch import nn


def digits_mlp(hidden: int = 256) -> nn.Module:
    """A 64-hidden-hidden-10 MLP for the 8x8 digits (about 85k parameters at hidden=256)."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def count_parameters(model: nn.Module) -> int:
    """Trainable parameter count."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def seeded(model_fn, seed: int, *args, **kwargs) -> nn.Module:
    """Build a model with ``torch.manual_seed(seed)`` so every rank starts identical."""
    torch.manual_seed(seed)
    return model_fn(*args, **kwargs)
