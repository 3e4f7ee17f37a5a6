"""A group's exchange in flight, and what the engine handles of a group.

A *flight* is one group's exchange between its start and its finish, whatever runs it
(:class:`Flight`, the one name for it): the engine's :class:`ExchangeFlight`, which drives an
exchange generator, or a front end's own (Horovod's dense allreduces,
:class:`horovod_sparse.torch.dense.DenseFlight`).

An exchange is a generator (the contract of :meth:`horovod_sparse.methods.base.Sparsifier.exchange`,
or a front end's dense exchange): it launches collectives through its communicator, yields the
pending ones it needs, and, resumed with their outputs, returns its result. A front end starts
every group's exchange in group order and then finishes them in group order, on every rank.
"""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence

from horovod_sparse.methods.comm import Comm


class ExchangeGroup(Protocol):
    """What the engine handles of a group (either framework's ``FlatGroup``; PyTorch's FSDP2
    ``ShardGroup``): its identity and size, where its tensors live, and where its result goes."""

    #: The group's name (statistics, checkpoints) and its collectives' (``hs.<name>.<tag>``).
    name: str
    collective_name: str
    numel: int
    #: Whether ``dense=`` keeps it dense; the device of its tensors (None: TensorFlow's placement).
    kept_dense: bool
    device: Any
    #: The update of its last finished sparse step (:meth:`take_result`).
    output: Any
    #: Its parameters' shapes in its buffer's order, where the buffer is whole parameters (PyTorch's
    #: ``FlatGroup``); None where it is not (FSDP2's shards) or they are not known (TensorFlow).
    shapes: Any

    def zeroed_output(self) -> Any:
        """The zeroed buffer its update is written into: its own, reused step after step, or the
        gradient's memory the front end handed over (DDP's bucket, FSDP2's shard)."""

    def take_result(self, update: Any, residual: Any) -> None:
        """Keep a sparse exchange's ``update`` as :attr:`output` and ``residual`` as its residual."""

    def scale_output(self, scale: Any) -> None:
        """Multiply :attr:`output` by ``scale`` (a loss scale the gradients were divided by)."""

    def decay_residual(self, factor: float) -> None:
        """Multiply its residual by ``factor`` (error feedback with decay)."""


class Flight(Protocol):
    """A group's exchange started and not yet finished, as the engine finishes and abandons it."""

    group: Any
    #: Whether it is a sparse exchange (finished into its group, undone when the step is abandoned).
    sparse: bool

    def finish(self) -> Any:
        """Wait for the exchange; its result (a sparse one's ``(update, residual)``)."""


class ExchangeFlight:
    """A group's exchange generator, launched and not yet finished (a :class:`Flight`).

    Args:
        exchange: the generator.
        comm: the group's communicator (``wait(pendings)`` returns the pendings' outputs).
        group: the group (the front end's ``FlatGroup``).
        sparse: whether it is a sparse exchange, which must return ``(update, residual)``
            (a dense one returns its update, as its front end consumes it).
    """

    def __init__(self, exchange: Any, comm: Comm, group: Any, sparse: bool = True) -> None:
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
