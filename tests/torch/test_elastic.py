"""Horovod elastic with the sparse optimizer (Top-k, MiCRO, ExDyna, gTop-k side by side): a worker
removed, one added, one replaced at the same size, driven by the host-discovery file.

One job (``tests/workers/torch_elastic.py``) goes through four worlds of 3 training steps each:
``localhost:2 + 127.0.0.1:1`` (3 workers) -> ``localhost:2`` (127.0.0.1's worker removed) ->
``localhost:3`` (a worker added) -> ``localhost:2 + 127.0.0.1:1`` (localhost's third worker
replaced by a new one on 127.0.0.1: the size stays 3, the membership changes). Every process
records its events (entries into the training function, steps, commits); the tests read them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

import horovod_sparse.torch as hs
from horovod_sparse.common.consensus import json_bytes
from horovod_sparse.common.plain import to_plain
from tests.support.checks import assert_conserved
from tests.support.launch import horovodrun_elastic
from tests.support.streams import flat_gradients

METHODS = ["topk", "micro", "exdyna", "gtopk"]
SHAPES = [[40, 30], [30]]  # the worker's
NUMEL = sum(int(np.prod(s)) for s in SHAPES)
SEED = 5  # the worker's default: method m draws its gradients with seed SEED + m
STEPS = 3  # per world
PLAN = ["localhost:2\n127.0.0.1:1\n", "localhost:2\n", "localhost:3\n", "localhost:2\n127.0.0.1:1\n"]
SIZES = [3, 2, 3, 3]


class Event:
    """One record a worker process wrote: its ``meta`` and arrays."""

    def __init__(self, path: Path) -> None:
        with np.load(path) as data:
            self.arrays = {key: data[key] for key in data.files if key != "meta"}
            self.meta = json.loads(str(data["meta"]))

    def __getattr__(self, name: str):  # kind, process, rank, size, step, shared, built_for, opt_steps
        return self.meta[name]

    def residual(self, method: str) -> np.ndarray:
        """The method's residuals, every group's in group order (= parameter order here)."""
        return np.concatenate([v for k, v in self.arrays.items() if k.startswith(f"residual.{method}.")])


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> Dict[str, List[Event]]:
    """Every process's events in order, by process, from one elastic job through ``PLAN``."""
    tmp = tmp_path_factory.mktemp("elastic")
    out = tmp / "out"
    out.mkdir()
    horovodrun_elastic("torch_elastic.py", tmp / "hosts", PLAN[0], min_np=2, max_np=3,
                       args=["--hosts-file", str(tmp / "hosts"), "--out", str(out), "--plan", json.dumps(PLAN),
                             "--steps", str(STEPS), "--methods", ",".join(METHODS), "--seed", str(SEED)])
    by_process: Dict[str, List[Event]] = {}
    for path in sorted(out.glob("*.npz")):
        event = Event(path)
        by_process.setdefault(event.process, []).append(event)
    return by_process


def of_kind(events: Dict[str, List[Event]], kind: str) -> List[Event]:
    return [e for per_process in events.values() for e in per_process if e.kind == kind]


