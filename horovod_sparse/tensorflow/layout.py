"""The variable lists a TensorFlow exchanger has seen: each one's :class:`Layout` (what grouping
knows of its variables, its groups, its step engine and step counter), found again at every step
by the list of variables (their order fixes the groups), in eager mode and across traces; its
groups formed, and formed anew between steps (MergeComp) with the residuals carried over exactly."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_sparse.common.dense_choice import chosen_dense
from horovod_sparse.common.grouping import ParamInfo, ReadyTimeline, form_groups
from horovod_sparse.common.mergecomp import MergeCompOptions
from horovod_sparse.common.mergecomp_scheduler import MergeCompScheduler
from horovod_sparse.common.stats import StepStats, finish_step
from horovod_sparse.engine.model_state import ModelState
from horovod_sparse.engine.step import StepEngine
from horovod_sparse.engine.topology import Transport
from horovod_sparse.tensorflow import backend
from horovod_sparse.tensorflow.buffers import FlatGroup
from horovod_sparse.tensorflow.collectives import Communicator


@dataclass
class Layout:
    """One list of variables (one model): what grouping knows of each (``infos``, ``shapes``,
    ``dtypes``, in list order), its groups, its step engine (with the :class:`ModelState`: method
    state per group, MergeComp, checkpoints), and the number of exchanges this list has gone
    through (the ``step`` the sparsifiers see)."""

    infos: List[ParamInfo]
    shapes: List[tf.TensorShape]
    dtypes: List[tf.DType]
    #: Runs the list's steps (its ``timeline``: when gradients and groups became ready, read by
    #: LAGS and MergeComp).
    engine: StepEngine
    groups: List[FlatGroup] = field(default_factory=list)
    step: Optional[tf.Variable] = None
    #: The names of the variables kept dense (``dense=``).
    kept_dense: FrozenSet[str] = frozenset()
    #: Whether every step runs eagerly on the host, also inside a ``tf.function`` (a method that
    #: decides from the step's values, or groups that change between steps).
    host: bool = False

    @property
    def model(self) -> ModelState:
        """The list's method state per group, MergeComp, checkpoints (the engine's)."""
        return self.engine.model

    @property
    def mergecomp(self) -> Optional[MergeCompScheduler]:
        """The MergeComp scheduler choosing the groups (``groups="mergecomp"``), else None."""
        return self.model.mergecomp

    def step_counter(self) -> tf.Variable:
        """The step counter, created on first use outside any ``tf.function``."""
        if self.step is None:
            with tf.init_scope():
                self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="hs_step")
        return self.step

    def steps(self) -> int:
        """The step counter's value (0 before the first exchange), eagerly."""
        return 0 if self.step is None else int(self.step.numpy())


def _unique_names(names: List[str]) -> List[str]:
    """Names that identify each source (groups and collectives are named after them): a name
    TensorFlow gave to several variables gets the source's position appended, ``name@3``."""
    repeated = {name for name in names if names.count(name) > 1}
    return [f"{name}@{i}" if name in repeated else name for i, name in enumerate(names)]


def _source_name(source: Any, position: int) -> str:
    try:
        return str(source.name)
    except (AttributeError, ValueError):  # eager tensors have no name
        return f"source{position}"


