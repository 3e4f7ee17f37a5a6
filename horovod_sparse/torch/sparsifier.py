"""The base class of every PyTorch sparsifier and the exchange protocol they follow.

A sparsifier is a :class:`horovod.torch.compression.Compressor` (so it is passed as the familiar
``compression=`` argument), but its real interface is :meth:`Sparsifier.exchange`: a generator
that selects coordinates of a group's error-feedback buffer, launches Horovod collectives through
a :class:`~horovod_sparse.torch.collectives.Communicator`, yields the pending collectives it needs
finished, and, resumed with their outputs, writes the aggregated update and the new residual.
:class:`horovod_sparse.torch.DistributedOptimizer` drives these generators; generators let one
method use any number of rounds (gTop-k) while the optimizer overlaps the first round with the
rest of the backward pass.

Inside the *stock* ``hvd.DistributedOptimizer`` a sparsifier refuses to run (see
:meth:`Sparsifier.compress`): that optimizer can only allreduce one dense tensor per gradient,
gives the compressor no stable name for a residual, and would silently lose whatever is not sent.
"""
from __future__ import annotations

from typing import Any, ClassVar, Dict, Generator, List, Optional, Sequence, Tuple

import torch
from horovod.torch.compression import Compressor

from horovod_sparse.common.grouping import StepTimeline
from horovod_sparse.common.options import SparsifierOptions
from horovod_sparse.torch.collectives import Communicator, Pending, index_dtype

#: The generator type of :meth:`Sparsifier.exchange`: yields pendings, receives their outputs.
Exchange = Generator[Sequence[Pending], List[Any], None]

STOCK_OPTIMIZER_REFUSAL = (
    "{cls} is a horovod_sparse sparsifier: it sends (values, indices) payloads and keeps an "
    "error-feedback residual per gradient, which horovod.torch.DistributedOptimizer cannot do "
    "(it allreduces one dense tensor per gradient and would silently drop what is not sent). "
    "Use horovod_sparse.torch.DistributedOptimizer(optimizer, named_parameters=..., "
    "compression=...) instead; it takes the same arguments."
)


