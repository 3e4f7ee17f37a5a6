"""The base class of every method and the one exchange contract every front end drives.

A sparsifier is passed as the familiar ``compression=`` argument, but its real interface is
:meth:`Sparsifier.exchange`: a generator that selects coordinates of a group's error-feedback
buffer, launches Horovod collectives through the framework's ``Communicator``, yields the pending
collectives it needs finished and, resumed with their outputs, returns ``(update, residual)``.
Generators let one method use any number of rounds (gTop-k) while the front end overlaps the
first round with the rest of the backward pass. A method is written once, against a backend
(:mod:`horovod_sparse.methods.backend`); the instance for a framework holds that framework's
backend as :attr:`Sparsifier.B`.

Inside Horovod's *stock* wrappers a sparsifier refuses to run (see :meth:`Sparsifier.compress`):
they can only allreduce one dense tensor per gradient and would silently lose what is not sent.
"""
from __future__ import annotations

import copy
from functools import partial
from typing import Any, Callable, ClassVar, Dict, Generator, List, Optional, Sequence, Tuple, Union

from horovod_sparse.common.capacity import capacity_count
from horovod_sparse.common.thresholds import scan_block_size
from horovod_sparse.common.options import SparsifierOptions
from horovod_sparse.common.schedule import ConstantDensity
from horovod_sparse.common.stats import Deferred
from horovod_sparse.methods.backend import Backend, Capped, Tensor
from horovod_sparse.methods.comm import Comm

#: What an exchange produces: the aggregated update (already scaled) and the new residual.
Result = Tuple[Tensor, Tensor]
#: The generator type of :meth:`Sparsifier.exchange`: yields pendings, receives their outputs,
#: returns a :data:`Result`.
Exchange = Generator[Sequence[Any], List[Any], Result]
#: The step counter an exchange receives: an int, or an int64 scalar in a traced TensorFlow step.
Step = Union[int, Tensor]


#: The union of a step's gathered indices is deferred (:meth:`Sparsifier.note_union`) while they
#: number at most ``1 / DEFERRED_UNION_SHARE`` of the group's elements: the indices a deferral keeps
#: alive until the next step closes stay a few percent of the group's memory (6.25% of a float32
#: buffer's bytes for int32 indices). Top-k at density 0.001 qualifies up to 62 ranks.
DEFERRED_UNION_SHARE = 16


