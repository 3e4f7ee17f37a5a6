"""``horovod_sparse.tensorflow.DistributedGradientTape``: Horovod's tape wrapper, with sparse exchange.

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hs.DistributedGradientTape(tape, compression=hs.Compression.topk(density=0.01))
    grads = tape.gradient(loss, model.trainable_variables)

Same signature and behaviour as ``hvd.DistributedGradientTape`` (local sources,
``scale_local_gradients``, ``use_generic_names``, process sets): Horovod's own ``gradient()`` is
reused, with the gradient reduction replaced by a
:class:`~horovod_sparse.tensorflow.exchanger.GradientExchanger`. With ``Compression.none`` /
``Compression.fp16`` that reduction *is* Horovod's. Residuals live in the exchanger, which is
shared by every tape built with the same arguments, so wrapping a new tape each step keeps them.

Mixed precision with a ``tf.keras.mixed_precision.LossScaleOptimizer`` ``opt`` (Keras' recipe,
with the scaler handed to the tape)::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
        scaled = opt.get_scaled_loss(loss)
    tape = hs.DistributedGradientTape(tape, compression=..., loss_scaler=opt)
    grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
    opt.apply_gradients(zip(grads, model.trainable_variables))   # skips an overflow, backs off

An overflow on any rank gives NaN gradients on every rank, so ``opt`` skips the step and halves
its scale as with ``hvd.DistributedGradientTape``, and the residuals keep unscaled values.
"""
from __future__ import annotations

from typing import IO, Any, Dict, Iterable, Optional

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_sparse.common.arguments import merge_num_groups
from horovod_sparse.common.dense_choice import DenseSpec
from horovod_sparse.common.stats import StepStats
from horovod_sparse.tensorflow.exchanger import GradientExchanger, shared_exchanger

_HorovodTape = hvd._DistributedGradientTape


