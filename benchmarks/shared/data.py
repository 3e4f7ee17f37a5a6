"""Data that ships or is generated: scikit-learn's bundled digits, and synthetic batches."""
from __future__ import annotations

from typing import Tuple

import numpy as np


def digits_split(test_fraction: float = 0.25, seed: int = 0) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The 1797 8x8 digit images of scikit-learn (bundled, no download), standardised, split into
    train and test identically on every rank. Returns float32 features and int64 labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    features = (data.data / 16.0).astype(np.float32)
    features = (features - features.mean(0)) / (features.std(0) + 1e-6)
    labels = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(len(labels) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return features[train], labels[train], features[test], labels[test]


def shard(array: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s share of ``array`` (every size-th row, starting at ``rank``)."""
    return array[rank::size]
