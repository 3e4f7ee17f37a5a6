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

The exchange is the DDP hook's and FSDP2's (:class:`~horovod_sparse.engine.step.StepEngine`):
one group per parameter, planned, started, finished in parameter order, agreed on non-finite
values over the job and closed, a round being the engine's step (its statistics, warm-up and
schedules count rounds).
"""
from __future__ import annotations

from typing import IO, Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from horovod_sparse.common.nonfinite import resolve_nonfinite
from horovod_sparse.common.validation import check_int
from horovod_sparse.distributed.process_group import ProcessGroup
from horovod_sparse.distributed.compression import Compression, checked_sparse
from horovod_sparse.distributed.rank_state import rank_entry, state_of_this_rank
from horovod_sparse.distributed.stepping import dense_average, distributed_engine, nonfinite_agreement
from horovod_sparse.engine.step import EngineSteps
from horovod_sparse.outer.anchor import Anchor
from horovod_sparse.torch_core.buffers import FlatGroup
from horovod_sparse.torch_core.finiteness import StepFiniteness

#: DiLoCo's outer optimizer (Douillard et al. 2023): Nesterov SGD, learning rate 0.7, momentum 0.9.
DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def diloco_outer_optimizer(params: List[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer over ``params`` (:data:`DILOCO_OUTER`)."""
    return torch.optim.SGD(params, **DILOCO_OUTER)


