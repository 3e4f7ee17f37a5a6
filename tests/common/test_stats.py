"""Step statistics and ready times: device phases settle when the step is finished, host phases
at once; deferred counts are worked out when the statistics are read; a device clock's stamps
become seconds when the step ends."""
import io
import json

import torch

from horovod_sparse.common.grouping import ReadyTimeline
from horovod_sparse.common.stats import Deferred, GroupStats, StatsLog, StepStats, finish_step, read_deferred
from horovod_sparse.torch_core.communicator import TorchCommunicator


class _ProcessSet:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def test_pending_device_time_is_added_once_when_the_step_is_finished():
    group = GroupStats("g", 10, 1)
    group.add_time("select", 0.5)
    calls = []
    group.add_pending_time("select", lambda: calls.append(1) or 0.25)
    group.add_pending_time("apply", lambda: 0.125)
    assert group.seconds == {"select": 0.5} and not calls  # nothing read before the step ends
    stats = finish_step(StepStats(step=0, groups=[group]), None)
    assert group.seconds == {"select": 0.75, "apply": 0.125} and calls == [1]
    finish_step(stats, None)  # settling again adds nothing
    assert group.seconds == {"select": 0.75, "apply": 0.125}
    json.dumps(stats.as_dict())  # the pending list is no part of the record


def _deferred_step(computed):
    """A step of three groups whose unions are deferred (two left on a device as 0-dim tensors,
    one a Python int), each noting in ``computed`` when it is worked out."""
    groups = [GroupStats("a", 10, 2), GroupStats("b", 10, 2), GroupStats("c", 10, 2)]
    groups[0].union = Deferred(lambda: computed.append("a") or torch.tensor(3))
    groups[1].union = Deferred(lambda: computed.append("b") or 4)
    groups[2].union = Deferred(lambda: computed.append("c") or torch.tensor(5))
    return StepStats(step=0, groups=groups)


def test_a_deferred_union_is_worked_out_when_the_statistics_are_read_in_one_read():
    """Closing the step computes nothing; reading works every deferred count out once and reads
    those left on a device in one call; a second reading computes and reads nothing."""
    computed, calls = [], []

    def read_scalars(scalars):
        calls.append(len(scalars))
        return [int(s) for s in scalars]

    stats = finish_step(_deferred_step(computed), None, read_scalars)
    assert computed == [] and calls == []
    assert read_deferred(stats, read_scalars) is stats
    assert computed == ["a", "b", "c"] and calls == [2]
    assert [g.union for g in stats.groups] == [3, 4, 5] and stats.union_density == 12 / 30
    read_deferred(stats, read_scalars)
    assert computed == ["a", "b", "c"] and calls == [2]


def test_a_statistics_log_writes_the_deferred_unions():
    computed, stream = [], io.StringIO()
    finish_step(_deferred_step(computed), StatsLog(stream, per_group=True))
    record = json.loads(stream.getvalue())
    assert [g["union"] for g in record["groups"]] == [3, 4, 5] and record["union_density"] == 12 / 30


def test_host_tensors_are_timed_on_the_host_at_once():
    group = GroupStats("g", 10, 1)
    comm = TorchCommunicator(_ProcessSet(), "g", group, 1.0, device=torch.device("cpu"))
    with comm.timer("select"):
        torch.ones(10).sum()
    assert "select" in group.seconds and not group._pending


def test_a_device_clocks_stamps_become_seconds_when_the_step_ends():
    """Stamps stay opaque during the step (CUDA events on a GPU) and are read once, at its end."""
    ticks = iter(range(10))
    read = []
    timeline = ReadyTimeline(lambda: ("stamp", next(ticks)), lambda stamp: read.append(stamp) or stamp[1] * 0.5)
    timeline.group_ready("a")
    timeline.param_ready(0)
    timeline.group_ready("b")
    assert read == []
    record = timeline.end_step()
    assert record.group_ready == {"a": 0.0, "b": 1.0} and record.backward_end == 0.5 and record.step_end == 1.5
    assert record.backward_left() == {"a": 0.5, "b": 0.0}
