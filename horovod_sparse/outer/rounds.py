"""Sparse outer steps (DiLoCo, SparseLoCo): every method on rare exchanges of pseudo-gradients.

    outer = hso.OuterSteps(model, torch.optim.AdamW(model.parameters()),
                           compression=hso.Compression.topk(density=0.01), every=50)
    for batch in loader:
        loss_fn(model(batch)).backward()
        outer.step()            # the inner step; every 50th call also the outer step
        outer.zero_grad()

Each worker takes ``every`` inner steps with its own optimizer and no exchange (a round); then
the round's pseudo-gradient ``anchor - θ`` (what the inner steps moved from where every replica
started the round) is exchanged by the chosen method with its error-feedback residual and
averaged, every replica resets to the anchor and the outer optimizer (DiLoCo's Nesterov SGD,
lr 0.7, momentum 0.9, by default) applies the average as a gradient: every replica starts the
next round from the same parameters. ``Compression.none`` is plain DiLoCo (a dense average).

Two options take the exchange off the critical path (:mod:`horovod_sparse.outer.fragments`):

* ``overlap=True``: a fragment's exchange runs while the inner steps of its next round proceed
  (a one-round delay, as PCCL's DiLoCo): at a round's end the pseudo-gradient is taken and
  its exchange started, and the parameters go back to the anchor; the exchange started a round
  earlier ends there and its outer step is taken first, so every replica starts the next round
  from the same parameters, each round's progress on the wire until the next.
* ``fragments=F``: the parameters cut into ``F`` fragments, each with its own round boundary
  in the cycle of ``every`` inner steps (Streaming DiLoCo), one fragment's exchange on the wire
  at a time. A fragment's outer step moves its parameters by what it moved the anchor: what the
  inner steps did since the fragment's last boundary is kept (``θ <- anchor' - (anchor - θ)``),
  so the fragment's replicas agree at its boundaries.

``hierarchical=True`` runs the outer steps in two tiers (:mod:`horovod_sparse.common.tiers`) for
nodes of several workers, each node's workers one DiLoCo replica trained by a dense exchange of
their own inside the node (DDP over :attr:`OuterSteps.node_group`): at a round's end the node sums
its ranks' error-fed pseudo-gradients by a reduce-scatter, each slice of the sum is exchanged by
the method across nodes among the ranks owning it (the dense average too, a slice per rank), and
the node gathers the slices' averages; each rank's residual is its slice's.

    outer = hso.OuterSteps(model, inner, compression=hso.Compression.topk(density=0.01), every=50,
                           hierarchical=True)          # nodes of LOCAL_WORLD_SIZE ranks
    ddp = DDP(model, process_group=outer.node_group)   # the inner steps' exchange, in the node

The exchange is the DDP hook's and FSDP2's (:class:`~horovod_sparse.engine.step.StepEngine`):
one group per parameter, planned, started, finished in parameter order, agreed on non-finite
values over the job and closed, a round being the engine's step (its statistics, warm-up and
schedules count rounds).
"""
from __future__ import annotations

from typing import IO, Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from horovod_sparse.common.nonfinite import resolve_nonfinite
from horovod_sparse.common.validation import check_bool, check_int
from horovod_sparse.distributed.compression import Compression
from horovod_sparse.engine.flight import Flight
from horovod_sparse.engine.step import EngineSteps
from horovod_sparse.outer import fragments as fragmenting
from horovod_sparse.outer.anchor import Anchor
from horovod_sparse.outer.checkpoint import RoundCheckpoints
from horovod_sparse.outer.landing import Landed
from horovod_sparse.outer.replicas import Replicas
from horovod_sparse.outer.outer_optimizer import OuterOptimizer, OuterOptimizerArgument, check_outer_optimizer
from horovod_sparse.outer.sharded import local_shard, replicas_of
from horovod_sparse.outer.tiers import NodeTiers
from horovod_sparse.torch_core.buffers import FlatGroup
from horovod_sparse.torch_core.finiteness import StepFiniteness

