"""LAGS-SGD: layer-wise Top-k per group of merged layers, each group with the density the LAGS
rule gives it from the backward time left after it, the network and the local costs measured on
the running job (:func:`horovod_sparse.methods.lags.rule.lags_counts`).

The measurements run at the end of every step (:meth:`Lags.on_step_end`), which every front end
calls. PyTorch's optimizer launches each group from the backward hooks, so a group's
communication can hide under the backward computation still to run. TensorFlow's tape (and so
Keras) returns every gradient at once, after the whole backward pass: every group's measured
``t_comp`` is 0, and the rule can only spend its ``slack`` of the step on extra density. With
``adaptive`` the counts are decided on the host at step time, so inside a ``tf.function`` the
step runs on the host (``host_exchange``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from horovod_sparse.common.cost_model import AlphaBeta, LocalCost
from horovod_sparse.common.grouping import MergeBySize, StepTimeline
from horovod_sparse.methods.comm import Comm
from horovod_sparse.methods.lags.rule import BackwardTimeMeter, LagsGroup, LagsOptions, lags_counts
from horovod_sparse.common.measurements import agree_seconds, measure_cost_model, measure_local_cost
from horovod_sparse.common.options import target_count
from horovod_sparse.common.registry import implements
from horovod_sparse.methods.backend import Backend, Tensor
from horovod_sparse.methods.base import Exchange, Sparsifier, Step

#: Elements of the buffer the local costs are timed on (at most; the largest group's otherwise).
LOCAL_COST_NUMEL = 1 << 22

@implements("lags", LagsOptions,
            "layer-wise top-k per merged layer group, sent from the hooks at a density fitted to the overlap")
class Lags(Sparsifier):
    """Top-k with error feedback per layer group, at a per-group density ``rho_l``.

    With ``groups=None`` adjacent parameters are merged into groups of at least ``group_size``
    elements. Each group is exchanged from the backward hooks as soon as it is complete. With
    ``adaptive=True`` (the default):

    * at the end of the first step with a sparse group, alpha and beta are fitted to allgathers
      timed on the optimizer's process set, on the gradients' device through the collectives
      the exchange uses (:attr:`cost_model`, :attr:`calibration`), and the local costs of
      selection and scatter-add are timed on each rank on that device, from an idle device to
      the work's end, and agreed (:attr:`local_cost`, timed with the backend's own primitives,
      :mod:`horovod_sparse.common.measurements`);
    * over the next ``measure_steps`` steps each group's remaining backward time ``t_comp`` is
      measured from the hooks and averaged over ranks (:attr:`t_comp`), with every group at the
      global density;
    * from then on each group sends the count :func:`horovod_sparse.methods.lags.rule.lags_counts`
      gives it, at least the global ``density``'s: the groups queue on one link in launch
      order, and extra density is paid for in selection and scatter-add time, within
      ``slack`` of the step.

    Until then, and with ``adaptive=False`` (the reference's default), every group uses
    ``density``. ``t_comp`` includes the compression work the hooks of later groups do on the
    same thread, which is what is really left to overlap on a CPU. Every step's
    ``GroupStats.extra`` reports ``alpha``, ``beta``, ``local_cost``, ``t_comp`` and ``rho``
    (the global density, or the rule's count over the group's size).
    """

    options: LagsOptions

    def __init__(self, options: LagsOptions, backend: Backend) -> None:
        super().__init__(options, backend)
        #: The alpha-beta model, measured after the first step with a sparse group (None before).
        self.cost_model: Optional[AlphaBeta] = None
        #: The agreed ``(bytes_per_rank, seconds)`` allgather timings the model was fitted to.
        self.calibration: List[Tuple[int, float]] = []
        #: The local costs of selection and scatter-add (None before the first step ends).
        self.local_cost: Optional[LocalCost] = None
        #: Group name -> agreed remaining backward time in seconds (empty until measured).
        self.t_comp: Dict[str, float] = {}
        #: The measured groups in launch order, with their sizes (empty until measured).
        self.launch_order: List[Tuple[str, int]] = []
        self._meter = BackwardTimeMeter(options.measure_steps)
        self._numel: Dict[str, int] = {}
        self._counts: Dict[Tuple[float, int], Dict[str, int]] = {}
        #: A gradient buffer of the job: the measurements run on its device.
        self._like: Optional[Tensor] = None

    @property  # type: ignore[override]
    def host_exchange(self) -> bool:
        """With ``adaptive`` each step's counts come from measurements taken on the host."""
        return self.options.adaptive

    @property  # type: ignore[override]
    def default_grouping(self) -> MergeBySize:
        """Adjacent parameters merged up to ``group_size`` elements."""
        return MergeBySize(self.options.group_size)

    def on_step_end(self, process_set: Any, record: StepTimeline) -> None:
        """Calibrate the cost models after the first step with a sparse group, on its device,
        then measure ``t_comp`` (with the backend's measurements)."""
        if not self.options.adaptive:
            return
        if self.cost_model is None and self._like is not None:  # after the first step with a sparse group
            self.cost_model, self.calibration = measure_cost_model(self.B, process_set, like=self._like)
        if self.local_cost is None and self._numel:  # after the first step with a sparse group
            numel = max(2, min(LOCAL_COST_NUMEL, max(self._numel.values())))
            floor, cap = self.options.density, max(self.options.density, self.options.max_density)
            low, high = target_count(floor, numel), target_count(cap, numel)
            # With no room above the floor (density 1) the rule has nothing to choose: no cost.
            self.local_cost = (measure_local_cost(self.B, process_set, numel, low, high, like=self._like) if high > low
                               else LocalCost(0.0, 0.0, 0.0))
        if self._meter.add(record) and record.group_ready:
            means = self._meter.means()
            names = sorted(means)
            agreed = agree_seconds(self.B, [means[n] for n in names], process_set, "hs.lags.t_comp")
            self.t_comp = dict(zip(names, agreed))
            self.launch_order = [(name, self._numel[name]) for name in record.launch_order if name in self._numel]
            self._counts = {}

    def method_state(self, per_rank: bool) -> Dict[str, Any]:
        """The cost model, its calibration, the local costs, the agreed ``t_comp``, the measured
        launch order and the measurement's progress (every rank holds them alike), with
        ``per_rank`` also this rank's partial sums of backward time (see
        :meth:`BackwardTimeMeter.state`)."""
        local = self.local_cost
        return {"cost_model": None if self.cost_model is None else dataclasses.asdict(self.cost_model),
                "calibration": [list(sample) for sample in self.calibration],
                "local_cost": None if local is None else dataclasses.asdict(local), "t_comp": dict(self.t_comp),
                "launch_order": [list(g) for g in self.launch_order],
                "meter": self._meter.state(per_rank)}

    def load_method_state(self, state: Dict[str, Any]) -> None:
        model, local = state["cost_model"], state["local_cost"]
        self.cost_model = None if model is None else AlphaBeta(**model)
        self.calibration = [(int(nbytes), float(seconds)) for nbytes, seconds in state["calibration"]]
        self.local_cost = None if local is None else LocalCost(**local)
        self.t_comp = dict(state["t_comp"])
        self.launch_order = [(str(name), int(numel)) for name, numel in state["launch_order"]]
        self._meter.load_state(state["meter"])
        self._counts = {}

    def group_count(self, group: str, numel: int, step: Step, workers: int) -> Any:
        """The coordinates group ``group`` of ``numel`` elements sends at ``step`` among
        ``workers`` ranks (the cost model's network, alpha and beta, applies to any worker count:
        a model measured or loaded for another count is used with ``workers``)."""
        if not isinstance(step, int):  # traced: no measurements here (see the class docstring)
            return self.count(numel, step)
        floor = self.options.density_at(step)
        key = (floor, workers)
        if key not in self._counts:
            self._counts[key] = {}
            if self.cost_model is not None and self.local_cost is not None:
                groups = [LagsGroup(name, size, self.t_comp[name]) for name, size in self.launch_order]
                counts = lags_counts(groups, self.cost_model.with_workers(workers), self.local_cost, floor,
                                     self.options.max_density, self.options.slack)
                self._counts[key] = {g.name: count for g, count in zip(groups, counts)}
        return self._counts[key].get(group, target_count(floor, numel))

    def exchange(self, x: Tensor, comm: Comm, state: Any, step: Step) -> Exchange:
        numel, group = self.B.numel(x), comm.stats.name  # the group's name, as the timeline has it
        self._numel[group] = numel
        self._like = x
        k = self.group_count(group, numel, step, comm.size)
        comm.stats.target = k
        model, floor = self.cost_model, self.density(step)
        rho = floor if not isinstance(k, int) or k == target_count(floor, numel) else k / numel
        local = self.local_cost
        comm.stats.extra.update({"rho": rho, "t_comp": self.t_comp.get(group),
                                 "alpha": None if model is None else model.alpha,
                                 "beta": None if model is None else model.beta,
                                 "local_cost": None if local is None else dataclasses.asdict(local)})
        with comm.timer("select"):
            idx = self.B.top_k(x, k, ascending=False)  # the exchange needs no order
        return (yield from self.allgather_exchange(x, idx, comm, fixed_count=k))