class Sparsifier(Compressor):
    """Selects and exchanges a sparse part of each group's gradient, with error feedback.

    Subclasses implement :meth:`exchange` (and :meth:`new_state` when they keep per-group state
    such as thresholds or partition tables) and are registered with
    :func:`horovod_sparse.common.registry.implements`.

    Args:
        options: validated options (see :class:`~horovod_sparse.common.options.SparsifierOptions`).
    """

    #: Registry name, set by ``@implements``.
    method_name: ClassVar[str] = ""
    #: Grouping used when the optimizer is given ``groups=None`` (any ``groups=`` strategy).
    default_grouping: ClassVar[str] = "tensor"
    #: Whether :meth:`new_state`'s state differs between ranks (like a residual) rather than
    #: being the same on every rank; shared state is agreed from one rank when an optimizer
    #: starts (see ``DistributedOptimizer.agree_shared_state``), per-rank state never is.
    per_rank_state: ClassVar[bool] = False

    def __init__(self, options: SparsifierOptions) -> None:
        self.options = options

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.options.as_dict().items() if k != "method")
        return f"Compression.{self.method_name}({fields})"

    # -- stock-optimizer path: refuse clearly instead of producing wrong gradients -------------
    def compress(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Refuse: sparsifiers only run inside ``horovod_sparse.torch.DistributedOptimizer``."""
        raise TypeError(STOCK_OPTIMIZER_REFUSAL.format(cls=type(self).__name__))

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Refuse, like :meth:`compress`."""
        raise TypeError(STOCK_OPTIMIZER_REFUSAL.format(cls=type(self).__name__))

    # -- the real interface ----------------------------------------------------------------------
    def new_state(self, numel: int, world_size: int) -> Any:
        """Per-group state kept across steps (thresholds, partitions); None when stateless."""
        return None

    def resized_state(self, state: Any, numel: int, world_size: int) -> Any:
        """A group's state, built for another world size, for ``world_size`` ranks (an elastic
        change, or a checkpoint loaded on another number of workers). Default: a new state,
        since partition tables, schedules and thresholds depend on the world size; a method
        whose state is per rank and independent of it (DGC's velocity) keeps it."""
        return self.new_state(numel, world_size)

    def method_state(self, per_rank: bool) -> Dict[str, Any]:
        """What the method keeps across groups and steps (LAGS's measurements), as plain
        containers for a checkpoint; with ``per_rank`` everything, else only what every rank
        holds alike (agreed from one rank like the groups' shared state). Default: nothing."""
        return {}

    def load_method_state(self, state: Dict[str, Any]) -> None:
        """Take a :meth:`method_state` saved here or on another rank; what it leaves out stays."""

    def on_step_end(self, process_set: Any, record: StepTimeline) -> None:
        """Called by the optimizer on every rank of ``process_set`` at the end of each
        ``synchronize()``, after every group finished, outside the backward hooks: the place for
        work that must happen at the same point on every rank (blocking collectives, such as a
        cost-model calibration). ``record`` says when each group became ready during this
        step's backward (LAGS measures ``t_comp`` from it). Default: nothing."""

    def exchange(self, x: torch.Tensor, out: torch.Tensor, comm: Communicator, state: Any,
                 step: int) -> Exchange:
        """Select from ``x``, exchange, and write the aggregated update.

        Contract:
            * on entry ``x`` is the group's flat buffer ``g + e`` (gradient plus residual), 1-D,
              contiguous; on exit it must hold the new residual: ``x`` minus what this rank
              delivered into the aggregate;
            * ``out`` is a zeroed 1-D buffer of the same size and dtype; on exit it holds the
              aggregated update, already multiplied by ``comm.scale`` (1/n for Average);
            * every rank must launch the same collectives with the same tags in the same order,
              whatever it selected (never skip a collective because a rank has nothing to send);
            * ``out`` must be bitwise identical on every rank.
        """
        raise NotImplementedError

    # -- helpers shared by the methods -----------------------------------------------------------
    def to_wire(self, values: torch.Tensor) -> torch.Tensor:
        """Values as they travel: float16 when ``fp16_values`` is set; bfloat16 as float32
        (Horovod's torch collectives do not take bfloat16); otherwise unchanged."""
        if self.options.fp16_values:
            return values.to(torch.float16)
        return values.float() if values.dtype == torch.bfloat16 else values

    def allgather_exchange(self, x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
                           comm: Communicator, fixed_count: Optional[int] = None) -> Exchange:
        """The exchange of Top-k and the threshold baselines: allgather (values, indices),
        scatter-add every rank's chunk, scale. ``idx`` holds distinct indices into ``x``.

        With ``fixed_count`` every rank is known to send exactly that many coordinates;
        otherwise the per-rank counts are allgathered too (n integers of metadata).
        """
        wire = self.to_wire(x[idx])
        pendings = [comm.allgather(wire, "values", "values"),
                    comm.allgather(idx.to(index_dtype(x.numel())), "indices", "indices")]
        if fixed_count is None:
            count = torch.tensor([idx.numel()], dtype=torch.int64, device=x.device)
            pendings.append(comm.allgather(count, "counts", "meta"))
        comm.stats.selected = idx.numel()
        comm.remove_delivered(x, idx, wire)
        outputs = yield pendings
        with comm.timer("apply"):
            counts = [fixed_count] * comm.size if fixed_count is not None else outputs[2].tolist()
            comm.stats.union = apply_chunks(out, outputs[1].long(), outputs[0], counts, comm.scale)


#: :func:`apply_chunks` counts the union by sorting while the indices are fewer than
#: ``1 / UNION_BY_MARKS`` of the buffer (sorting ``n k`` indices costs about as much as marking
#: and counting ``16 n k`` bytes).
UNION_BY_MARKS = 16


def apply_chunks(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                 counts: Sequence[int], scale: float) -> int:
    """:func:`scatter_chunks`, and the number of distinct ``indices`` (the union the ranks
    delivered): by sorting when they are few, else by marking ``out``'s coordinates, which reads
    ``out.numel()`` bytes once instead of sorting ``n k`` indices."""
    scatter_chunks(out, indices, values, counts, scale)
    if indices.numel() * UNION_BY_MARKS < out.numel():
        return int(torch.unique(indices).numel())
    marks = torch.zeros(out.numel(), dtype=torch.bool, device=out.device)
    marks[indices] = True
    return int(marks.sum())


def scatter_chunks(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                   counts: Sequence[int], scale: float) -> None:
    """``out[indices] += scale * values``, one rank's chunk at a time.

    Within a chunk indices are distinct, so each chunk is one race-free ``index_add_`` and the
    chunks are added in rank order: the result is bitwise identical on every rank, on CPU and
    on GPU (where one ``index_add_`` with repeated indices would add in a non-deterministic
    order).
    """
    values = values.to(out.dtype)
    for index_chunk, value_chunk in zip(indices.split(list(counts)), values.split(list(counts))):
        out.index_add_(0, index_chunk, value_chunk, alpha=scale)
