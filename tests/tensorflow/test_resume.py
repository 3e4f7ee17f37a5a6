"""Exact resume of the TensorFlow front end, for every method registered for TensorFlow, through
``DistributedGradientTape`` (eager, and inside ``tf.function``) and the Keras
``DistributedOptimizer`` (``train_on_batch``, traced): N steps + save + fresh processes + load + N
steps equals 2N continuous steps, bitwise, in the weights, the optimizer's variables and the
exchanger's state (residuals, step counter, method state). The configurations put the state that
matters in the checkpoint: ExDyna's moved boundaries, MiCRO's and ExDyna's thresholds, DGC's
velocity, gTop-k's schedule, warm-up and density schedules saved midway, the default ``min_numel``.
A checkpoint loaded by another number of workers keeps the residuals and rebuilds the method state;
one of other groups raises on every rank (``tests/workers/tf_resume.py``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

import horovod_sparse.methods  # noqa: F401  (fills the registry)
from horovod_sparse.common import registry
from horovod_sparse.methods.micro.partitions import BlockLayout
from tests.support.checks import assert_conserved
from tests.support.launch import rank_records, run_configs

NP = 2
RESIZED_NP = 3
HALF = 4
# Tape configs of one launch share an exchanger when their method, options and groups are equal
# (as every tape of a process does), so within one api and across the two tape apis each config
# of a method has its own options.
OPTIONS = {
    "tape": {
        "topk": {"density": 0.05},
        "gtopk": {"density": 0.05, "min_numel": 0},
        "lags": {"density": 0.05, "min_numel": 0, "group_size": 300},
        "threshold": {"density": 0.05, "min_numel": 0},
        "micro": {"density": 0.05, "min_numel": 0},
        "exdyna": {"density": 0.05, "min_numel": 0, "num_blocks": 64},
        "dgc": {"density": 0.05, "min_numel": 0, "momentum": 0.9},
        "gaussiank": {"density": 0.05, "min_numel": 0, "warmup_steps": 6},
        "sparseloco": {"density": 0.05, "min_numel": 0, "chunk_size": 64},
    },
    "tape_function": {
        "topk": {"density": 0.05, "min_numel": 0, "warmup_steps": 6},
        "gtopk": {"density": 0.05, "density_schedule": "exp_warmup:3"},
        "lags": {"density": 0.05},
        "threshold": {"density": 0.05, "min_numel": 0, "density_schedule": "piecewise:0.2@6"},
        "micro": {"density": 0.05, "min_numel": 0, "density_schedule": "piecewise:0.1@6"},
        "exdyna": {"density": 0.05, "min_numel": 0, "num_blocks": 32},
        "dgc": {"density": 0.05, "min_numel": 0, "momentum": 0.5, "sample_ratio": 0.25},
        "gaussiank": {"density": 0.05, "min_numel": 0, "fp16_values": True},
        "sparseloco": {"density": 0.05, "min_numel": 0, "chunk_size": 50, "bits": 4},
    },
    "keras": {
        "topk": {"density": 0.05, "min_numel": 0, "density_schedule": "exp_warmup:3"},
        "gtopk": {"density": 0.05, "min_numel": 0, "warmup_steps": 6},
        "lags": {"density": 0.05, "min_numel": 0, "group_size": 300},
        "threshold": {"density": 0.05},
        "micro": {"density": 0.05, "min_numel": 0, "controller": "paper"},
        "exdyna": {"density": 0.05, "balancer": "paper"},
        "dgc": {"density": 0.05, "min_numel": 0, "momentum": 0.9, "density_schedule": "exp_warmup:3"},
        "gaussiank": {"density": 0.05, "min_numel": 0, "warmup_steps": 6},
        "sparseloco": {"density": 0.05, "bits": None},
    },
}
CONFIGS = [{"name": f"{api}_{method}", "api": api, "method": method, "options": options, "half": HALF}
           for api, methods in OPTIONS.items() for method, options in methods.items()]
#: Saved by NP workers, loaded by RESIZED_NP: methods whose state depends on the worker count.
RESIZED = [dict(config, phase="resized") for config in CONFIGS
           if config["api"] == "tape" and config["method"] in ("micro", "exdyna", "gtopk")]
OTHER_GROUPS = dict(next(c for c in CONFIGS if c["name"] == "tape_micro"), phase="other_groups", load_groups="tensor")


def test_every_method_and_api_is_covered():
    for api in OPTIONS:
        assert {c["method"] for c in CONFIGS if c["api"] == api} == set(registry.method_names()), api


@pytest.fixture(scope="module")
def job(tmp_path_factory: Any) -> Path:
    """The three launches: 2N steps saving at N, then N steps from the checkpoints in fresh
    processes, then the checkpoints loaded by more workers and with other groups."""
    out = tmp_path_factory.mktemp("tf_resume")
    for folder in ("checkpoints", "first", "second", "resized"):
        (out / folder).mkdir()
    where = {"checkpoints": str(out / "checkpoints")}
    run_configs("tf_resume.py", NP, out / "first", [dict(c, **where, phase="first") for c in CONFIGS])
    run_configs("tf_resume.py", NP, out / "second", [dict(c, **where, phase="second") for c in CONFIGS])
    run_configs("tf_resume.py", RESIZED_NP, out / "resized", [dict(c, **where) for c in RESIZED + [OTHER_GROUPS]])
    return out


def array(record: Dict[str, Any]) -> np.ndarray:
    """An array the worker wrote (dtype, shape, hex of its bytes)."""
    return np.frombuffer(bytes.fromhex(record["hex"]), dtype=record["dtype"]).reshape(record["shape"])


def first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two records differ ('' when bitwise equal), with the values there."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(a)} != {sorted(b)}"
        if set(a) == {"dtype", "shape", "hex"}:
            return "" if a == b else f"{path}: {array(a)} != {array(b)}"
        return next((d for key in a for d in [first_difference(a[key], b[key], f"{path}.{key}")] if d), "")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b))
                     for d in [first_difference(x, y, f"{path}[{i}]")] if d), "")
    return "" if a == b else f"{path}: {a!r} != {b!r}"


def layout_of(state: Dict[str, Any]) -> Dict[str, Any]:
    """The one variable list an exchanger's state dict holds in these runs."""
    (layout,) = state["layouts"]
    return layout


