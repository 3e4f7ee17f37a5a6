"""Text this machine has: the Python standard library's sources, as bytes for a byte-level causal
language model (a vocabulary of 256, no tokenizer, no download).

The corpus is the standard library's top-level ``*.py`` files in name order, concatenated up to
``limit`` bytes; its last ``validation`` fraction is held out. Every machine with the same Python
version reads the same bytes.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Tuple

import torch

#: A byte-level model's vocabulary.
VOCABULARY = 256


def stdlib_corpus(limit: int = 2_000_000, validation: float = 0.05) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(train, validation)``: uint8 tensors of the standard library's sources (see the module
    docstring). Raises ``RuntimeError`` when the sources hold fewer than ``limit // 4`` bytes."""
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        chunks.append(data[:limit - total])
        total += len(chunks[-1])
        if total >= limit:
            break
    if total < limit // 4:
        raise RuntimeError(f"the standard library's sources hold only {total} bytes (wanted {limit})")
    corpus = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    cut = int(len(corpus) * (1 - validation))
    return corpus[:cut], corpus[cut:]


def windows(corpus: torch.Tensor, batch: int, context: int,
            generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``batch`` random windows of ``context`` bytes and the bytes that follow each
    position (next-token targets), as int64 ``(batch, context)`` tensors."""
    starts = torch.randint(0, len(corpus) - context - 1, (batch,), generator=generator)
    rows = torch.stack([corpus[s:s + context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]
