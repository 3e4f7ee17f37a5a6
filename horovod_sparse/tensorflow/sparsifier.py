"""The base class of every TensorFlow sparsifier and the exchange protocol they follow.

The counterpart of :mod:`horovod_sparse.torch.sparsifier`, with the same design: a sparsifier is
a :class:`horovod.tensorflow.compression.Compressor` (passed as the familiar ``compression=``
argument), but its real interface is :meth:`Sparsifier.exchange`, a generator that selects
coordinates of a group's error-feedback buffer, launches Horovod collectives through a
:class:`~horovod_sparse.tensorflow.collectives.Communicator`, yields the pending collectives it
needs finished and, resumed with their outputs, produces the aggregated update and the new
residual. The gradient-exchange driver (:mod:`horovod_sparse.tensorflow.exchanger`) runs these
generators for ``DistributedGradientTape`` and the Keras ``DistributedOptimizer``.

Because TensorFlow tensors are immutable, the generator *returns* ``(update, residual)`` (the
``StopIteration`` value) where the PyTorch one writes ``out`` and ``x`` in place; the selection
logic, the collectives, their tags and the order of the chunks are the same, so both frameworks
select the same coordinates and aggregate the same values.

Inside the *stock* ``hvd.DistributedGradientTape`` / ``hvd.DistributedOptimizer`` a sparsifier
refuses to run (see :meth:`Sparsifier.compress`): those can only allreduce one dense tensor per
gradient and would silently lose whatever is not sent.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, ClassVar, Generator, List, Optional, Sequence, Tuple, Union

import tensorflow as tf
from horovod.tensorflow.compression import Compressor

from horovod_sparse.common.options import SparsifierOptions
from horovod_sparse.common.schedule import ConstantDensity
from horovod_sparse.tensorflow.collectives import Communicator, Pending, index_dtype

#: What an exchange produces: the aggregated update (already scaled) and the new residual.
Result = Tuple[tf.Tensor, tf.Tensor]
#: The generator type of :meth:`Sparsifier.exchange`: yields pendings, receives their outputs,
#: returns a :data:`Result`.
Exchange = Generator[Sequence[Pending], List[Any], Result]
#: The step counter an exchange receives: an int in eager mode, an int64 scalar when traced.
Step = Union[int, tf.Tensor]

STOCK_WRAPPER_REFUSAL = (
    "{cls} is a horovod_sparse sparsifier: it sends (values, indices) payloads and keeps an "
    "error-feedback residual per gradient, which horovod.tensorflow's DistributedGradientTape and "
    "DistributedOptimizer cannot do (they allreduce one dense tensor per gradient and would "
    "silently drop what is not sent). Use horovod_sparse.tensorflow.DistributedGradientTape(tape, "
    "compression=...) or horovod_sparse.tensorflow.keras.DistributedOptimizer(optimizer, "
    "compression=...) instead; they take the same arguments."
)


class Sparsifier(Compressor):
    """Selects and exchanges a sparse part of each group's gradient, with error feedback.

    Subclasses implement :meth:`exchange` (and :meth:`new_state` when they keep per-group state)
    and are registered with :func:`horovod_sparse.common.registry.implements`.

    Args:
        options: validated options (see :class:`~horovod_sparse.common.options.SparsifierOptions`).
    """

    #: Registry name, set by ``@implements``.
    method_name: ClassVar[str] = ""
    #: Grouping used when the driver is given ``groups=None``: ``"tensor"`` or ``"model"``.
    default_grouping: ClassVar[str] = "tensor"
    #: Whether :meth:`exchange` can be traced into a ``tf.function`` (a graph). Methods whose
    #: decisions are made in Python from values of the current step (threshold controllers,
    #: partition tables) set this to False and run in eager mode only; the driver then refuses to
    #: trace them with a message saying how to run eagerly.
    traceable: ClassVar[bool] = True
    #: Whether :meth:`new_state`'s state differs between ranks (like a residual) rather than
    #: being the same on every rank; shared state is agreed from the first rank at a variable
    #: list's first exchange, per-rank state never is.
    per_rank_state: ClassVar[bool] = False

    def __init__(self, options: SparsifierOptions) -> None:
        self.options = options

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.options.as_dict().items() if k != "method")
        return f"Compression.{self.method_name}({fields})"

    # -- stock-wrapper path: refuse clearly instead of producing wrong gradients ---------------
    def compress(self, tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        """Refuse: sparsifiers only run inside horovod_sparse's tape and Keras optimizer."""
        raise TypeError(STOCK_WRAPPER_REFUSAL.format(cls=type(self).__name__))

    def decompress(self, tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Refuse, like :meth:`compress`."""
        raise TypeError(STOCK_WRAPPER_REFUSAL.format(cls=type(self).__name__))

    # -- the real interface ----------------------------------------------------------------------
    def new_state(self, numel: int, world_size: int) -> Any:
        """Per-group state kept across steps (thresholds, partitions); None when stateless.

        Called once per group, outside any ``tf.function``; a traceable method keeps state that
        changes from step to step in ``tf.Variable`` objects.
        """
        return None

    def exchange(self, x: tf.Tensor, comm: Communicator, state: Any, step: Step) -> Exchange:
        """Select from ``x``, exchange, and return ``(update, residual)``.

        Contract:
            * ``x`` is the group's flat buffer ``g + e`` (gradient plus residual), 1-D;
            * the returned ``update`` is the aggregated update, 1-D of ``x``'s size and dtype,
              already multiplied by ``comm.scale`` (1/n for Average), bitwise identical on every
              rank; the returned ``residual`` is ``x`` minus what this rank delivered into it;
            * every rank must launch the same collectives with the same tags in the same order,
              whatever it selected (never skip a collective because a rank has nothing to send);
            * ``step`` counts the driver's exchanges (a Python int in eager mode, an int64
              scalar tensor when traced).
        """
        raise NotImplementedError

    def export_state(self, state: Any) -> Any:
        """``state`` (from :meth:`new_state`, as the exchanges left it) as plain Python/NumPy
        objects that later steps do not change: what a checkpoint saves. Default: a deep copy
        (the framework-free states are plain numbers and lists)."""
        return copy.deepcopy(state)

    def import_state(self, saved: Any) -> Any:
        """The per-group state to continue from, rebuilt from :meth:`export_state`'s output."""
        return copy.deepcopy(saved)

    # -- helpers shared by the methods -----------------------------------------------------------
    def per_step(self, decide: Callable[[Optional[int]], Any], step: Step, dtype: tf.DType) -> Any:
        """``decide(step)`` for a decision that depends on the step only through the density
        schedule: a Python value in eager mode (``decide(step)``) or without a schedule
        (``decide(None)``), else a ``dtype`` scalar computed by :func:`host_call` when the
        traced step runs."""
        if isinstance(step, int):
            return decide(step)
        if isinstance(self.options.schedule, ConstantDensity):
            return decide(None)
        return host_call(decide, [step], dtype)

    def count(self, numel: int, step: Step) -> Union[int, tf.Tensor]:
        """Target count ``k`` of a group of ``numel`` elements at ``step`` (see :meth:`per_step`)."""
        return self.per_step(lambda s: self.options.count(numel, s), step, tf.int32)

    def density(self, step: Step) -> Union[float, tf.Tensor]:
        """The density at ``step`` (see :meth:`per_step`)."""
        return self.per_step(self.options.density_at, step, tf.float64)

    def to_wire(self, values: tf.Tensor) -> tf.Tensor:
        """Values as they travel: float16 when ``fp16_values`` is set; bfloat16 as float32
        (Horovod 0.28.1's TensorFlow collectives do not take bfloat16); otherwise unchanged."""
        if self.options.fp16_values:
            return tf.cast(values, tf.float16)
        return tf.cast(values, tf.float32) if values.dtype == tf.bfloat16 else values

    @staticmethod
    def remove_delivered(x: tf.Tensor, idx: tf.Tensor, wire_values: tf.Tensor) -> tf.Tensor:
        """Residual update: ``x`` minus what was delivered at ``idx`` (distinct indices).

        Subtracting the wire values (rather than zeroing) keeps the float16 rounding error in
        the residual, so error feedback loses nothing even with ``fp16_values``.
        """
        return tf.tensor_scatter_nd_sub(x, tf.expand_dims(idx, 1), tf.cast(wire_values, x.dtype))

    def allgather_exchange(self, x: tf.Tensor, idx: tf.Tensor, comm: Communicator,
                           fixed_count: Union[None, int, tf.Tensor] = None) -> Exchange:
        """The exchange of Top-k and the threshold baselines: allgather (values, indices),
        scatter-add every rank's chunk, scale. ``idx`` holds distinct indices into ``x``.

        With ``fixed_count`` every rank is known to send exactly that many coordinates;
        otherwise the per-rank counts are allgathered too (n integers of metadata).
        """
        numel = int(x.shape[0])
        idx = tf.cast(idx, index_dtype(numel))
        wire = self.to_wire(tf.gather(x, idx))
        pendings = [comm.allgather(wire, "values", "values"), comm.allgather(idx, "indices", "indices")]
        if fixed_count is None:
            count = tf.reshape(tf.size(idx, out_type=tf.int64), [1])
            pendings.append(comm.allgather(count, "counts", "meta"))
        comm.stats.selected = fixed_count if fixed_count is not None else tf.size(idx, out_type=tf.int64)
        residual = self.remove_delivered(x, idx, wire)
        values, indices, *counts = yield pendings
        with comm.timer("apply"):
            if fixed_count is None:
                # One count per rank: a static length, so the chunks can be split when traced.
                chunk_counts: Union[List[int], tf.Tensor] = tf.reshape(counts[0], [comm.size])
            elif isinstance(fixed_count, int):
                chunk_counts = [fixed_count] * comm.size
            else:
                chunk_counts = tf.fill([comm.size], fixed_count)
            update = scatter_chunks(numel, x.dtype, indices, values, chunk_counts, comm.scale)
            comm.stats.union = tf.size(tf.unique(indices).y, out_type=tf.int64)
        return update, residual


