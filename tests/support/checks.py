"""Assertions shared by the multi-worker tests: reference agreement, identical replicas,
conservation. They read what ``tests/workers/*`` wrote."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

from tests.support.streams import flat_gradients

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


#: Per dtype: the unit roundoff u = 2**-p (p significand bits, the implicit one included: eps/2),
#: the relative error of one rounding to nearest; and half the smallest subnormal, the absolute
#: error of one rounding near zero (where the relative bound fails).
ROUNDING = {"float64": (2.0 ** -53, 2.0 ** -1075), "float32": (2.0 ** -24, 2.0 ** -150),
            "float16": (2.0 ** -11, 2.0 ** -25), "bfloat16": (2.0 ** -8, 2.0 ** -134)}


def conservation_bound(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Elementwise bound on ``|delivered + mean residual - mean raw gradient|`` after ``T`` steps
    of error-feedback sparsification on ``R`` ranks with buffers of ``dtype``; ``raw[t, r]`` is
    rank r's float64 gradient at step t (zeros where it had none).

    In exact arithmetic the difference is 0. Each rounding to ``dtype`` errs by at most
    ``u * |v|`` (plus ``eta`` near zero) for the value ``v`` rounded; per element and step:

    * rank r's gradient cast to ``dtype``: ``|g[t, r]|``, counted with weight 1/R in the means;
    * rank r's buffer ``x = e + g``: ``|x[t, r]| <= X[t, r] = sum_{s<=t} |g[s, r]|`` (a residual
      holds at most the sum of its rank's past gradients, to first order in u), weight 1/R;
    * the aggregate: each rank's chunk scaled by 1/R, then added (2 roundings per rank, R ranks),
      each of a value ``<= sum_r X[t, r] / R``, weight 1 (it is delivered as it is);
    * the residual update subtracts exactly the value sent (equal values; or ``x - fl16(x)`` with
      ``fp16_values``, exact by Sterbenz's lemma): no rounding;
    * the check itself, in float64: ``T*R + T + R + 2`` additions and divisions of partial sums
      ``<= R * H``.

    So with ``C = sum_{t,r} |g[t, r]| / R`` and ``H = sum_{t,r} X[t, r] / R``:
    ``u (C + (1 + 2R) H) + u64 (T*R + T + R + 2) R H + 3 T R eta``.
    """
    u, eta = ROUNDING[dtype]
    steps, ranks = raw.shape[:2]
    magnitude = np.abs(raw)
    cast = magnitude.sum(axis=(0, 1)) / ranks
    held = np.cumsum(magnitude, axis=0).sum(axis=(0, 1)) / ranks
    check = ROUNDING["float64"][0] * (steps * ranks + steps + ranks + 2) * ranks * held
    return u * (cast + (1 + 2 * ranks) * held) + check + 3 * steps * ranks * eta


def assert_conserved(delivered: np.ndarray, residuals: Sequence[np.ndarray], raw: np.ndarray, dtype: str,
                     what: str) -> None:
    """Nothing lost, nothing invented, to within :func:`conservation_bound`: the updates
    ``delivered`` over ``raw``'s steps plus the mean of the ranks' ``residuals`` equal the mean
    raw gradient summed over the steps."""
    expected = raw.sum(axis=(0, 1)) / raw.shape[1]
    error = np.abs(delivered + sum(residuals) / len(residuals) - expected)
    bound = conservation_bound(raw, dtype)
    worst = int(np.argmax(error / bound))
    assert error[worst] <= bound[worst], (f"{what}: element {worst} off by {error[worst]:.3g}, more than the "
                                          f"{dtype} rounding bound {bound[worst]:.3g} (expected {expected[worst]:.4g})")


def assert_trains_beside_own_collectives(records: List[Dict[str, Any]], method: str,
                                         deliver_all: Sequence[str]) -> None:
    """The records of a model that makes collectives of its own (tests/workers/own_collectives.py),
    trained dense, with ``method`` at density 1 and at 0.1: identical replicas in every run, the
    dense run's parameters at density 1 (bitwise) where the method delivers everything there
    (``deliver_all``), and another training at density 0.1."""
    for record in records:
        assert record["dense_identical"] and record["full_identical"] and record["sparse_identical"]
        if method in deliver_all:
            np.testing.assert_array_equal(np.asarray(record["full"]), np.asarray(record["dense"]))
        assert record["sparse"] != record["dense"], "density 0.1 trained as the dense run"
