"""Horovod's outer steps under Horovod elastic, a round boundary the commit point: a worker lost
mid-round, one added, one joining with another configuration, on a real ``horovodrun`` elastic
job (``tests/workers/outer_elastic.py``, whose docstring tells the worlds).

Against the written-out rounds with the worlds' sizes: each process's residual its own across the
worlds (the lost worker's lost with it, a new worker's empty), Top-k's rounds bitwise, DiLoCo's
dense average to rounding (Gloo's allreduce sums in its own order). Every process records its
events; the tests read them.
"""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch

from tests.outer.jobs import as32, dense_average, options
from tests.support.launch import horovodrun_elastic
from tests.support.reference_grouping import group_exchange
from tests.torch.test_elastic import Event
from tests.workers.given_gradients import make_params
from tests.workers.outer_elastic import CONFIGS, SEED, SHAPES

EVERY, ROUNDS = 3, 2  # inner steps per round, rounds per world
SIZES = [3] * ROUNDS + [2] * ROUNDS + [3] * ROUNDS  # the world of each committed round
NUMELS = [int(np.prod(s)) for s in SHAPES]


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> Dict[str, List[Event]]:
    """Every process's events in order, by process, from one elastic job."""
    tmp = tmp_path_factory.mktemp("outer_elastic")
    out = tmp / "out"
    out.mkdir()
    hosts = "".join(f"{host}:1\n" for host in ("localhost", "127.0.0.1", third_local_host()))
    horovodrun_elastic("outer_elastic.py", tmp / "hosts", hosts, min_np=2, max_np=4,
                       args=["--hosts-file", str(tmp / "hosts"), "--out", str(out), "--every", str(EVERY),
                             "--rounds", str(ROUNDS)])
    by_process: Dict[str, List[Event]] = {}
    for path in sorted(Path(out).glob("*.npz")):
        event = Event(path)
        by_process.setdefault(event.process, []).append(event)
    return by_process


def third_local_host() -> str:
    """A third name of this machine that Horovod takes for a local host (its address one of this
    machine's, so no ssh): the host name, else a non-loopback address of this machine. The lost
    worker's host is blacklisted, so the added worker needs a host name of its own."""
    from horovod.runner.util import network

    local = network.get_local_host_addresses()
    for name in [socket.gethostname(), *sorted(local - {"127.0.0.1"})]:
        if network.resolve_host_address(name) in local:  # None where the name does not resolve
            return name
    raise AssertionError(f"this machine has no third name for a local host (addresses {sorted(local)}): the "
                         "elastic job needs three")


def of_kind(events: Dict[str, List[Event]], kind: str) -> List[Event]:
    return [e for per_process in events.values() for e in per_process if e.kind == kind]


def by_round(events: Dict[str, List[Event]], kind: str) -> Dict[int, List[Event]]:
    """The ``kind`` events by the round they record, in rank order."""
    rounds: Dict[int, List[Event]] = {}
    for e in sorted(of_kind(events, kind), key=lambda e: e.rank):
        rounds.setdefault(e.round, []).append(e)
    return rounds


def split(array: np.ndarray) -> List[np.ndarray]:
    """A flat record of the parameters, per parameter (float32)."""
    return np.split(as32(array), np.cumsum(NUMELS)[:-1])


def test_every_round_committed_once_on_its_world(events):
    """Each round ends (and is committed) once, on exactly the ranks of its world: the round the
    lost worker left is trained again by the survivors, not continued; each process's rounds in
    order without a repeat; one exchange closed per committed round (nothing applied twice)."""
    rounds = by_round(events, "round")
    assert sorted(rounds) == list(range(len(SIZES)))
    for j, records in rounds.items():
        assert [e.rank for e in records] == list(range(SIZES[j])), f"round {j}: ranks {[e.rank for e in records]}"
        assert all(e.size == SIZES[j] and e.steps == {name: j + 1 for name in CONFIGS} for e in records)
    for per_process in events.values():
        done = [e.round for e in per_process if e.kind == "round"]
        assert done == sorted(set(done))
    members = [{e.process for e in rounds[j]} for j in (ROUNDS - 1, ROUNDS, 2 * ROUNDS)]
    assert len(members[1]) == 2 and members[1] < members[0], "one worker lost"
    assert len(members[2] - members[1]) == 1 and members[1] < members[2], "one worker added"


def test_replicas_identical_after_every_change_and_round(events):
    """At every entry into training (after each sync) and every round's end, every rank holds rank
    0's parameters, anchor, outer optimizer state (DiLoCo's momentum), position and step counter,
    bitwise."""
    for kind in ("enter", "round"):
        for j, records in by_round(events, kind).items():
            for e in records[1:]:
                assert (e.steps, e.position) == (records[0].steps, records[0].position)
                for key in [f"{what}.{name}" for what in ("params", "anchor", "outer") for name in CONFIGS]:
                    np.testing.assert_array_equal(e.arrays[key], records[0].arrays[key],
                                                  err_msg=f"{kind} at round {j}: rank {e.rank}'s {key}")


def test_state_dict_keyed_for_the_current_world(events):
    """``state_dict()`` after every change is keyed by the rank in the new world and saved with
    its size (what a checkpoint taken then resumes in)."""
    for e in of_kind(events, "enter"):
        assert e.state_dict == [f"rank{e.rank}", e.size], (e.state_dict, e.rank, e.size)