@pytest.mark.parametrize("index,config", list(enumerate(CONFIGS)), ids=[c["name"] for c in CONFIGS])
def test_resumed_run_is_bitwise_the_continuous_run(job, index, config):
    continuous, resumed = rank_records(job / "first", index, NP), rank_records(job / "second", index, NP)
    for rank, (a, b) in enumerate(zip(continuous, resumed)):
        assert a["steps"] == b["steps"] == 2 * HALF
        for key in ("weights", "optimizer", "state"):
            difference = first_difference(a[key], b[key], key)
            assert not difference, f"{config['name']} rank {rank}: resumed differs from continuous at {difference}"
    assert not first_difference(continuous[0]["weights"], continuous[1]["weights"]), "replicas differ"


@pytest.mark.parametrize("index,config", list(enumerate(CONFIGS)), ids=[c["name"] for c in CONFIGS])
def test_the_checkpoint_holds_the_state_that_matters(job, index, config):
    """The save happened where the state is not trivial: non-zero residuals exactly where groups
    are sparse (none below ``min_numel``, none yet mid-warm-up: traced, the residual variable
    exists but holds zeros), schedules changing after the save, ExDyna's boundaries moved,
    thresholds and DGC's velocity set."""
    options = registry.make_options(config["method"], **config["options"])
    for rank, record in enumerate(rank_records(job / "first", index, NP)):
        saved, final = layout_of(record["saved"]), layout_of(record["state"])
        assert saved["steps"] == HALF
        assert all(g["state"]["world_size"] == NP for g in saved["groups"].values() if g["state"] is not None)
        for layout, sparse_steps in ((saved, HALF > options.warmup_steps), (final, True)):
            for name, group in layout["groups"].items():
                sparse = sparse_steps and group["numel"] >= options.min_numel
                held = group["residual"] is not None and bool(np.any(array(group["residual"]) != 0))
                assert held == sparse, (config["name"], rank, name)
        if options.density_schedule:
            assert options.density_at(HALF) != options.density_at(2 * HALF - 1)
        states = [group["state"]["state"] for group in saved["groups"].values() if group["state"] is not None]
        if config["method"] in ("micro", "exdyna", "gtopk", "dgc") and HALF > options.warmup_steps:
            assert states, f"{config['name']}: no method state in the checkpoint"
        for group, state in zip(saved["groups"].values(), states):
            if config["method"] in ("micro", "exdyna"):
                assert state["threshold"]["threshold"] > 0 and state["threshold"]["steps"] == HALF
            if config["method"] == "exdyna":
                initial = BlockLayout.for_buffer(group["numel"], options.num_blocks).initial_blocks(NP)
                assert state["blocks"] != initial, f"{config['name']}: ExDyna's boundaries never moved"
            if config["method"] == "dgc":
                assert np.any(array(state["velocity"]) != 0)


@pytest.mark.parametrize("index,config", list(enumerate(RESIZED)), ids=[c["name"] for c in RESIZED])
def test_loaded_by_more_workers_keeps_residuals_and_rebuilds_method_state(job, index, config):
    """Saved by 2 workers, loaded by 3 (the third without a checkpoint): the step counter goes
    on, the partition tables, thresholds and schedules are built for 3, and the step delivers the
    loaded residuals: update + mean new residual = mean (loaded residual + gradient)."""
    records = rank_records(job / "resized", index, RESIZED_NP)
    for rank, record in enumerate(records):
        layout = layout_of(record["state"])
        assert record["steps"] == layout["steps"] == HALF + 1
        for group in layout["groups"].values():
            assert group["state"]["world_size"] == RESIZED_NP
            state = group["state"]["state"]
            if config["method"] == "gtopk":
                assert all(len(phase["send_to"]) == RESIZED_NP for phase in state)
            else:
                assert state["parts"] == RESIZED_NP and state["threshold"]["steps"] == 1
                if config["method"] == "exdyna":
                    assert len(state["blocks"]) == RESIZED_NP
        assert not first_difference(record["update"], records[0]["update"]), f"rank {rank}'s update differs"
    for g in range(len(records[0]["update"])):
        loaded = [array(r["loaded"][g]).astype(np.float64) for r in records]
        assert [bool(np.any(x != 0)) for x in loaded] == [True, True, False]
        raw = np.stack([loaded, [array(r["raw"][g]).astype(np.float64) for r in records]])
        assert_conserved(array(records[0]["update"][g]).astype(np.float64),
                         [array(r["residuals"][g]).astype(np.float64) for r in records], raw, "float32",
                         f"{config['name']} group {g}")


def test_checkpoint_of_other_groups_raises_on_every_rank(job):
    """Rank 0 alone loads a checkpoint saved with ``groups="model"`` into ``groups="tensor"``:
    every rank raises the ``ValueError`` naming the groups and the fix (no rank waits)."""
    records: List[Dict[str, Any]] = rank_records(job / "resized", len(RESIZED), RESIZED_NP)
    for record in records:
        assert record["error"] is not None and record["error"].startswith("rank 0: checkpoint does not match")
        assert "load it with the same model and groups= it was saved with" in record["error"]