class _DistributedGradientTape(tf.GradientTape):
    """Mixed into the user's tape class by :func:`DistributedGradientTape` (as Horovod does)."""

    def __init__(self, tape: Any, exchanger: GradientExchanger, persistent: bool, watch_accessed_variables: bool,
                 process_set: hvd.ProcessSet, scale_local_gradients: bool) -> None:
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)  # type: ignore[misc]
        self._tape = tape
        self._allreduce_grads = exchanger
        self.exchanger = exchanger
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources: set = set()

    register_local_source = _HorovodTape.register_local_source
    gradient = _HorovodTape.gradient
    get_local_and_global_gradients = _HorovodTape.get_local_and_global_gradients

    @property
    def last_stats(self) -> Optional[StepStats]:
        """Statistics of the last exchange that ran (on this rank); ``abandoned`` is True when a
        non-finite gradient on some rank abandoned it (skip ``apply_gradients`` then)."""
        return self.exchanger.last_stats

    def state_dict(self) -> Dict[str, Any]:
        """This rank's sparsification state (see :meth:`GradientExchanger.state_dict`)."""
        return self.exchanger.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` into the exchanger shared by every tape wrapped with the
        same arguments, so it can be called on any such tape before the first step."""
        self.exchanger.load_state_dict(state_dict)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: Any = hvd.Compression.none, sparse_as_dense: bool = False,
                            op: Any = hvd.Average, gradient_predivide_factor: float = 1.0,
                            num_groups: int = 0, groups: Any = None,
                            process_set: hvd.ProcessSet = hvd.global_process_set,
                            scale_local_gradients: bool = True,
                            stats_log: Optional[IO[str]] = None,
                            nonfinite: Optional[str] = "default", loss_scaler: Any = None,
                            hierarchical: Optional[bool] = None, dense: DenseSpec = None) -> tf.GradientTape:
    """Wrap ``gradtape`` so ``gradient()`` returns gradients exchanged over Horovod, sparsely when
    ``compression`` sparsifies.

    Takes every argument of ``horovod.tensorflow.DistributedGradientTape`` with the same meaning:

    Args:
        gradtape: the ``tf.GradientTape`` that recorded the loss.
        device_dense: device of the dense collectives.
        device_sparse: device of the ``tf.IndexedSlices`` collectives.
        compression: a horovod_sparse sparsifier (``horovod_sparse.tensorflow.Compression.topk(...)``
            and friends) or Horovod's ``Compression.none`` / ``Compression.fp16``.
        sparse_as_dense: exchange ``tf.IndexedSlices`` gradients as dense tensors (sparsified
            too, with a sparsifier); otherwise their rows are aggregated exactly, as Horovod does.
        op: ``hvd.Average`` or ``hvd.Sum`` (any Horovod op with a dense compression).
        gradient_predivide_factor: splits the averaging before and after the sum (dense only).
        num_groups: deprecated alias of ``groups`` (as in Horovod).
        groups: an int, lists of variables (Horovod's meaning), or, with a sparsifier,
            ``"buckets"`` / ``"buckets:M"`` / ``"tensor"`` / ``"model"`` / ``"size:N"`` or
            ``"mergecomp"`` / a ``MergeCompOptions`` (the MergeComp scheduler chooses from
            measured step times: ``tape.exchanger.mergecomp.result``); ``None`` uses the
            sparsifier's natural grouping (flat buckets of at most 25 MiB, ``"size:8192"`` for
            LAGS, the whole model for MiCRO, ExDyna and gTop-k). Groups are flattened into one
            buffer each.
        process_set: the Horovod process set to reduce over.
        scale_local_gradients: scale the gradients of registered local sources by 1/size.
        stats_log: optional text stream; one JSON line of statistics per exchange.
        nonfinite: what a NaN/Inf gradient on any rank does (sparsifiers only). Whatever the
            policy, the step is abandoned everywhere: nothing is exchanged, residuals stay
            finite and keep each healthy rank's gradient, every gradient returned is NaN on
            every rank (as after Horovod's allreduce of an overflow) and ``last_stats.abandoned``
            is True. Then ``"raise"`` (default with a sparsifier): every rank raises
            ``FloatingPointError`` from ``gradient()``; ``"skip"``: every rank warns (skip
            ``apply_gradients`` then). With a dynamic ``loss_scaler`` neither: the
            LossScaleOptimizer skips the step and backs off its scale, as with Horovod's tape.
            ``None``: no check (the default, and only choice, with Horovod's dense compressors;
            refused with a sparsifier and a ``loss_scaler``, whose overflows would put Inf into
            the residuals for good).
        loss_scaler: the ``tf.keras.mixed_precision.LossScaleOptimizer`` whose
            ``get_scaled_loss`` the differentiated loss comes from (mixed precision). Each
            gradient is divided by its current scale as it enters the residual and the
            aggregate multiplied by it again, so the method selects, and error feedback keeps,
            values in the loss's own units: a scale change loses nothing. A dynamic one (the
            default) takes the ``nonfinite`` policy's place. Without it, a loss scaler still
            sees NaN gradients on an overflow, but ``"raise"`` raises first, and the residuals
            carry each step's scale.
        hierarchical: the two-tier sparse exchange (:mod:`horovod_sparse.common.tiers`): each
            node sums its gradients densely (reduce-scatter), each slice of the node sum is
            exchanged by the method across nodes among the ranks owning it, and the node gathers
            the slices' updates. ``None`` follows Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``
            (``horovodrun --hierarchical-allreduce``). It needs the global process set, as many
            workers on every node and Horovod's process sets for the nodes and slices (added at
            the first exchange when Horovod was started with ``hvd.init(process_sets="dynamic")``,
            else registered at ``hvd.init``). One node, or one worker per node, runs flat.
        dense: variables exchanged dense at every step whatever ``compression`` is (embeddings,
            normalisation layers, biases): variable names (``v.name``, as in the statistics),
            ``fnmatch`` patterns (``"*bias*"``), a list of them, or a predicate on the name
            (:mod:`horovod_sparse.common.dense_choice`). They form groups of their own, marked
            ``kept_dense`` in the statistics. At the first exchange, a name or pattern matching
            none of the variables raises ``ValueError`` naming the closest ones; every rank must
            choose the same variables.

    Returns:
        A tape of the same class as ``gradtape`` (dynamically subclassed, as Horovod does), with
        ``last_stats``, ``state_dict()`` / ``load_state_dict()`` (exact resume) and
        ``exchanger`` (``groups()``, ``residuals()``, ``steps``).

    Raises:
        ValueError: at the first exchange of a variable list, on every rank, when the ranks'
            configurations (compression, options, op, groups, dtypes, whether a dynamic
            ``loss_scaler`` was given) differ, naming the rank and setting.
        ValueError: ``nonfinite=None`` with a sparsifier and a ``loss_scaler``.
        TypeError: ``loss_scaler`` is not a LossScaleOptimizer.
    """
    groups = merge_num_groups(num_groups, groups)
    if isinstance(groups, (int, float)) and not groups > 0:  # other types: form_groups names the forms taken
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    exchanger = shared_exchanger("DistributedGradientTape", compression, sparse_as_dense, op,
                                 gradient_predivide_factor, groups, process_set, device_dense, device_sparse,
                                 stats_log, nonfinite, loss_scaler, hierarchical, dense)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,), dict(_DistributedGradientTape.__dict__))
    return cls(gradtape._tape, exchanger, gradtape._persistent, gradtape._watch_accessed_variables,
               process_set, scale_local_gradients)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: Any = hvd.Compression.none, sparse_as_dense: bool = False,
                                   op: Any = hvd.Average, gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: hvd.ProcessSet = hvd.global_process_set,
                                   local_layers: Optional[Iterable[tf.keras.layers.Layer]] = None,
                                   scale_local_gradients: bool = True,
                                   stats_log: Optional[IO[str]] = None,
                                   nonfinite: Optional[str] = "default", loss_scaler: Any = None,
                                   hierarchical: Optional[bool] = None, dense: DenseSpec = None) -> tf.GradientTape:
    """:func:`DistributedGradientTape` whose ``local_layers`` keep their gradients local (not
    exchanged), as ``hvd.PartialDistributedGradientTape``."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients, stats_log, nonfinite, loss_scaler, hierarchical, dense)
    for layer in local_layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape


__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]
