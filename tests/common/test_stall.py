"""Horovod's stall-check time as the PyTorch front ends read it (horovod_sparse.common.stall; on
Gloo at most half of Gloo's timeout: the two-tier job of tests/engine/test_two_tier.py checks that the
Horovod front end's waits take it), and
how a torch.distributed wait that times out becomes ExchangeStalled (the Horovod path is held by
the diverging two-tier job of tests/engine/test_two_tier.py)."""
import pytest
import torch

from horovod_sparse.common.stall import (DEFAULT_SECONDS, DISABLE_ENV, GLOO_DEFAULT_SECONDS, GLOO_TIMEOUT_ENV, TIME_ENV,
                                         ExchangeStalled, stall_seconds)
from horovod_sparse.common.stats import GroupStats
from horovod_sparse.distributed.communicator import Communicator


@pytest.mark.parametrize("time, disable, expected", [(None, None, DEFAULT_SECONDS), ("2.5", None, 2.5),
                                                     ("7", "1", None), (None, "true", None), ("7", "0", 7.0)])
def test_stall_seconds_follow_horovods_variables(monkeypatch, time, disable, expected):
    for name, value in ((TIME_ENV, time), (DISABLE_ENV, disable)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert stall_seconds() == expected


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_stall_time_that_is_not_a_positive_number_is_refused(monkeypatch, value):
    monkeypatch.setenv(TIME_ENV, value)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    with pytest.raises(ValueError, match=TIME_ENV):
        stall_seconds()


@pytest.mark.parametrize("time, gloo, disable, expected", [
    (None, None, None, GLOO_DEFAULT_SECONDS / 2), ("8", None, None, 8.0), (None, "10", None, 5.0),
    ("4", "10", None, 4.0), ("20", "50", None, 20.0), (None, None, "1", None)])
def test_on_gloo_the_check_speaks_before_gloos_own_timeout(monkeypatch, time, gloo, disable, expected):
    """Gloo aborts every rank from Horovod's thread once one operation waits its timeout out: where
    Horovod runs on Gloo the check fires by half of it, whatever the stall-check time says."""
    for name, value in ((TIME_ENV, time), (GLOO_TIMEOUT_ENV, gloo), (DISABLE_ENV, disable)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert stall_seconds(gloo=True) == expected
    assert stall_seconds() == (None if disable else float(time or DEFAULT_SECONDS))


@pytest.mark.parametrize("value", ["soon", "0", "-30"])
def test_a_gloo_timeout_that_is_not_a_positive_number_is_refused(monkeypatch, value):
    monkeypatch.setenv(GLOO_TIMEOUT_ENV, value)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    with pytest.raises(ValueError, match=GLOO_TIMEOUT_ENV):
        stall_seconds(gloo=True)


class _TimedOutWork:
    """A Gloo work whose collective never completes: ``wait(timeout)`` raises as Gloo's does."""

    def __init__(self):
        self.timeouts = []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        if timeout is not None:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Operation timed out!")


class _Group:
    """The ranks 4 and 6 of a job, seen as horovod_sparse.distributed.process_group.ProcessGroup."""

    group = None

    def size(self):
        return 2

    def rank(self):
        return 1


def test_a_torch_distributed_wait_past_the_stall_time_raises_exchange_stalled(monkeypatch):
    """The first wait of a group's step has no deadline; once one completed, a wait past the
    stall-check time raises ExchangeStalled naming the group, the step, the rank, the collective
    and the set's ranks."""
    monkeypatch.setenv(TIME_ENV, "4")
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    comm = Communicator(_Group(), "layer1", GroupStats("layer1", 10, 1), 0.5, step=7)
    monkeypatch.setattr(comm, "member_ranks", lambda: [4, 6])
    first, second = _TimedOutWork(), _TimedOutWork()
    tensor = torch.zeros(3)
    assert comm.wait([comm._launched((first, lambda: tensor), "counts", "meta", 12, 12)])[0] is tensor
    with pytest.raises(ExchangeStalled) as raised:
        comm.wait([comm._launched((second, lambda: tensor), "values", "values", 12, 0)])
    assert (first.timeouts, [t.total_seconds() for t in second.timeouts]) == ([None], [4.0])
    stalled = raised.value
    assert (stalled.group, stalled.step, stalled.rank, stalled.ranks, stalled.collective) == (
        "layer1", 7, 6, [4, 6], "hs.layer1.values")
    assert "'layer1' stalled at step 7: rank 6 waited 4 s for the collective 'hs.layer1.values' among ranks [4, 6]" \
        in str(stalled)
