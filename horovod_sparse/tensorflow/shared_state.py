"""What every rank of a TensorFlow exchanger shares or must agree on, per variable list: the
configuration, checked across the process set at the list's first exchange; checkpoints (the
step counter, MergeComp's grouping, each group's residual and method state) as NumPy arrays and
Python objects; the agreement on the first rank's shared state; the two tiers' process sets.
Each runs eagerly, also while a ``tf.function`` is traced."""
from __future__ import annotations

import functools
from typing import Any, Dict

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_sparse.common.arguments import op_name
from horovod_sparse.common.horovod_tiers import horovod_tiers
from horovod_sparse.engine.model_state import Record
from horovod_sparse.tensorflow.collectives import allgather_bytes, gather_places
from horovod_sparse.tensorflow.layout import Layout


class SharedState:
    """The shared state of :class:`~horovod_sparse.tensorflow.exchanger.GradientExchanger` (a base
    of it): it reads the exchanger's configuration and layouts (``_layouts``, ``_use_groups``)
    and keeps ``_pending_layouts`` and the tiers (``tiers``, ``_hierarchical``)."""

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's sparsification state, as NumPy arrays and plain Python objects (picklable,
        unaffected by later steps): under ``"layouts"``, per variable list exchanged so far, its
        :meth:`ModelState.record` (step counter, MergeComp's grouping, the method's own state
        such as LAGS's measurements, and per group the residual and the method state with the
        number of workers it was built for). Residuals are per rank: save every rank's state to
        resume exactly. The wrapped optimizer's own state is saved the usual TensorFlow way."""
        return {"layouts": [layout.model.record(layout.groups, layout.steps(), per_rank=True)
                            for layout in self._layouts.values()]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. Each saved variable list is restored into the variable
        list exchanged now, or at its first exchange, whose groups have the same names and sizes
        (so load it in a fresh process before the first step, or after). Saved by a different
        number of workers, the residuals and the step counter are restored and the method state
        built for that number is rebuilt for this one at the next exchange, as on the PyTorch
        side (partition tables, thresholds, gTop-k's schedule; DGC keeps its velocity). A
        variable list whose groups match no saved one, while some are still waiting, raises
        ``ValueError``: at its first exchange, on every rank, even when only some ranks loaded
        a checkpoint."""
        self._pending_layouts = list(state_dict["layouts"])
        for layout in self._layouts.values():
            problem = self._restore(layout)
            if problem:
                raise ValueError(problem)

    def _restore(self, layout: Layout) -> str:
        """Load the waiting checkpointed record that matches ``layout`` (same groups, or for a
        MergeComp layout the grouping of the same variables), if any; what is wrong when none
        matches while some are waiting (empty when all is well)."""
        if not self._pending_layouts:
            return ""
        names = sorted(info.name for info in layout.infos)
        signature = {g.name: g.numel for g in layout.groups}

        def matches(saved: Record) -> bool:
            if layout.mergecomp is not None and saved.get("mergecomp") is not None:
                return sorted(saved["mergecomp"]["order"]) == names
            return {name: entry["numel"] for name, entry in saved["groups"].items()} == signature

        position = next((i for i, saved in enumerate(self._pending_layouts) if matches(saved)), None)
        if position is None:
            return (f"checkpoint does not match the exchanger's groups: groups {signature} "
                    f"(name: elements) are not among the saved ones "
                    f"{[{n: r['numel'] for n, r in s['groups'].items()} for s in self._pending_layouts]}; "
                    "load it with the same model and groups= it was saved with")
        saved = self._pending_layouts.pop(position)
        with tf.init_scope():
            try:
                steps = layout.model.restore(saved, layout.groups, functools.partial(self._use_groups, layout))
            except ValueError as error:
                return str(error)
            layout.step_counter().assign(steps)
        return ""

    def _restore_everywhere(self, layout: Layout) -> None:
        """:meth:`_restore` on every rank, then a ``ValueError`` on every rank if it failed on
        any (with Horovod's idiom only rank 0 loads a checkpoint: the others must not wait for
        it in the next collective). Collective, run eagerly."""
        problem = self._restore(layout)
        problems = allgather_bytes(problem.encode(), "hs.restore",
                                   process_set=self.process_set)
        failed = [f"rank {rank}: {text.decode()}" for rank, text in enumerate(problems) if text]
        if failed:
            raise ValueError(" | ".join(failed))

    # -- agreement --------------------------------------------------------------------------------
    def _agree(self, layout: Layout) -> None:
        """Every rank takes the first rank's step counter and method state shared by all ranks
        (thresholds, partition tables, schedules, LAGS's measurements) for this variable list,
        at its first exchange; residuals and per-rank method state (DGC's velocity) stay each
        rank's own. So Horovod's checkpoint idiom (rank 0 alone restores, then broadcasts the
        variables, e.g. Keras' ``BroadcastGlobalVariablesCallback``) resumes in step on every
        rank: rank 0 with its saved residuals, the others with empty ones. Collective, run
        eagerly."""
        if not self.sparse:
            return
        with tf.init_scope():
            steps = layout.model.agree(0, layout.groups, layout.steps(), functools.partial(self._use_groups, layout))
            layout.step_counter().assign(steps)

    def _split_into_tiers(self, layout: Layout) -> None:
        """With ``hierarchical``, find or add the tiers' process sets (once, eagerly: collective,
        after the configuration check, so every rank asks for them or none does) and run the
        method's state of ``layout`` over this rank's cross set."""
        if not self._hierarchical:
            return
        if self.tiers is None:
            with tf.init_scope():
                self.tiers = horovod_tiers(self._hierarchical_arg, hvd, self.process_set, gather_places)
            self._hierarchical = self.tiers is not None  # a flat layout: nothing to split, ever
        if self.tiers is not None:
            layout.model.use_tiers(self.tiers)
            layout.engine.tiers = self.tiers

    def _require_same_configuration(self, layout: Layout) -> None:
        """Every rank raises the same ``ValueError`` unless all have the same configuration
        (:meth:`ModelState.require_same_configuration`). Sparse collectives are named after
        the groups, so their names count; Horovod's dense path names its ops itself, so only
        sizes and dtypes count there. Collective."""
        layout.model.require_same_configuration(
            {"op": op_name(self.op, hvd), "gradient_predivide_factor": self.gradient_predivide_factor,
             "nonfinite": self.nonfinite, "nonfinite_reported_in": self.reports_in,
             "sparse_as_dense": self.sparse_as_dense,
             "backward_passes_per_step": self.backward_passes_per_step, "hierarchical": self._hierarchical,
             "dense": sorted(layout.kept_dense)},
            [(g.name if self.sparse else str(g.index), g.numel, g.dtype.name, [s.as_list() for s in g.shapes])
             for g in layout.groups])