def reference(events, method: str, name: str):
    """The written-out committed rounds of config ``name``: per round the expected averages and
    parameters after its outer step (SGD of lr 1: ``anchor - average``) and each rank's residual;
    each process's residual its own from round to round (zero when it joins)."""
    anchor = [p.detach().numpy().reshape(-1).copy() for p in make_params(SHAPES, SEED + 1, torch.float32)]
    residuals: Dict[str, List[np.ndarray]] = {}
    expected = []
    for j, records in sorted(by_round(events, "round").items()):
        updates = []
        for i, numel in enumerate(NUMELS):
            exchange = (dense_average(numel, len(records)) if method == "none" else
                        group_exchange(method, options(method), numel, len(records), [SHAPES[i]]))
            xs = [residuals.get(e.process, [np.zeros(n, np.float32) for n in NUMELS])[i]
                  + (anchor[i] - as32(e.arrays[f"theta.{name}.{i}"]).reshape(-1)) for e in records]
            updates.append(exchange(xs, j))
            for e, x in zip(records, xs):
                residuals.setdefault(e.process, [np.zeros(n, np.float32) for n in NUMELS])[i] = x
            anchor[i] = anchor[i] - updates[i]
        after = [[residuals[e.process][i].copy() for i in range(len(NUMELS))] for e in records]
        expected.append((records, updates, [a.copy() for a in anchor], after))
    return expected


def test_top_k_rounds_match_the_written_out_reference_bitwise(events):
    """Top-k's every committed round on every rank of its world: the averages, the parameters after
    the outer step and the residuals bitwise those of the written-out rounds, the world's size
    the divisor, the lost worker's residual gone with it, the new worker's empty at its start."""
    for records, updates, anchor, residuals in reference(events, "topk", "topk"):
        for e, residual in zip(records, residuals):
            params = split(e.arrays["params.topk"])
            for i in range(len(NUMELS)):
                where = f"round {e.round} rank {e.rank} parameter {i}"
                np.testing.assert_array_equal(as32(e.arrays[f"agg.topk.{i}"]), updates[i], err_msg=where)
                np.testing.assert_array_equal(params[i], anchor[i], err_msg=where)
                np.testing.assert_array_equal(as32(e.arrays[f"residual.topk.{i}"]), residual[i], err_msg=where)


def test_dense_diloco_rounds_match_the_written_out_reference(events):
    """DiLoCo's dense average (``Compression.none``) over each world: the parameters after every
    committed round those of the written-out rounds up to float32 rounding (Gloo's allreduce sums
    in an order of its own), and no residual."""
    for records, _, anchor, _ in reference(events, "none", "none"):
        for e in records:
            assert not [key for key in e.arrays if key.startswith("residual.none.")]
            for i, param in enumerate(split(e.arrays["params.none"])):
                np.testing.assert_allclose(param, anchor[i], rtol=1e-5, atol=1e-6,
                                           err_msg=f"round {e.round} rank {e.rank} parameter {i}")


def test_the_lost_round_is_trained_again_from_its_commit(events):
    """The survivors of the loss enter the new world at the last commit exactly: the start of the
    round the lost worker left (position 0, one exchange per committed round), their parameters,
    residuals and outer state as committed, whatever the failed exchange had done."""
    lasts = {e.process: e for e in by_round(events, "round")[ROUNDS - 1]}
    enters = [e for e in of_kind(events, "enter") if e.round == ROUNDS and e.process in lasts]
    assert len(enters) == 2
    for e in enters:
        committed = lasts[e.process]
        assert e.size == 2 and e.position == {name: 0 for name in CONFIGS} and e.steps == committed.steps
        kept = {key: value for key, value in committed.arrays.items() if not key.startswith(("theta.", "agg."))}
        assert sorted(e.arrays) == sorted(kept)
        for key, value in kept.items():
            np.testing.assert_array_equal(e.arrays[key], value, err_msg=f"rank {e.rank}'s {key}")


def test_a_new_worker_starts_empty_at_the_agreed_state(events):
    """The added worker enters with no residual, rank 0's step counter and position, and its
    parameters at the anchor (rank 0's): the others keep their residuals exactly."""
    firsts = [per_process[0] for per_process in events.values() if per_process[0].round > 0 and
              per_process[0].kind == "enter"]
    (new,) = firsts
    assert new.round == 2 * ROUNDS and new.size == 3
    assert not [key for key in new.arrays if key.startswith("residual.")]
    assert new.steps == {name: 2 * ROUNDS for name in CONFIGS} and new.position == {name: 0 for name in CONFIGS}
    for name in CONFIGS:
        np.testing.assert_array_equal(new.arrays[f"params.{name}"], new.arrays[f"anchor.{name}"])
    lasts = {e.process: e for e in by_round(events, "round")[2 * ROUNDS - 1]}
    survivors = [e for e in of_kind(events, "enter") if e.round == 2 * ROUNDS and e.process in lasts]
    assert len(survivors) == 2
    for e in survivors:
        for key in [k for k in lasts[e.process].arrays if k.startswith("residual.")]:
            np.testing.assert_array_equal(e.arrays[key], lasts[e.process].arrays[key])


def test_a_joiner_built_otherwise_is_refused_on_every_rank(events):
    """A worker joining with another ``every``: the sync raises the same ``ValueError`` naming it
    on every rank of the new world, before anything of the joiner is used."""
    refused = sorted(of_kind(events, "refused"), key=lambda e: e.rank)
    assert [e.rank for e in refused] == [0, 1, 2, 3] and all(e.size == 4 for e in refused)
    assert len({e.error for e in refused}) == 1 and "every" in refused[0].error, refused[0].error