class OuterSteps(RoundCheckpoints, NodeTiers, OuterOptimizer, EngineSteps):
    """Local inner steps and a sparse outer step every ``every`` of them, on ``torch.distributed``.

    Args:
        model: the replica (no DDP, whose every backward pass would exchange; with ``hierarchical``,
            DDP over :attr:`node_group` after building this; FSDP2 over the replica's ranks:
            :mod:`~horovod_sparse.outer.sharded`). Its trainable parameters (local shards) are what
            the outer steps average; its buffers (BatchNorm's statistics) stay each replica's own.
        inner_optimizer: the optimizer of the local steps, over the model's parameters.
        compression: ``horovod_sparse.outer.Compression.<method>(...)`` (any method), or
            ``Compression.none`` / ``Compression.fp16`` (DiLoCo's dense average).
        every: inner steps per round (DiLoCo's H), at least 1.
        outer_optimizer: the optimizer of the outer steps, over exactly the model's trainable
            parameters (the average pseudo-gradient is its gradient), or a function building it
            over the tensors it is given (the parameters, or with ``offload`` the anchor's, in the
            model's parameter order: an optimizer object is refused there), such as
            ``lambda params: torch.optim.SGD(params, lr=1.0)``; default
            :func:`~horovod_sparse.outer.outer_optimizer.diloco_outer_optimizer`.
        process_group: the ``torch.distributed`` group of the replicas (None: every process).
        nonfinite: what a NaN/Inf pseudo-gradient on any rank does, as in the other front ends:
            ``"raise"`` (default with a sparsifier) or ``"skip"``; None (default densely) checks
            nothing. Either way the round is abandoned on every rank: no outer step, every
            replica back at the anchor (the round's inner steps undone), and each healthy rank's
            pseudo-gradient kept in its residual (nothing lost; a non-finite one never reaches a
            residual). ``"raise"`` then makes :meth:`step` raise ``FloatingPointError`` on every
            rank, ``"skip"`` warns. The inner optimizer's state is not rolled back: a NaN in its
            moments stays there.
        stats_log: a text stream receiving one JSON line of statistics per exchange.
        overlap: whether a round's exchange runs during the next round's inner steps (the
            module's docstring): its outer step is taken at the next boundary of the same
            fragment. Every replica still starts each round from the same parameters; a round's
            progress reaches them one round later. Call :meth:`flush` after training to take
            the last outer step.
        fragments: how many fragments the trainable parameters are cut into (runs of whole
            parameters, about even in elements: :func:`~horovod_sparse.outer.fragments.cut`),
            each ending its round at its own inner step of the cycle
            (:func:`~horovod_sparse.outer.fragments.offsets`); 1 (default): every parameter ends
            its round after every ``every``-th inner step. At most ``every`` and the number of
            trainable parameters. The outer optimizer steps one fragment at a time (the other
            parameters have no gradient then), so its state is each fragment's own.
        offload: keep the anchor and the outer optimizer's state in CPU memory (pinned where the
            model is on a GPU; :class:`~horovod_sparse.outer.anchor.Anchor`): the outer
            optimizer steps the anchor there, with the average copied to it, and the parameters
            take the result; the pseudo-gradient is taken on the model's device. The same
            results as without it, bitwise where the outer optimizer computes alike on both.
        hierarchical: the outer exchange in two tiers (the module's docstring): nodes of
            ``node_size`` consecutive ranks, made at construction (one new group per node and per
            slice, as the DDP hook's ``hierarchical=True``; collective). It needs the default
            process group (``process_group=None``). A job of one node, or of one worker per node,
            has nothing to split and runs flat. A model wrapped in DDP over :attr:`node_group`
            afterwards exchanges its inner steps' gradients inside the node.
        node_size: workers per node with ``hierarchical``, ranks ``[c * node_size, (c + 1) *
            node_size)`` on node ``c`` (as ``torchrun`` numbers them); default ``LOCAL_WORLD_SIZE``
            (one node without it). Every rank must give the same.

    At construction every rank checks that the configuration (method and options, ``every``,
    ``nonfinite``, ``hierarchical``, ``node_size``, the parameters' names, sizes and dtypes) is the
    same everywhere, raising the same ``ValueError`` on every rank naming what differs, and takes
    rank 0's parameters (of ``process_group``), before the tiers are made: collective, like every
    outer step (in a Horovod elastic job ``TorchState``'s sync does both: :mod:`horovod_sparse.torch.elastic`).

    Attributes:
        steps: exchanges closed so far (a fragment's round each, abandoned ones included); an
            engine step, whose count warm-up and schedules follow.
        position: inner steps taken in the current cycle of ``every``.
        last_stats: the last closed exchange's statistics (bytes, density, seconds; ``abandoned``).
        groups: the groups, one per trainable parameter, in the model's order.
        fragments: each fragment's groups (indices into :attr:`groups`).
        offsets: the :attr:`position` at which each fragment ends its round (0: the cycle's end).
        tiers: the two tiers' groups (None: flat).
        node_group: this rank's node's group in two tiers (for DDP; Horovod's: the host's process set).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 compression: Any = Compression.none, every: int = 50,
                 outer_optimizer: OuterOptimizerArgument = None,
                 process_group: Optional[dist.ProcessGroup] = None, nonfinite: Optional[str] = "default",
                 stats_log: Optional[IO[str]] = None, overlap: bool = False, fragments: int = 1,
                 offload: bool = False, hierarchical: bool = False, node_size: Optional[int] = None) -> None:
        self.replicas = self._replicas_of(process_group, model)
        self.sparse = self.replicas.checked_sparse(compression)
        self.compression = compression
        self.every = check_int("every", every, minimum=1)
        self.overlap = check_bool("overlap", overlap)
        self.offload = check_bool("offload", offload)
        self.hierarchical = check_bool("hierarchical", hierarchical)
        self.node_size = None if node_size is None else check_int("node_size", node_size, minimum=1)
        count = check_int("fragments", fragments, minimum=1)
        if count > self.every:
            raise ValueError(f"fragments={count} needs every >= fragments (each fragment ends its round at its own "
                             f"inner step of the {self.every}); give fragments <= every={self.every}")
        self.nonfinite = resolve_nonfinite(nonfinite, self.sparse)
        self.model = model
        self.inner_optimizer = inner_optimizer
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("OuterSteps: the model has no trainable parameters")
        self.groups = [FlatGroup(i, [name], [local_shard(p)], name=name) for i, (name, p) in enumerate(named)]
        self.fragments = fragmenting.cut([p.numel() for _, p in named], count)  # whole parameters (FSDP2)
        self.offsets = fragmenting.offsets(self.every, count)
        check_outer_optimizer(outer_optimizer, self.offload, named)
        self._engine = self.replicas.engine(compression, stats_log)
        self._state = self._engine.model
        self._agree = self.replicas.agreement(self.nonfinite, self._engine)
        self._finiteness = StepFiniteness(self.nonfinite is not None)
        self.position = 0
        self._in_flight: Optional[Tuple[int, List[Flight]]] = None
        self._landed: Optional[Landed] = None
        if self.replicas.agree_at_construction:
            self._require_same_configuration()
            self.replicas.broadcast_from_first([p.data for group in self.groups for p in group.params])
        self._engine.tiers = self.replicas.tiers(self.hierarchical, self.node_size)
        if self.tiers is not None:
            self._state.use_tiers(self.tiers)
        self.anchor = Anchor(self.groups, self.offload)
        self._use_outer_optimizer(outer_optimizer, self.anchor.masters or [[p] for _, p in named], named)

    # -- the training loop ---------------------------------------------------------------------
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """The inner step (``inner_optimizer.step(closure)``, whose result is returned); then the
        round's end of each fragment whose offset the position reaches (collective: every rank
        of the group calls it)."""
        loss = self.inner_optimizer.step(closure) if closure is not None else self.inner_optimizer.step()
        self.position = (self.position + 1) % self.every
        self._report([landed for f, offset in enumerate(self.offsets) if offset == self.position
                      for landed in self._boundary(f)])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad`` (``set_to_none`` passed only when False: Horovod's
        ``DistributedOptimizer`` takes no argument, and sets to None as PyTorch's default does)."""
        self.inner_optimizer.zero_grad(*(() if set_to_none else (False,)))

    def sync(self) -> None:
        """Every fragment's round ended now, in fragment order, and a new cycle begun (after the
        last inner step of training, so that every replica holds the same parameters; a round of
        no inner steps exchanges zero pseudo-gradients, which still delivers residuals). With
        ``overlap`` the last fragment's exchange is then still in flight: :meth:`flush` it.
        Collective."""
        self.position = 0
        self._report([landed for f in range(len(self.fragments)) for landed in self._boundary(f)])

    def flush(self) -> None:
        """End the exchange in flight (``overlap``) and take its outer step now, what the inner
        steps did since its fragment's boundary kept; nothing without one. After :meth:`sync`,
        every replica holds the same parameters with every round applied. Collective."""
        self._land()
        self._report([self._take_landed(boundary=None)])

    def _boundary(self, fragment: int) -> List[Optional[Landed]]:
        """Fragment ``fragment``'s round ends: its pseudo-gradients taken, the exchange in flight
        ended and its outer step taken, the fragment's parameters back at its anchor, its
        exchange started and, without ``overlap``, ended and its outer step taken. Returns what
        landed, for :meth:`_report` once every boundary of the step is done."""
        indices = self.fragments[fragment]
        deltas = [self.anchor.pseudo_gradient(i) for i in indices]
        self._land()
        landed = [self._take_landed(boundary=fragment)]
        self.anchor.reset(indices)
        self._start(fragment, deltas)
        if not self.overlap:
            self._land()
            landed.append(self._take_landed(boundary=fragment))
        return landed

    def _start(self, fragment: int, deltas: Sequence[torch.Tensor]) -> None:
        """Launch the exchange of the fragment's pseudo-gradients (dense in the exchanges before
        ``warmup_steps``); it is in flight until :meth:`_land`."""
        self.replicas.place(self.groups[0].params[0])
        self._in_flight = (fragment, [self._start_group(self.groups[index], delta)
                                      for index, delta in zip(self.fragments[fragment], deltas)])

    def _start_group(self, group: FlatGroup, delta: torch.Tensor) -> Flight:
        """Launch ``group``'s exchange of its pseudo-gradient ``delta``."""
        finite = self._finiteness.check([group.name], delta)
        return self._engine.start(group, lambda: group.load_flat(delta, None, finite),
                                  self.replicas.dense_flight(self._engine, group, delta, self.compression, finite))

    def _land(self) -> None:
        """End the exchange in flight, if any (collective): its averages, agreed non-finite
        pseudo-gradients (abandoned on every rank if any rank saw one) and the engine's step
        closed, kept as :class:`Landed` for :meth:`_take_landed`."""
        if self._in_flight is None:
            return
        fragment, flights = self._in_flight
        self._in_flight = None
        updates = [self._engine.finish_one(flight) for flight in flights]
        outcome = self._engine.end(self._finiteness, self._agree, lambda abandoned: None, self._state.end_step)
        self._landed = Landed.of(fragment, updates, outcome)

    @torch.no_grad()
    def _take_landed(self, boundary: Optional[int]) -> Optional[Landed]:
        """The outer step of what landed (nothing when it was abandoned): the fragment's
        parameters at its anchor, the outer optimizer's step with each group's average as the
        gradient (the other parameters have none), the result its next anchor (offloaded: the
        step taken on the anchor, the parameters set to it). Unless the fragment is
        ``boundary`` (its parameters' progress is on the wire already), what its inner steps
        did since its anchor is put back on top: ``θ <- anchor' - (anchor - θ)``. Returns what
        was taken."""
        landed, self._landed = self._landed, None
        if landed is None or landed.updates is None:
            return landed
        indices = self.fragments[landed.fragment]
        progress = [self.anchor.pseudo_gradient(i) for i in indices] if landed.fragment != boundary else []
        if not self.offload:
            self.anchor.reset(indices)
        self._outer_step(indices, landed.updates)
        if self.offload:
            self.anchor.reset(indices)
        else:
            self.anchor.take(indices)
        for index, delta in zip(indices, progress):
            group = self.groups[index]
            for p, view in zip(group.params, group.views(delta)):
                p.sub_(view)
        return landed

    def _report(self, landed: List[Optional[Landed]]) -> None:
        """Report each abandoned exchange of ``landed`` (None: nothing landed) under the
        ``nonfinite`` policy, once every outer step of the call is taken."""
        for each in filter(None, landed):
            each.report(self.nonfinite)

    @staticmethod
    def _replicas_of(process_group: Any, model: torch.nn.Module) -> Replicas:
        """The replicas of ``process_group`` (a ``torch.distributed`` group; for FSDP2, outer.sharded's)."""
        return replicas_of(process_group, model)

    # -- agreement ------------------------------------------------------------------------------
    def _require_same_configuration(self) -> None:
        keys = [(g.name, g.numel, str(g.dtype), [list(p.shape) for p in g.params]) for g in self.groups]
        self._state.require_same_configuration({"every": self.every, "nonfinite": self.nonfinite,
                                                "overlap": self.overlap, "fragments": len(self.fragments),
                                                "offload": self.offload, "hierarchical": self.hierarchical,
                                                "node_size": self.node_size,
                                                "steps": self.steps, "position": self.position}, keys)