class OuterSteps(EngineSteps):
    """Local inner steps and a sparse outer step every ``every`` of them, on ``torch.distributed``.

    Args:
        model: the replica (a plain module: no DDP, whose every backward pass would exchange).
            Its trainable parameters are what the outer steps average; its buffers (BatchNorm's
            statistics) stay each replica's own.
        inner_optimizer: the optimizer of the local steps, over the model's parameters.
        compression: ``horovod_sparse.outer.Compression.<method>(...)`` (any method), or
            ``Compression.none`` / ``Compression.fp16`` (DiLoCo's dense average).
        every: inner steps per round (DiLoCo's H), at least 1.
        outer_optimizer: the optimizer of the outer steps, over exactly the model's trainable
            parameters (the average pseudo-gradient is its gradient); default
            :func:`diloco_outer_optimizer`.
        process_group: the ``torch.distributed`` group of the replicas (None: every process).
        nonfinite: what a NaN/Inf pseudo-gradient on any rank does, as in the other front ends:
            ``"raise"`` (default with a sparsifier) or ``"skip"``; None (default densely) checks
            nothing. Either way the round is abandoned on every rank: no outer step, every
            replica back at the anchor (the round's inner steps undone), and each healthy rank's
            pseudo-gradient kept in its residual (nothing lost; a non-finite one never reaches a
            residual). ``"raise"`` then makes :meth:`step` raise ``FloatingPointError`` on every
            rank, ``"skip"`` warns. The inner optimizer's state is not rolled back: a NaN in its
            moments stays there.
        stats_log: a text stream receiving one JSON line of statistics per round.

    At construction every rank takes rank 0's parameters (of ``process_group``) and checks that
    the configuration (method and options, ``every``, ``nonfinite``, the parameters' names,
    sizes and dtypes) is the same everywhere, raising the same ``ValueError`` on every rank
    naming what differs: collective, like every outer step.

    Attributes:
        steps: outer steps closed so far (rounds, abandoned ones included).
        position: inner steps taken in the current round.
        last_stats: the last round's statistics (bytes, density, seconds; ``abandoned``).
        groups: the groups, one per trainable parameter, in the model's order.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 compression: Any = Compression.none, every: int = 50,
                 outer_optimizer: Optional[torch.optim.Optimizer] = None,
                 process_group: Optional[dist.ProcessGroup] = None, nonfinite: Optional[str] = "default",
                 stats_log: Optional[IO[str]] = None) -> None:
        self.sparse = checked_sparse(compression, "outer")
        self.compression = compression
        self.every = check_int("every", every, minimum=1)
        self.nonfinite = resolve_nonfinite(nonfinite, self.sparse)
        self.model = model
        self.inner_optimizer = inner_optimizer
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("OuterSteps: the model has no trainable parameters")
        self.groups = [FlatGroup(i, [name], [p], name=name) for i, (name, p) in enumerate(named)]
        params = [p for _, p in named]
        self.outer_optimizer = outer_optimizer if outer_optimizer is not None else diloco_outer_optimizer(params)
        _require_over(self.outer_optimizer, params, named)
        self.process_group = ProcessGroup(process_group)
        self._engine = distributed_engine(compression, self.process_group, stats_log)
        self._state = self._engine.model
        self._agree = nonfinite_agreement(self.nonfinite, self.process_group)
        self._finiteness = StepFiniteness(self.nonfinite is not None)
        self.position = 0
        self._require_same_configuration()
        self._broadcast_parameters()
        self.anchor = Anchor(self.groups)

    # -- the training loop ---------------------------------------------------------------------
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """The inner step (``inner_optimizer.step(closure)``, whose result is returned); after
        every ``every``-th, the outer step (collective: every rank of the group calls it)."""
        loss = self.inner_optimizer.step(closure) if closure is not None else self.inner_optimizer.step()
        self.position += 1
        if self.position == self.every:
            self.sync()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def sync(self) -> None:
        """The outer step now, ending the round early (after the last inner step of training,
        so that every replica holds the same parameters; a round of no inner steps exchanges
        zero pseudo-gradients, which still delivers residuals). Collective."""
        self.position = 0
        engine = self._engine
        self.process_group.place_payloads_with(self.groups[0].params[0])  # NCCL: host payloads to the model's device
        flights = [self._start(group) for group in self.groups]
        updates = [engine.finish_one(flight) for flight in flights]
        engine.end(self._finiteness, self._agree, lambda abandoned: self._deliver(updates, abandoned),
                   self._state.end_step).apply_policy(self.nonfinite)

    def _start(self, group: FlatGroup) -> Any:
        """Launch ``group``'s exchange of its pseudo-gradient (dense in the rounds before
        ``warmup_steps``)."""
        delta = self.anchor.pseudo_gradient(group.index)
        finite = self._finiteness.check([group.name], delta)
        return self._engine.start(group, lambda: group.load_flat(delta, None, finite),
                                  dense_average(self._engine, group, delta, self.compression, finite))

    def _deliver(self, updates: List[torch.Tensor], abandoned: bool) -> None:
        """Every replica back at the anchor: an abandoned round's inner steps undone, else the
        outer step taken from there (:meth:`_apply`)."""
        self.anchor.reset()
        if not abandoned:
            self._apply(updates)

    @torch.no_grad()
    def _apply(self, updates: List[torch.Tensor]) -> None:
        """The outer optimizer's step from the anchor (where every parameter is now) with each
        group's average pseudo-gradient as the gradient; the result is the next anchor. The
        parameters' inner gradients are put back afterwards."""
        inner_grads = [p.grad for group in self.groups for p in group.params]
        for group, update in zip(self.groups, updates):
            for p, view in zip(group.params, group.views(update)):
                p.grad = view
        self.outer_optimizer.step()
        for p, grad in zip((p for group in self.groups for p in group.params), inner_grads):
            p.grad = grad
        self.anchor.take()

    # -- agreement ------------------------------------------------------------------------------
    def _require_same_configuration(self) -> None:
        keys = [(g.name, g.numel, str(g.dtype), [list(p.shape) for p in g.params]) for g in self.groups]
        self._state.require_same_configuration({"every": self.every, "nonfinite": self.nonfinite,
                                                "steps": self.steps, "position": self.position}, keys)

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Every rank takes the first rank's parameters (of the process group)."""
        source = dist.get_global_rank(self.process_group.group, 0) if self.process_group.group is not None else 0
        for group in self.groups:
            for p in group.params:
                dist.broadcast(p.data, source, group=self.process_group.group)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, bytes]:
        """This rank's state under a key of its own, ``{"rank<r>": bytes}``
        (:mod:`horovod_sparse.distributed.rank_state`): the model's state (mid-round each
        replica's own parameters), the inner and outer optimizers', the anchors, the round's
        position, the step counter and, per group, its residual and method state. ``torch.save``
        it on every rank, or ``dcp.save({"outer": outer.state_dict()}, ...)``: that keeps every
        rank's."""
        return rank_entry({"engine": self._state.record(self.groups, self.steps, per_rank=True),
                           "position": self.position, "every": self.every, "anchor": self.anchor.flat,
                           "model": self.model.state_dict(), "inner": self.inner_optimizer.state_dict(),
                           "outer": self.outer_optimizer.state_dict()})

    def load_state_dict(self, state_dict: Dict[str, bytes]) -> None:
        """Continue exactly from a :meth:`state_dict` this rank saved in a job of the same size
        and model (mid-round too). Collective: every rank loads, and the configuration is
        checked again. Raises ``ValueError`` naming the mismatch before anything is loaded when
        the state was saved by another job size, rank, model or ``every``."""
        saved = state_of_this_rank(state_dict, "the outer steps' state")
        if saved["every"] != self.every:
            raise ValueError(f"the outer steps' state was saved with every={saved['every']}, these take "
                             f"every={self.every}: build OuterSteps with the every= it was saved with")
        problem = self._state.groups_mismatch({name: e["numel"] for name, e in saved["engine"]["groups"].items()},
                                              self.groups, decided=False)
        if problem:
            raise ValueError(problem)
        self.anchor.load(saved["anchor"])
        self.model.load_state_dict(saved["model"])
        self.inner_optimizer.load_state_dict(saved["inner"])
        self.outer_optimizer.load_state_dict(saved["outer"])
        for group in self.groups:
            group.residual = group.output = None
        self._state.states.clear()
        self._engine.restart_at(self._state.restore(saved["engine"], self.groups, _no_regrouping))
        self.position = int(saved["position"])
        self._require_same_configuration()


def _no_regrouping(members: List[List[int]]) -> List[FlatGroup]:
    raise AssertionError("the outer steps' groups never change")


def _require_over(optimizer: torch.optim.Optimizer, params: List[torch.nn.Parameter], named: List[Any]) -> None:
    """Raise ``ValueError`` unless ``optimizer`` steps exactly ``params`` (the model's trainable parameters)."""
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if given != {id(p) for p in params}:
        names = {id(p): name for name, p in named}
        missing = [names[id(p)] for p in params if id(p) not in given]
        raise ValueError(f"outer_optimizer must step exactly the model's trainable parameters: it misses "
                         f"{missing[:5]} and has {len(given - set(names))} others; build it over "
                         "model.parameters() (or leave it None for DiLoCo's Nesterov SGD)")
