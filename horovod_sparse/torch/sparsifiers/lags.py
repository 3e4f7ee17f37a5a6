"""LAGS-SGD: layer-wise Top-k per group of merged layers, each group with the density whose
allgather fits under the backward computation still left when it becomes ready."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import horovod.torch as hvd
import torch

from horovod_sparse.common.cost_model import AlphaBeta
from horovod_sparse.common.grouping import MergeBySize, StepTimeline
from horovod_sparse.common.lags import BackwardTimeMeter, LagsOptions, lags_density
from horovod_sparse.common.options import target_count
from horovod_sparse.common.registry import implements
from horovod_sparse.torch.collectives import Communicator
from horovod_sparse.torch.mergecomp import agree_seconds, measure_cost_model
from horovod_sparse.torch.selection import top_k
from horovod_sparse.torch.sparsifier import Exchange, Sparsifier


@implements("torch", "lags")
class Lags(Sparsifier):
    """Top-k with error feedback per layer group, at a per-group density ``rho_l``.

    With ``groups=None`` adjacent parameters are merged into groups of at least ``group_size``
    elements. Each group is exchanged from the backward hooks as soon as it is complete. With
    ``adaptive=True`` (the default):

    * at the end of the first step, alpha and beta are fitted to allgathers timed on the
      optimizer's process set (:attr:`cost_model`, :attr:`calibration`);
    * over the next ``measure_steps`` steps each group's remaining backward time ``t_comp`` is
      measured from the hooks and averaged over ranks (:attr:`t_comp`);
    * from then on group ``l`` sends ``rho_l = lags_density(t_comp_l, ...)``, at least the
      global ``density`` (:func:`horovod_sparse.common.lags.lags_density`).

    Until then, and with ``adaptive=False`` (the reference's default), every group uses
    ``density``. ``t_comp`` includes the compression work the hooks of later groups do on the
    same thread, which is what is really left to overlap on a CPU. Every step's
    ``GroupStats.extra`` reports ``alpha``, ``beta``, ``t_comp`` and ``rho``.
    """

    options: LagsOptions

    def __init__(self, options: LagsOptions) -> None:
        super().__init__(options)
        #: The alpha-beta model measured at start-up (None before the first step ends).
        self.cost_model: Optional[AlphaBeta] = None
        #: The agreed ``(bytes_per_rank, seconds)`` allgather timings the model was fitted to.
        self.calibration: List[Tuple[int, float]] = []
        #: Group name -> agreed remaining backward time in seconds (empty until measured).
        self.t_comp: Dict[str, float] = {}
        self._meter = BackwardTimeMeter(options.measure_steps)

    @property  # type: ignore[override]
    def default_grouping(self) -> MergeBySize:
        """Adjacent parameters merged up to ``group_size`` elements."""
        return MergeBySize(self.options.group_size)

    def on_step_end(self, process_set: hvd.ProcessSet, record: StepTimeline) -> None:
        """Calibrate the cost model after the first step, then measure ``t_comp``."""
        if not self.options.adaptive:
            return
        if self.cost_model is None:
            self.cost_model, self.calibration = measure_cost_model(process_set)
        if self._meter.add(record) and record.group_ready:
            means = self._meter.means()
            names = sorted(means)
            agreed = agree_seconds([means[n] for n in names], process_set, "hs.lags.t_comp")
            self.t_comp = dict(zip(names, agreed))

    def method_state(self, per_rank: bool) -> Dict[str, Any]:
        """The cost model, its calibration, the agreed ``t_comp`` and the measurement's progress
        (every rank holds them alike), with ``per_rank`` also this rank's partial sums of
        backward time (see :meth:`BackwardTimeMeter.state`)."""
        return {"cost_model": None if self.cost_model is None else dataclasses.asdict(self.cost_model),
                "calibration": [list(sample) for sample in self.calibration], "t_comp": dict(self.t_comp),
                "meter": self._meter.state(per_rank)}

    def load_method_state(self, state: Dict[str, Any]) -> None:
        model = state["cost_model"]
        self.cost_model = None if model is None else AlphaBeta(**model)
        self.calibration = [(int(nbytes), float(seconds)) for nbytes, seconds in state["calibration"]]
        self.t_comp = dict(state["t_comp"])
        self._meter.load_state(state["meter"])

    def density(self, group: str, numel: int, step: int, workers: int) -> float:
        """The density group ``group`` of ``numel`` elements sends at ``step`` among ``workers``
        ranks (the cost model's network, alpha and beta, applies to any worker count: a model
        measured or loaded for another count is used with ``workers``)."""
        floor = self.options.density_at(step)
        t_comp = self.t_comp.get(group)
        if self.cost_model is None or t_comp is None:
            return floor
        return lags_density(t_comp, self.cost_model.with_workers(workers), numel, floor, self.options.max_density)

    def exchange(self, x: torch.Tensor, out: torch.Tensor, comm: Communicator, state: Any,
                 step: int) -> Exchange:
        rho = self.density(comm.name, x.numel(), step, comm.size)
        k = target_count(rho, x.numel())
        comm.stats.target = k
        model = self.cost_model
        comm.stats.extra.update({"rho": rho, "t_comp": self.t_comp.get(comm.name),
                                 "alpha": None if model is None else model.alpha,
                                 "beta": None if model is None else model.beta})
        with comm.timer("select"):
            idx = top_k(x, k)
        yield from self.allgather_exchange(x, idx, out, comm, fixed_count=k)
