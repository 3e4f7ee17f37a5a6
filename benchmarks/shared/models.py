"""Models the benchmarks train, defined here (torchvision has no CPU build on these machines).

Besides the digits MLP of the main job, four standard shapes of workload, each registered in
:data:`MODELS` with the synthetic batch it eats:

* ``resnet20``: the CIFAR ResNet-20 (He et al. 2016, 0.27M parameters, 32x32 images): many small
  tensors, compute-bound;
* ``resnet50``: ImageNet ResNet-50 (bottleneck blocks 3-4-6-3, 25.6M parameters, 224x224 by
  default; any size >= 32 works);
* ``vgg``: a VGG-style net with four conv stages and a 4096-4096 classifier (26.8M parameters,
  94% of them in two fully connected layers, 32x32 images): little compute per byte of gradient,
  the communication-heavy case;
* ``lstm``: a two-layer LSTM language model (PTB "medium": vocabulary 10k, 650 units, 35 steps,
  19.8M parameters); a "sample" is one sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

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


# -- ResNets ---------------------------------------------------------------------------------------
def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> List[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class _Residual(nn.Module):
    """``relu(body(x) + shortcut(x))``; the shortcut is a strided 1x1 conv + BN when shapes change."""

    def __init__(self, body: nn.Sequential, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = body
        self.shortcut = (nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout
                         else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _basic_block(cin: int, cout: int, stride: int) -> nn.Module:
    body = nn.Sequential(*_conv_bn(cin, cout, 3, stride), nn.ReLU(), *_conv_bn(cout, cout, 3))
    return _Residual(body, cin, cout, stride)


def _bottleneck(cin: int, width: int, stride: int) -> nn.Module:
    cout = 4 * width
    body = nn.Sequential(*_conv_bn(cin, width, 1), nn.ReLU(), *_conv_bn(width, width, 3, stride), nn.ReLU(),
                         *_conv_bn(width, cout, 1))
    return _Residual(body, cin, cout, stride)


def _stages(block: Callable[[int, int, int], nn.Module], cin: int, widths: List[int], depths: List[int],
            expansion: int) -> Tuple[nn.Sequential, int]:
    layers: List[nn.Module] = []
    for stage, (width, depth) in enumerate(zip(widths, depths)):
        for i in range(depth):
            layers.append(block(cin, width, 2 if stage > 0 and i == 0 else 1))
            cin = width * expansion
    return nn.Sequential(*layers), cin


def resnet20(num_classes: int = 10) -> nn.Module:
    """CIFAR ResNet-20: a 3x3/16 stem, three stages of three basic blocks (16, 32, 64 channels)."""
    body, width = _stages(_basic_block, 16, [16, 32, 64], [3, 3, 3], expansion=1)
    return nn.Sequential(*_conv_bn(3, 16, 3), nn.ReLU(), body, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, num_classes))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ImageNet ResNet-50: 7x7/64 stem and max-pool, bottleneck stages 3-4-6-3, global pooling."""
    body, width = _stages(_bottleneck, 64, [64, 128, 256, 512], [3, 4, 6, 3], expansion=4)
    stem = [*_conv_bn(3, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    return nn.Sequential(*stem, body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))


# -- VGG-like and LSTM -----------------------------------------------------------------------------
def vgg(num_classes: int = 10, channels: Tuple[int, ...] = (64, 128, 256, 512), hidden: int = 4096,
        image_size: int = 32) -> nn.Module:
    """Conv3x3-BN-ReLU + max-pool per stage, then VGG's classifier (two ``hidden`` FC layers with
    dropout). At the defaults the classifier holds 25.2M of 26.8M parameters."""
    layers: List[nn.Module] = []
    cin = 3
    for cout in channels:
        layers += [*_conv_bn(cin, cout, 3), nn.ReLU(), nn.MaxPool2d(2)]
        cin = cout
    side = image_size // 2 ** len(channels)
    if side < 1:
        raise ValueError(f"vgg: image_size {image_size} is too small for {len(channels)} pooling stages")
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(cin * side * side, hidden), nn.ReLU(), nn.Dropout(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(), nn.Linear(hidden, num_classes))


class LSTMLanguageModel(nn.Module):
    """Embedding -> stacked LSTM -> linear decoder over the vocabulary.

    ``forward(tokens)`` takes ``(batch, steps)`` token ids and returns logits shaped
    ``(batch, vocabulary, steps)``, which ``cross_entropy(logits, next_tokens)`` takes as is.
    """

    def __init__(self, vocabulary: int = 10000, hidden: int = 650, layers: int = 2, dropout: float = 0.5) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True, dropout=dropout)
        self.decoder = nn.Linear(hidden, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(self.embedding(tokens))
        return self.decoder(states).transpose(1, 2)


def lstm(vocabulary: int = 10000, hidden: int = 650, layers: int = 2) -> nn.Module:
    """The PTB "medium" LSTM language model (19.8M parameters at the defaults)."""
    return LSTMLanguageModel(vocabulary, hidden, layers)


class CausalTransformer(nn.Module):
    """A GPT-2-style causal language model: token and position embeddings, pre-norm transformer
    blocks (GELU), a final norm and a decoder tied to the token embedding.

    ``forward(tokens)`` takes ``(batch, steps)`` token ids and returns logits shaped
    ``(batch, vocabulary, steps)``, which ``cross_entropy(logits, next_tokens)`` takes as is.
    """

    def __init__(self, vocabulary: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        steps = tokens.shape[1]
        hidden = self.tokens(tokens) + self.positions(torch.arange(steps, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(steps, device=tokens.device)
        hidden = self.norm(self.blocks(hidden, mask=mask, is_causal=True))
        return (hidden @ self.tokens.weight.t()).transpose(1, 2)


def gpt2_small() -> nn.Module:
    """A GPT-2-small-sized causal transformer: 12 blocks of width 768, 12 heads, a 50,257-token
    vocabulary and 1,024 positions (124.4M parameters, GPT-2 small's count)."""
    return CausalTransformer(50257, 1024, 768, 12, 12)


# -- the registry the synthetic benchmarks use -----------------------------------------------------
Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model and the fixed synthetic batch it trains on.

    Attributes:
        build: ``build(size)`` returns the model; ``size`` is the image side (or sequence length).
        batch: ``batch(batch_size, size, generator)`` returns ``(inputs, targets)`` for
            ``cross_entropy(model(inputs), targets)``.
        default_size: image side / sequence length used when none is given.
        summary: one line for ``--help`` and result files.
    """

    build: Callable[[int], nn.Module]
    batch: Callable[[int, int, torch.Generator], Batch]
    default_size: int
    summary: str


def _images(classes: int) -> Callable[[int, int, torch.Generator], Batch]:
    def batch(batch_size: int, size: int, generator: torch.Generator) -> Batch:
        return (torch.randn(batch_size, 3, size, size, generator=generator),
                torch.randint(classes, (batch_size,), generator=generator))
    return batch


def _token_sequences(vocabulary: int) -> Callable[[int, int, torch.Generator], Batch]:
    def batch(batch_size: int, steps: int, generator: torch.Generator) -> Batch:
        tokens = torch.randint(vocabulary, (batch_size, steps + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return batch


MODELS: Dict[str, ModelSpec] = {
    "resnet20": ModelSpec(lambda size: resnet20(), _images(10), 32,
                          "CIFAR ResNet-20, 0.27M parameters, compute-bound"),
    "resnet50": ModelSpec(lambda size: resnet50(), _images(1000), 224,
                          "ImageNet ResNet-50, 25.6M parameters"),
    "vgg": ModelSpec(lambda size: vgg(image_size=size), _images(10), 32,
                     "VGG-like, 26.8M parameters (25.2M in the classifier), communication-heavy"),
    "lstm": ModelSpec(lambda steps: lstm(), _token_sequences(10000), 35,
                      "2-layer LSTM language model, 19.8M parameters, 35-step sequences"),
    "gpt2small": ModelSpec(lambda steps: gpt2_small(), _token_sequences(50257), 1024,
                           "GPT-2-small-sized causal transformer, 124.4M parameters, 1024-token sequences"),
}


def model_spec(name: str) -> ModelSpec:
    """Look up a benchmark model, raising a ValueError that lists the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None
