"""Driving one group's exchange, the same way in every front end.

An exchange is a generator (the contract of :meth:`horovod_sparse.methods.base.Sparsifier.exchange`,
or a front end's dense exchange): it launches collectives through its communicator, yields the
pending ones it needs, and, resumed with their outputs, returns its result. A front end starts
every group's exchange in group order and then finishes them in group order, on every rank.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence


class Inflight:
    """A group's exchange that has been launched and not yet finished.

    Args:
        exchange: the generator.
        comm: the group's communicator (``wait(pendings)`` returns the pendings' outputs).
        group: the group (the front end's ``FlatGroup``).
        sparse: whether it is a sparse exchange, which must return ``(update, residual)``
            (a dense one returns nothing: it writes the gradients itself).
    """

    def __init__(self, exchange: Any, comm: Any, group: Any, sparse: bool = True) -> None:
        self.exchange = exchange
        self.comm = comm
        self.group = group
        self.sparse = sparse
        self.pendings: Optional[Sequence[Any]] = None
        self.result: Any = None

    def advance(self, outputs: Optional[List[Any]] = None) -> bool:
        """Run the exchange up to its next wait (``outputs``: the last wait's); False once it
        has finished, its result then in :attr:`result`."""
        try:
            self.pendings = next(self.exchange) if outputs is None else self.exchange.send(outputs)
            return True
        except StopIteration as stop:
            self.pendings = None
            self.result = stop.value
            return False

    def finish(self) -> Any:
        """Drive the exchange to completion, waiting for each round's collectives; its result."""
        while self.pendings is not None:
            self.advance(self.comm.wait(self.pendings))
        if self.sparse and self.result is None:
            raise RuntimeError(f"{type(self.exchange).__name__} of group {self.group.name!r} ended "
                               "without returning (update, residual)")
        return self.result