class Layouts:
    """The layouts of :class:`~horovod_sparse.tensorflow.exchanger.GradientExchanger` (a base of
    it) and what the one exchanged last says: it reads the exchanger's configuration
    (``compression``, ``sparse``, ``groups_spec``, ``dense_spec``, ``process_set``, ``op``, ``clock``)
    and keeps ``_layouts``, ``_last_layout`` and ``last_stats``."""

    # -- what the variable list exchanged last says -------------------------------------------------
    @property
    def steps(self) -> int:
        """Exchanges run so far by the variable list exchanged last (on this rank)."""
        return 0 if self._last_layout is None else self._last_layout.steps()

    def _record(self, stats: StepStats) -> None:
        self.last_stats = finish_step(stats, self._stats_log)

    def groups(self) -> List[List[str]]:
        """Variable names of every group of the variable list exchanged last, in group order."""
        layout = self._last_layout
        return [] if layout is None else [list(g.names) for g in layout.groups]

    @property
    def mergecomp(self) -> Optional[MergeCompScheduler]:
        """The MergeComp scheduler of the variable list exchanged last (``groups="mergecomp"``:
        its ``result`` holds the choice once the search decided), else None."""
        return None if self._last_layout is None else self._last_layout.mergecomp

    def residuals(self) -> Dict[str, tf.Tensor]:
        """Each group's residual between steps, flat, keyed by group name (variable list
        exchanged last)."""
        layout = self._last_layout
        return {} if layout is None else {g.name: g.residual_value() for g in layout.groups}

    # -- layouts ----------------------------------------------------------------------------------
    def _layout(self, grads: Sequence[Any], sources: Sequence[Any]) -> Layout:
        """The layout of ``sources``; the first time, after checking that every rank has the same
        configuration and restoring a waiting checkpoint (collective: all ranks exchange the same
        variable lists in the same order)."""
        key = tuple(s.ref() for s in sources)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._new_layout(grads, sources)
            self._require_same_configuration(layout)
            self._split_into_tiers(layout)
            self._restore_everywhere(layout)
            self._agree(layout)
            self._layouts[key] = layout
        self._last_layout = layout
        return layout

    def _new_layout(self, grads: Sequence[Any], sources: Sequence[Any]) -> Layout:
        names = _unique_names([_source_name(s, i) for i, s in enumerate(sources)])
        shapes = [tf.TensorShape(g.shape) for g in grads]
        for name, shape in zip(names, shapes):
            if not shape.is_fully_defined():
                raise ValueError(f"gradient of {name!r} has shape {shape}, which is not fully defined; "
                                 "horovod_sparse needs static shapes to lay out its flat buffers")
        spec = self.groups_spec
        if isinstance(spec, (list, tuple)):
            position = {s.ref(): i for i, s in enumerate(sources)}
            spec = [[position[v.ref()] for v in members if v.ref() in position] for members in spec]
        mergecomp = MergeCompOptions.from_spec(spec) if self.sparse else None
        kept_dense = chosen_dense(self.dense_spec, names, "variable")
        infos = [ParamInfo(name, int(shape.num_elements()), g.dtype.name, g.dtype.size)
                 for name, shape, g in zip(names, shapes, grads)]
        scheduler = None if mergecomp is None else MergeCompScheduler(
            mergecomp, names, [info.numel for info in infos], self.process_set, backend)
        transport = Transport(Communicator, self.process_set, average=self.op == hvd.Average)
        engine = StepEngine(self.compression, ModelState(self.compression, backend, self.process_set, scheduler),
                            transport)
        engine.place_timeline(lambda: ReadyTimeline(self.clock))
        layout = Layout(infos, shapes, [g.dtype for g in grads], engine, kept_dense=kept_dense)
        layout.groups = self._form_groups(layout, "tensor" if mergecomp is not None else spec)
        layout.host = self.sparse and (self.compression.host_exchange or mergecomp is not None)
        return layout

    def _form_groups(self, layout: Layout, spec: Any) -> List[FlatGroup]:
        default = self.compression.default_grouping if self.sparse else "tensor"
        return [FlatGroup(i, [layout.infos[j].name for j in members], list(members),
                          [layout.shapes[j] for j in members], layout.dtypes[members[0]],
                          kept_dense=layout.infos[members[0]].name in layout.kept_dense)
                for i, members in enumerate(form_groups(
                    layout.infos, spec, default,
                    kept=[j for j, info in enumerate(layout.infos) if info.name in layout.kept_dense]))]

    def _use_groups(self, layout: Layout, members: List[List[int]]) -> List[FlatGroup]:
        """Switch ``layout`` to new groups (lists of positions in the variable list) between
        steps, eagerly: residuals carry over exactly, sparsifier states restart. Returns them."""
        pieces: Dict[int, tf.Tensor] = {}
        for group in layout.groups:
            if group.residual is not None:
                pieces.update(zip(group.positions, tf.split(group.residual_value(), group.numels)))
        layout.groups = self._form_groups(layout, members)
        for group in layout.groups:
            if any(p in pieces for p in group.positions):
                group.store_residual(tf.concat([pieces.get(p, tf.zeros([n], group.dtype))
                                                for p, n in zip(group.positions, group.numels)], axis=0))
        layout.model.states.clear()
        return layout.groups