def size_at(step: int) -> int:
    return SIZES[step // STEPS]


def test_every_step_ran_once_on_the_planned_world(events):
    steps = of_kind(events, "step")
    for t in range(len(PLAN) * STEPS):
        at_t = [e for e in steps if e.step == t]
        assert sorted(e.rank for e in at_t) == list(range(size_at(t))), f"step {t}: ranks {[e.rank for e in at_t]}"
        assert all(e.size == size_at(t) for e in at_t)
    members = [{e.process for e in steps if e.step == phase * STEPS} for phase in range(len(PLAN))]
    assert len(members[1]) == 2 and members[1] < members[0], "one worker removed"
    assert len(members[2] - members[1]) == 1 and members[1] < members[2], "one worker added"
    assert len(members[3] - members[2]) == 1 and len(members[2] - members[3]) == 1, "one worker replaced"
    for phase in range(len(PLAN)):  # no step lost or repeated: one commit per step per process
        for process in members[phase]:
            committed = [e.step for e in events[process] if e.kind == "commit"]
            assert sorted(set(committed)) == committed


def test_replicas_identical_after_every_change_and_step(events):
    for kind in ("enter", "commit"):
        by_step: Dict[str, List[Event]] = {}
        for e in of_kind(events, kind):
            by_step.setdefault(e.step, []).append(e)
        for step, records in by_step.items():
            for method in METHODS:
                for e in records[1:]:
                    np.testing.assert_array_equal(e.arrays[f"params.{method}"], records[0].arrays[f"params.{method}"],
                                                  err_msg=f"{kind} at step {step}: {method} replica of rank {e.rank}")
                    assert e.shared[method] == records[0].shared[method], (
                        f"{kind} at step {step}: rank {e.rank}'s shared {method} state differs from rank "
                        f"{records[0].rank}'s")
                    assert e.opt_steps == records[0].opt_steps


def test_survivors_keep_their_residuals_exactly(events):
    checked = 0
    for process, per_process in events.items():
        for before, after in zip(per_process, per_process[1:]):
            if after.kind != "enter":
                continue
            assert before.kind == "commit" and before.step == after.step
            for method in METHODS:
                np.testing.assert_array_equal(after.residual(method), before.residual(method),
                                              err_msg=f"process {process}: {method} residual changed across the "
                                                      f"membership change at step {after.step}")
                assert np.any(after.residual(method) != 0)
            checked += 1
    # Two survivors of each change (the new worker of the addition and of the replacement enters first).
    assert checked == 2 + 2 + 2


def test_new_workers_start_empty_with_the_agreed_state(events):
    firsts = [per_process[0] for per_process in events.values() if per_process[0].step > 0]
    assert sorted(e.step for e in firsts) == [2 * STEPS, 3 * STEPS], "one worker added, one replaced"
    enters = of_kind(events, "enter")
    for new in firsts:
        survivors = [e for e in enters if e.step == new.step and e.process != new.process]
        for method in METHODS:
            assert not np.any(new.residual(method)), f"{method}: a new worker's residual must start empty"
            # The shared state (step counter, thresholds, tables, schedules) agreed on entry,
            # before the new world's first exchange (compared at every entry by the replica test).
            assert new.opt_steps[method] == new.step
            assert all(new.shared[method] == e.shared[method] for e in survivors)


def fresh_state(method: str, size: int) -> dict:
    compression = hs.Compression.create(method, density=0.05, min_numel=0)
    return json.loads(json_bytes(to_plain(compression.new_state(NUMEL, size))))


def test_method_state_rebuilt_for_each_world_size(events):
    for e in of_kind(events, "commit"):
        size = size_at(e.step - 1)
        for method in METHODS:
            assert set(e.built_for[method].values()) == {size}, f"{method} after step {e.step - 1}: {e.built_for}"
            if method == "topk":
                continue
            (group,) = json.loads(e.shared[method])["groups"].values()
            assert group["state"]["world_size"] == size
            state, fresh = group["state"]["state"], fresh_state(method, size)
            if method == "gtopk":  # the reduction schedule: exactly a fresh one for this size
                assert state == fresh
            else:  # the partition table: one partition per rank over the whole buffer
                assert (state["numel"], state["parts"]) == (fresh["numel"], fresh["parts"]) == (NUMEL, size)
                assert len(state["blocks"]) == len(fresh["blocks"])  # ExDyna: a run of blocks per rank
                assert sum(state["blocks"]) == sum(fresh["blocks"])


def test_conservation_over_the_run_up_to_the_removed_workers_residuals(events):
    """Per rank, ``e' = e + g - s`` (``s`` what it sent); the update is ``(1/n_t) sum_r s_r``. Summed
    over the run, each process's residuals telescope to its last one (zero at its start), so with
    ``P`` the processes that ever took part and zeros for the steps a process was not in the world:

        sum_t n_t u_t / P + sum_p e_p(last) / P = sum_t sum_p g_p(t) / P,

    where ``e_p(last)`` is a final rank's residual or, for a removed worker, the residual it held
    at its removal (which leaves the job with it)."""
    steps = of_kind(events, "step")
    processes = sorted(events)
    total = len(PLAN) * STEPS
    final = {e.process for e in steps if e.step == total - 1}
    removed = [process for process in processes if process not in final]
    assert len(removed) == 2
    for m, method in enumerate(METHODS):
        raw = np.zeros((total, len(processes), NUMEL))
        for e in steps:
            raw[e.step, processes.index(e.process)] = flat_gradients(SEED + m, e.step, e.rank, SHAPES, [0, 1])
        delivered = sum(size_at(t) * next(e for e in steps if e.step == t).arrays[f"delivered.{method}"]
                        for t in range(total)) / len(processes)
        last = {process: [e for e in events[process] if e.kind == "commit"][-1].residual(method)
                for process in processes}
        for process in removed:
            assert np.abs(last[process]).max() > 1e-3, \
                f"{method}: the removed worker's residual is part of the identity"
        assert_conserved(delivered, [last[process] for process in processes], raw, "float32",
                         f"{method}: elastic run, removed workers' residuals counted")
