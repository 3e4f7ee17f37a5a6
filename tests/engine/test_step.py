"""The step engine's order, in one process and in seconds: two ranks' engines run in lockstep over
a loopback communicator (each rank's allgather completes once both ranks launched it), with real
groups and the real Top-k, and every event a step causes is recorded in the order it happens.
What the front ends add (buckets, shards, hooks) is tested in their multi-process jobs."""
import io
import json
import warnings
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from horovod_sparse.common import registry
from horovod_sparse.common.stats import read_each
from horovod_sparse.distributed import backend
from horovod_sparse.engine.model_state import ModelState
from horovod_sparse.engine.step import StepEngine
from horovod_sparse.engine.topology import Transport
from horovod_sparse.torch_core.buffers import FlatGroup
from horovod_sparse.torch_core.communicator import TorchCommunicator, nbytes
from horovod_sparse.torch_core.selection import accelerator_paths

RANKS, NUMEL, DENSITY = 2, 40, 0.1


class Ranks:
    """The process set of one in-process rank."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def size(self) -> int:
        return RANKS

    def rank(self) -> int:
        return self._rank


class Loopback(TorchCommunicator):
    """A communicator whose allgathers meet on a board shared by the ranks of this process;
    launches, waits and undone deliveries are written to the rank's event log."""

    board: Dict[Any, Dict[int, torch.Tensor]] = {}
    events: Dict[int, List[str]] = {}

    def allgather(self, tensor, tag, kind, rows=None):
        self.events[self.rank].append(f"launch {self.name}")
        self.board.setdefault((self.name, tag), {})[self.rank] = tensor.clone()
        return self._launched((self.name, tag), tag, kind, sent=nbytes(tensor), own=nbytes(tensor))

    def _complete(self, handle, timeout):
        self.events[self.rank].append(f"wait {self.name}")
        return torch.cat([self.board[handle][r] for r in range(self.size)])

    def undo_deliveries(self):
        self.events[self.rank].append(f"undo {self.name}")
        super().undo_deliveries()


class Finiteness:
    """A rank's non-finite groups, noted when read (with the step's figures) at the end of a step."""

    def __init__(self, log: List[str], groups: List[str]) -> None:
        self.log, self.groups = log, groups

    def nonfinite(self, read):
        read([])
        self.log.append("read")
        return self.groups