def scatter_chunks(numel: int, dtype: tf.DType, indices: tf.Tensor, values: tf.Tensor,
                   counts: Union[Sequence[int], tf.Tensor], scale: float) -> tf.Tensor:
    """A zero buffer of ``numel`` elements with ``scale * values`` added at ``indices``, one
    rank's chunk at a time (``counts[r]`` coordinates from rank r).

    Within a chunk indices are distinct, so each chunk is one race-free scatter-add and the
    chunks are added in rank order: the result is bitwise identical on every rank and on any
    device (one scatter with repeated indices adds in an unspecified order on GPUs), and equal to
    the PyTorch side's ``index_add_`` sequence up to float rounding.
    """
    out = tf.zeros([numel], dtype=dtype)
    values = tf.cast(values, dtype)
    size = len(counts) if isinstance(counts, (list, tuple)) else int(counts.shape[0])
    index_chunks = tf.split(indices, counts, num=size)
    value_chunks = tf.split(values, counts, num=size)
    for index_chunk, value_chunk in zip(index_chunks, value_chunks):
        out = tf.tensor_scatter_nd_add(out, tf.expand_dims(index_chunk, 1), value_chunk * scale)
    return out


def host_call(decide: Callable[..., Any], args: Sequence[Union[int, float, tf.Tensor]], dtype: tf.DType) -> Any:
    """Run a framework-free decision (a threshold controller, a schedule, a partition table from
    :mod:`horovod_sparse.common`) on the current values of ``args``.

    Eager mode: ``decide`` is called now with Python numbers (NumPy arrays for non-scalars) and
    its result is returned as is. Traced: ``decide`` runs through ``tf.py_function`` each time
    the step runs, and its result is a tensor of ``dtype``. So a decision is written once, in
    Python, and the same code serves both modes (and both frameworks).
    """
    if tf.executing_eagerly():
        return decide(*[_host_value(a) for a in args])

    def run(*values: tf.Tensor) -> Any:
        return decide(*[_host_value(v) for v in values])

    return tf.py_function(run, inp=list(args), Tout=dtype, name="horovod_sparse_decision")


def _host_value(value: Any) -> Any:
    if isinstance(value, (tf.Tensor, tf.Variable)):
        value = value.numpy()
        return value.item() if value.ndim == 0 else value
    return value
