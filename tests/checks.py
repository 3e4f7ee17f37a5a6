"""Assertions shared by the multi-worker tests: reference agreement, identical replicas,
conservation. They read what ``tests/workers/*`` wrote."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from tests.streams import flat_gradients

Reference = Callable[[List[List[np.ndarray]]], Tuple[List[np.ndarray], List[np.ndarray]]]


class Observed:
    """What every rank of one config wrote."""

    def __init__(self, out: Path, name: str, np_: int) -> None:
        self.arrays = [dict(np.load(out / f"{name}.rank{r}.npz")) for r in range(np_)]
        self.meta = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(np_)]
        self.size = np_

    @property
    def groups(self) -> List[List[int]]:
        return self.meta[0]["groups"]

    def aggregated(self, rank: int, step: int, members: Sequence[int]) -> np.ndarray:
        return np.concatenate([self.arrays[rank][f"agg_{step}_{i}"].reshape(-1) for i in members])

    def residual(self, rank: int, group: int) -> np.ndarray:
        return self.arrays[rank][f"residual_{group}"]

    def params(self, rank: int, prefix: str = "param") -> Dict[str, np.ndarray]:
        return {k: v for k, v in self.arrays[rank].items() if k.startswith(prefix + "_")}

    def stats(self, rank: int) -> List[dict]:
        return self.meta[rank]["stats"]


def assert_identical_replicas(obs: Observed) -> None:
    """Parameters are bitwise identical on every rank."""
    first = obs.params(0)
    for rank in range(1, obs.size):
        for key, value in obs.params(rank).items():
            np.testing.assert_array_equal(value, first[key], err_msg=f"rank {rank} {key} differs from rank 0")


def raw_group_stream(config: dict, size: int, members: Sequence[int]) -> List[List[np.ndarray]]:
    """``grads[t][r]``: every rank's raw flat gradient of a group, per step."""
    return [[flat_gradients(config["seed"], t, r, config["shapes"], members, config.get("stream", "normal"))
             for r in range(size)]
            for t in range(config["steps"])]


def assert_matches_reference(obs: Observed, config: dict, reference: Reference, rtol: float = 1e-5) -> None:
    """Every rank's aggregated gradient equals the reference at every step, and so do the residuals."""
    for g, members in enumerate(obs.groups):
        updates, residuals = reference(raw_group_stream(config, obs.size, members))
        for step, expected in enumerate(updates):
            atol = rtol * float(np.abs(expected).max() + 1e-12)
            for rank in range(obs.size):
                np.testing.assert_allclose(obs.aggregated(rank, step, members), expected, rtol=rtol, atol=atol,
                                           err_msg=f"{config['name']}: group {g} step {step} rank {rank}")
        for rank in range(obs.size):
            atol = rtol * float(np.abs(residuals[rank]).max() + 1e-12)
            np.testing.assert_allclose(obs.residual(rank, g), residuals[rank], rtol=rtol, atol=atol,
                                       err_msg=f"{config['name']}: residual of group {g} on rank {rank}")


def assert_conservation(obs: Observed, config: dict, rtol: float = 1e-5) -> None:
    """Nothing lost: sum of updates + mean of residuals == mean over ranks of the summed gradients."""
    for g, members in enumerate(obs.groups):
        stream = raw_group_stream(config, obs.size, members)
        expected = sum(sum(per_rank) for per_rank in stream) / obs.size
        delivered = sum(obs.aggregated(0, t, members) for t in range(config["steps"]))
        kept = sum(obs.residual(r, g) for r in range(obs.size)) / obs.size
        scale = float(np.abs(expected).max())
        np.testing.assert_allclose(delivered + kept, expected, rtol=rtol, atol=rtol * scale * config["steps"],
                                   err_msg=f"{config['name']}: group {g} lost gradient mass")


def assert_exchange_correct(obs: Observed, config: dict, reference: Reference) -> None:
    """One config's run agrees with the slow reference (aggregates and residuals), leaves bitwise
    identical replicas and loses no gradient mass."""
    assert_matches_reference(obs, config, reference)
    assert_identical_replicas(obs)
    assert_conservation(obs, config)
