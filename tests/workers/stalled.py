"""A rank that takes a round the others do not: the disagreement that once left jobs waiting for
ever, which now ends in ``ExchangeStalled`` on every rank left waiting (horovod_sparse.common.stall).

:func:`take_extra_round` makes one rank's exchange of one step yield one allreduce more after its
first round; :func:`record_stall` trains until the error comes, writes what this rank saw and
leaves with the others: once every rank has written its record, all of them shut Horovod down
together, so that no rank's exit breaks a peer's Gloo connection (a peer's background thread
aborts the process on that, SIGABRT, also when it has already written its record)."""
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from horovod_sparse.common.stall import ExchangeStalled

#: Seconds a rank waits for the other ranks' records before it leaves anyway (their deadlines come
#: within the tests' slack, 6 s, of each other also on a loaded 2-core machine).
GRACE = 60.0


def take_extra_round(method: Any, at_step: int, on_rank: bool) -> None:
    """From now on ``method``'s exchange at ``at_step`` yields one allreduce more after its first
    round where ``on_rank`` (this rank is the one that disagrees); elsewhere it is unchanged."""
    exchange = method.exchange

    def diverging(x: torch.Tensor, comm: Any, state: Any, step: int) -> Any:
        inner = exchange(x, comm, state, step)
        if step != at_step or not on_rank:
            return (yield from inner)
        outputs = yield next(inner)
        yield [comm.allreduce(torch.zeros(3, dtype=x.dtype, device=x.device), "extra", "meta")]
        try:
            while True:
                outputs = yield inner.send(outputs)
        except StopIteration as stop:
            return stop.value

    method.exchange = diverging


def record_stall(out: Path, name: str, rank: int, size: int, shutdown: Callable[[], None],
                 train_step: Callable[[int], None], steps: int, **facts: Any) -> None:
    """Run ``train_step(step)`` for ``steps`` steps; write ``{name}.rank{rank}.json`` with
    ``facts``, the steps done and the error that ended them (its type, message and fields, and
    the seconds the failing step took); once the ``size`` ranks' records are all there (or after
    :data:`GRACE` seconds), call ``shutdown`` (Horovod's, which every rank's background thread
    leaves together) and leave the process."""
    record: Any = {**facts, "steps_done": 0, "error": None}
    for step in range(steps):
        start = time.monotonic()
        try:
            train_step(step)
        except Exception as error:  # what ended the job is the observation
            stalled = error if isinstance(error, ExchangeStalled) else error.__cause__ or error.__context__
            record["error"] = {"type": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
            if isinstance(stalled, ExchangeStalled):
                record["error"].update(stalled=True, group=stalled.group, step=stalled.step, rank=stalled.rank,
                                       ranks=stalled.ranks, collective=stalled.collective)
            break
        record["steps_done"] = step + 1
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(record))
    deadline = time.monotonic() + GRACE
    while len(list(out.glob(f"{name}.rank*.json"))) < size and time.monotonic() < deadline:
        time.sleep(0.1)
    shutdown()
    os._exit(0)