class Sparsifier:
    """Selects and exchanges a sparse part of each group's gradient, with error feedback.

    Subclasses implement :meth:`exchange` (and :meth:`new_state` when they keep per-group state
    such as thresholds or partition tables) and are registered with
    :func:`horovod_sparse.common.registry.implements`.

    Args:
        options: validated options (see :class:`~horovod_sparse.common.options.SparsifierOptions`).
        backend: the framework's backend module (:class:`~horovod_sparse.methods.backend.Backend`).
    """

    #: Registry name, set by ``@implements``.
    method_name: ClassVar[str] = ""
    #: Grouping used when the front end is given ``groups=None``: flat buckets of at most 25 MiB
    #: (:class:`~horovod_sparse.common.grouping.Buckets`), so that a step's operations scale with
    #: its buckets, not its tensors; a method defined on other groups names its own.
    default_grouping: ClassVar[Any] = "buckets"
    #: Whether a traced TensorFlow step runs :meth:`exchange` on the host: True for methods whose
    #: decisions are made in Python from values of the current step (a threshold refined from the
    #: count it selected, partition tables from gathered counts). TensorFlow's driver then runs
    #: the step's sparse exchange in one ``tf.py_function``: the eager code, collectives included,
    #: with eager mode's results. False: the exchange is traced into the graph.
    host_exchange: ClassVar[bool] = False
    #: Whether :meth:`new_state`'s state differs between ranks (like a residual) rather than
    #: being the same on every rank; shared state is agreed from one rank, per-rank state never is.
    per_rank_state: ClassVar[bool] = False

    def __init__(self, options: SparsifierOptions, backend: Backend) -> None:
        self.options = options
        self.B = backend

    @property
    def residual_decay(self) -> float:
        """The factor every group's residual is multiplied by after a delivered step (error
        feedback with decay, ``e <- beta * e + g``, applied by the step engine); 1, the default
        of every method but an option of SparseLoCo's: nothing is lost."""
        return 1.0

    @property
    def needs_shapes(self) -> bool:
        """Whether :meth:`exchange` reads the group's parameters' shapes (``comm.shapes``), so
        needs each group to be whole parameters; False but for SparseLoCo's ``blocks``."""
        return False

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.options.as_dict().items() if k != "method")
        return f"Compression.{self.method_name}({fields})"

    # -- stock-wrapper path: refuse clearly instead of producing wrong gradients ---------------
    def compress(self, tensor: Tensor) -> Tuple[Tensor, Any]:
        """Refuse: sparsifiers only run inside horovod_sparse's front ends."""
        raise TypeError(self.B.STOCK_REFUSAL.format(cls=type(self).__name__))

    def decompress(self, tensor: Tensor, ctx: Any) -> Tensor:
        """Refuse, like :meth:`compress`."""
        raise TypeError(self.B.STOCK_REFUSAL.format(cls=type(self).__name__))

    # -- state ---------------------------------------------------------------------------------
    def new_state(self, numel: int, world_size: int) -> Any:
        """Per-group state kept across steps (thresholds, partitions); None when stateless.
        Built outside any ``tf.function``."""
        return None

    def resized_state(self, state: Any, numel: int, world_size: int) -> Any:
        """A group's state, built for another world size, for ``world_size`` ranks (an elastic
        change, or a checkpoint loaded on another number of workers). Default: a new state."""
        return self.new_state(numel, world_size)

    def export_state(self, state: Any) -> Any:
        """``state`` as plain Python/NumPy objects that later steps do not change (what a
        checkpoint saves). Default: a deep copy."""
        return copy.deepcopy(state)

    def import_state(self, saved: Any) -> Any:
        """The per-group state to continue from, rebuilt from :meth:`export_state`'s output."""
        return copy.deepcopy(saved)

    def method_state(self, per_rank: bool) -> Dict[str, Any]:
        """What the method keeps across groups and steps (LAGS's measurements), as plain
        containers; with ``per_rank`` everything, else only what every rank holds alike."""
        return {}

    def load_method_state(self, state: Dict[str, Any]) -> None:
        """Take a :meth:`method_state` saved here or on another rank; what it leaves out stays."""

    def on_step_end(self, process_set: Any, record: Any) -> None:
        """Called on every rank at the end of each step, after every group finished, outside
        the backward hooks (blocking collectives are allowed). Default: nothing."""

    # -- the exchange --------------------------------------------------------------------------
    def exchange(self, x: Tensor, comm: Comm, state: Any, step: Step) -> Exchange:
        """Select from ``x``, exchange, and return ``(update, residual)``.

        Contract:
            * ``x`` is the group's flat buffer ``g + e`` (gradient plus residual), 1-D; every
              change to the residual goes through ``comm.remove_delivered`` (which records it,
              so that an abandoned step can be undone);
            * ``update`` starts as ``comm.output(x)`` (zeros) and is the aggregated update,
              already multiplied by ``comm.scale`` (1/n for Average), bitwise identical on every
              rank; ``residual`` is ``x`` minus what this rank delivered into it;
            * every rank launches the same collectives with the same tags in the same order,
              whatever it selected (never skip a collective because a rank has nothing to send);
            * ``step`` counts the front end's exchanges (see :data:`Step`).
        """
        raise NotImplementedError

    # -- helpers shared by the methods -----------------------------------------------------------
    def per_step(self, decide: Callable[[Optional[int]], Any], step: Step, dtype: str) -> Any:
        """``decide(step)`` for a decision that depends on the step only through the density
        schedule: a Python value for an int ``step`` or without a schedule (``decide(None)``),
        else a ``dtype`` scalar computed on the host when the traced step runs."""
        if isinstance(step, int):
            return decide(step)
        if isinstance(self.options.schedule, ConstantDensity):
            return decide(None)
        return self.B.host_call(decide, [step], dtype)

    def count(self, numel: int, step: Step) -> Any:
        """Target count ``k`` of a group of ``numel`` elements at ``step`` (see :meth:`per_step`)."""
        return self.per_step(lambda s: self.options.count(numel, s), step, "int32")

    def density(self, step: Step) -> Any:
        """The density at ``step`` (see :meth:`per_step`)."""
        return self.per_step(self.options.density_at, step, "float64")

    def block_size(self, step: Step) -> int:
        """The block length of a threshold scan at ``step`` (the schedule's density when the step
        is known on the host, else the base density: a matter of speed, not of the result)."""
        return scan_block_size(self.options.density_at(step) if isinstance(step, int) else self.options.density)

    def to_wire(self, values: Tensor) -> Tensor:
        """Values as they travel (see the backend's ``to_wire``)."""
        return self.B.to_wire(values, self.options.fp16_values)

    def allgather_count(self, selected: Any, like: Tensor, comm: Comm) -> Any:
        """Launch the allgather of this rank's count of ``selected`` coordinates (one int64 per
        rank, on ``like``'s device: a row count every rank knows)."""
        return comm.allgather(self.B.reshape_one(selected, like), "counts", "meta", rows=[1] * comm.size)

    def note_union(self, comm: Comm, indices: Tensor, numel: int, padded: bool = False) -> None:
        """Set ``comm.stats.union``: the distinct gathered ``indices`` into a buffer of ``numel``
        elements (``padded``: :data:`~horovod_sparse.methods.backend.PAD` rows not counted). Where
        the backend defers statistics and they are at most ``1 / DEFERRED_UNION_SHARE`` of the
        buffer's elements, a :class:`~horovod_sparse.common.stats.Deferred` count, worked out only
        when the statistics are read (keeping the indices until the next step closes); else
        counted now."""
        count = partial(self.B.distinct, indices, numel, padded=padded)
        deferred = self.B.DEFERS_STATISTICS and self.B.numel(indices) * DEFERRED_UNION_SHARE <= numel
        comm.stats.union = Deferred(count) if deferred else count()

    def capacity(self, numel: int, step: Step) -> Any:
        """The payload's capacity of a group of ``numel`` elements at ``step``
        (:func:`~horovod_sparse.common.capacity.capacity_count` of the options; see
        :meth:`per_step`)."""
        return self.per_step(lambda s: capacity_count(self.options, self.options.count(numel, s), numel),
                             step, "int32")

    def allgather_exchange(self, x: Tensor, idx: Union[Tensor, Capped], comm: Comm,
                           fixed_count: Any = None) -> Exchange:
        """The exchange of Top-k and the threshold baselines: allgather (values, indices),
        scatter-add every rank's chunk, scale. ``idx`` holds distinct indices into ``x``, or is a
        selection cut to a capacity (:class:`~horovod_sparse.methods.backend.Capped`, whose
        ``overflow`` the statistics count).

        With ``fixed_count`` every rank is known to send exactly that many coordinates, and a
        padded selection sends exactly its capacity (its padding adds +0.0 at index 0 and is not
        counted in the union); otherwise the per-rank counts are allgathered too (n integers of
        metadata), and the indices are said to have as many rows as the values (a communicator
        that must learn the row counts first learns them once).
        """
        B, numel = self.B, self.B.numel(x)
        capped = idx if isinstance(idx, Capped) else Capped(idx, B.size(idx) if fixed_count is None else fixed_count,
                                                            0, padded=False)
        if isinstance(idx, Capped):
            comm.stats.note("overflow", capped.overflow)
        if capped.padded:
            fixed_count = B.numel(capped.idx)
        index, values = B.delivered(x, capped)
        wire = self.to_wire(values)
        rows = "selected" if fixed_count is None else [fixed_count] * comm.size
        pendings = [comm.allgather(wire, "values", "values", rows=rows),
                    comm.allgather(B.wire_index(capped.idx, numel), "indices", "indices", rows=rows)]
        if fixed_count is None:
            pendings.append(self.allgather_count(capped.sent, x, comm))
        comm.stats.selected = capped.sent
        residual = comm.remove_delivered(x, index, wire)
        values, indices, *counts = yield pendings
        with comm.timer("apply"):
            chunk_counts = B.chunk_counts(counts[0] if counts else fixed_count, comm.size, fixed=not counts)
            update = B.scatter_chunks(comm.output(x), B.unpadded(indices) if capped.padded else indices, values,
                                      chunk_counts, comm.scale)
            self.note_union(comm, indices, numel, padded=capped.padded)
        return update, residual

    def masked_exchange(self, x: Tensor, reached: Tensor, found: Any, comm: Comm) -> Exchange:
        """:meth:`allgather_exchange` of a selection whose capacity is the whole group, on an
        accelerator (the hard threshold's default): every rank allgathers ``x`` with +0.0 where
        the boolean ``reached`` does not hold, and the chunks are summed in rank order. No
        indices travel (half the bytes of a payload padded to the group's length) and nothing of
        the selection's length is made; the update and the residual are bitwise
        :meth:`allgather_exchange`'s of the same selection (a selected value, at least the
        threshold, is never +0.0), the union too unless a float16 wire rounds a selected value
        to 0 (then not delivered: it stays in the residual). ``found``: how many ``reached``
        holds, a 0-dim tensor left on the device."""
        B, numel = self.B, self.B.numel(x)
        comm.stats.note("overflow", 0)
        wire = self.to_wire(B.kept(x, reached))
        pending = comm.allgather(wire, "values", "values", rows=[numel] * comm.size)
        comm.stats.selected = found
        residual = comm.remove_delivered(x, None, wire)
        values, = yield [pending]
        with comm.timer("apply"):
            comm.stats.union = B.masked_union(values, comm.size)
            update = B.sum_chunks(comm.output(x), values, comm.size, comm.scale)
        return update, residual


def checked_sparse(compression: Any, front_end: str, backend: Backend, is_dense: Callable[[Any], bool]) -> bool:
    """Whether ``compression`` is a sparsifier, after checking that it suits the front end
    ``horovod_sparse.<front_end>``: a method built on that front end's ``backend``, or one of its
    dense compressions (``is_dense``: ``Compression.none`` / ``Compression.fp16``). Raises
    ``ValueError`` naming the fix otherwise."""
    sparse = isinstance(compression, Sparsifier)
    if sparse and compression.B is not backend:
        raise ValueError(f"{compression!r} was built for horovod_sparse.{compression.B.name}; build it with "
                         f"horovod_sparse.{front_end}.Compression.{compression.method_name}(...)")
    if not sparse and not is_dense(compression):
        raise ValueError(f"compression={compression!r}: pass horovod_sparse.{front_end}.Compression.<method>(...), "
                         "Compression.none or Compression.fp16")
    return sparse