class Rank:
    """One rank: its engine over the loopback, its two groups and its event log."""

    def __init__(self, rank: int, first_dense_steps: int = 0, stats_log: Any = None, **options: Any) -> None:
        self.rank = rank
        self.log = Loopback.events[rank] = []
        method = registry.create("ddp", "topk", **{"density": DENSITY, "min_numel": 0, **options})
        transport = Transport(Loopback, Ranks(rank))
        self.engine = StepEngine(method, ModelState(method, backend, Ranks(rank), None), transport,
                                 stats_log=stats_log, first_dense_steps=first_dense_steps)
        self.params = [torch.zeros(NUMEL), torch.zeros(NUMEL // 2)]
        self.groups = [FlatGroup(i, [f"p{i}"], [p]) for i, p in enumerate(self.params)]
        self.finished: List[Any] = []

    def start(self, gradients: List[torch.Tensor], **kwargs: Any) -> None:
        for group, gradient in zip(self.groups, gradients):
            self.engine.start(group, self._loading(group, gradient), self._dense(group, gradient), **kwargs)

    def _loading(self, group, gradient):
        def load():
            self.log.append(f"load {group.name}")
            return group.load_flat(gradient)
        return load

    def _dense(self, group, gradient):
        def dense(stats):
            self.log.append(f"dense {group.name}")
            return self.engine.dense_flight(group, stats, lambda comm: _dense_sum(gradient, comm))
        return dense

    def end(self, nonfinite: List[str], bad_ranks: List[int]):
        def agree(groups):
            assert groups == nonfinite
            self.log.append("agree")
            return bad_ranks

        return self.engine.end(Finiteness(self.log, nonfinite), agree,
                               lambda abandoned: self.log.append(f"deliver {abandoned}"),
                               lambda timeline: self.log.append("end of step"))


def _dense_sum(gradient, comm):
    """A dense exchange as the engine drives one: an allgather of the gradient, summed."""
    (gathered,) = yield [comm.allgather(gradient[None], "values", "values")]
    return gathered.sum(0)


def gradients(seed: int) -> List[List[torch.Tensor]]:
    rng = np.random.default_rng(seed)
    return [[torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in (NUMEL, NUMEL // 2)]
            for _ in range(RANKS)]


def run_step(ranks: List[Rank], grads, nonfinite=None, bad_ranks=(), **kwargs):
    """One step of every rank in lockstep: every rank starts, then each finishes and ends."""
    Loopback.board.clear()
    for rank, g in zip(ranks, grads):
        rank.start(g, **kwargs)
    outcomes = []
    for rank in ranks:
        rank.finished = rank.engine.finish()
        outcomes.append(rank.end((nonfinite or {}).get(rank.rank, []), list(bad_ranks)))
    return outcomes


def top_k_indices(x: np.ndarray, k: int) -> List[int]:
    """The reference selection: the k largest |x|, ties to the lower index."""
    return sorted(range(x.size), key=lambda i: (-abs(float(x[i])), i))[:k]


def top_k_average(xs: List[np.ndarray], k: int) -> np.ndarray:
    """The reference: each rank's k largest |x| (ties to the lower index) averaged, written
    out with numpy."""
    total = np.zeros_like(xs[0])
    for x in xs:
        keep = top_k_indices(x, k)
        total[keep] += x[keep]
    return total / len(xs)


def test_a_delivered_step_runs_in_order_and_averages_the_selections():
    ranks = [Rank(r) for r in range(RANKS)]
    grads = gradients(1)
    outcomes = run_step(ranks, grads)
    for rank, outcome in zip(ranks, outcomes):
        # Top-k's two allgathers (indices, values) per group, every group launched before any waits.
        assert rank.log == ["load p0", "launch p0", "launch p0", "load p1", "launch p1", "launch p1", "wait p0",
                            "wait p0", "wait p1", "wait p1", "read", "agree", "deliver False", "end of step"]
        assert outcome.bad_ranks == [] and not outcome.stats.abandoned and rank.engine.steps == 1
        for i, group in enumerate(rank.groups):
            k = max(1, int(DENSITY * group.numel))
            expected = top_k_average([g[i].numpy() for g in grads], k)
            assert np.array_equal(group.output.numpy(), expected.astype(np.float32))
            # Nothing lost: the residual holds what this rank did not send.
            sent = grads[rank.rank][i].numpy() - group.residual.numpy()
            assert np.count_nonzero(sent) == k and np.array_equal(sent + group.residual.numpy(),
                                                                   grads[rank.rank][i].numpy())


def test_an_abandoned_step_gives_every_residual_back_before_the_front_end_delivers():
    ranks = [Rank(r) for r in range(RANKS)]
    grads = gradients(2)
    outcomes = run_step(ranks, grads, nonfinite={1: ["p1"]}, bad_ranks=[1])
    for rank, outcome in zip(ranks, outcomes):
        assert rank.log[-6:] == ["read", "agree", "undo p0", "undo p1", "deliver True", "end of step"]
        assert outcome.bad_ranks == [1] and outcome.stats.abandoned and outcome.stats.step == 0
        for group, gradient in zip(rank.groups, grads[rank.rank]):
            assert torch.equal(group.residual, gradient)  # everything this rank gave is kept
    with pytest.raises(FloatingPointError, match=r"rank\(s\) \[1\] at step 0; this rank's affected groups: p1"):
        outcomes[1].apply_policy("raise")
    with pytest.warns(RuntimeWarning, match=r"rank\(s\) \[1\] at step 0"):
        outcomes[0].apply_policy("skip")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_step(ranks, gradients(3))[0].apply_policy("raise")  # a delivered step reports nothing


@pytest.mark.parametrize("first_dense_steps, warmup_steps, dense", [(0, 0, 0), (1, 0, 1), (0, 2, 2), (3, 2, 3)])
def test_the_first_steps_are_dense_for_the_warm_up_and_the_front_end(first_dense_steps, warmup_steps, dense):
    ranks = [Rank(r, warmup_steps=warmup_steps, first_dense_steps=first_dense_steps) for r in range(RANKS)]
    for step in range(dense + 1):
        grads = gradients(10 + step)
        run_step(ranks, grads)
        for rank in ranks:
            started = [event for event in rank.log if event.split()[0] in ("load", "dense")]
            assert started == (["dense p0", "dense p1"] if step < dense else ["load p0", "load p1"]), step
            assert [g.dense for g in rank.engine.last_stats.groups] == [step < dense] * 2
            if step < dense:  # the front end's dense exchange's result, as it returns it
                assert [torch.equal(f.result, grads[0][i] + grads[1][i]) for i, f in enumerate(rank.finished)] == [
                    True, True]
            rank.log.clear()


def test_a_front_end_reason_or_a_group_kept_dense_makes_a_dense_group():
    ranks = [Rank(r) for r in range(RANKS)]
    for rank in ranks:
        rank.groups[1].kept_dense = True
    run_step(ranks, gradients(4), dense_step=False)
    assert [e for e in ranks[0].log if e.split()[0] in ("load", "dense")] == ["load p0", "dense p1"]
    ranks[0].log.clear()
    run_step(ranks, gradients(5), dense_step=True)
    assert [e for e in ranks[0].log if e.split()[0] in ("load", "dense")] == ["dense p0", "dense p1"]


@pytest.mark.parametrize("logged", [False, True])
def test_a_deferred_union_is_read_with_a_logged_steps_figures_or_when_last_stats_is_read(logged):
    """Top-k at k = 1: the two gathered indices are at most 1/16 of group p0's 40 elements (not of
    p1's 20), so p0's union is deferred. On the accelerators' paths (a union is a device count):
    with a statistics log it is worked out in the step and read in the step's one read, with p1's,
    and the log has it; without one the step's read has p1's only, and reading ``last_stats``
    works p0's out in one more read (once). Either way both are the reference unions."""
    streams = [io.StringIO() if logged else None for _ in range(RANKS)]
    ranks = [Rank(r, stats_log=streams[r], density=0.02) for r in range(RANKS)]
    reads: Dict[int, List[int]] = {r: [] for r in range(RANKS)}
    for rank in ranks:
        rank.engine.read_scalars = lambda scalars, r=rank.rank: reads[r].append(len(scalars)) or read_each(scalars)
    grads = gradients(4)
    expected = [len({i for g in grads for i in top_k_indices(g[j].numpy(), 1)}) for j in range(2)]
    with accelerator_paths():
        run_step(ranks, grads)
        for rank in ranks:
            assert reads[rank.rank] == ([2] if logged else [1])
            for _ in range(2):
                assert [g.union for g in rank.engine.last_stats.groups] == expected
            assert reads[rank.rank] == ([2] if logged else [1, 1])
            if logged:
                assert json.loads(streams[rank.rank].getvalue())["union_density"] == sum(expected) / (NUMEL * 1.5)
