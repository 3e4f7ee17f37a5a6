"""A group of variables exchanged as one flat buffer, and its error-feedback residual (TensorFlow).

The counterpart of :mod:`horovod_sparse.torch_core.buffers`. TensorFlow tensors are immutable, so
instead of updating buffers in place the group builds ``x = g + e`` as a new tensor, the
sparsifier returns the new residual and the aggregated update, and the residual is written back
into a non-trainable ``tf.Variable``. That variable is created once per group, outside any
``tf.function`` (``tf.init_scope``), and keeps its place across steps: the residual of a group is
keyed by the group's position in the layout, which is fixed by the variables' order.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from horovod_sparse.tensorflow.collectives import op_name
from horovod_sparse.tensorflow.loss_scale import rescaled


class FlatGroup:
    """Variables whose gradients are selected and exchanged as one flat buffer.

    Args:
        index: position of the group in the layout (same on every rank).
        names: variable names, in flattening order.
        positions: where each member's gradient sits in the gradient list, same order.
        shapes: the members' (static, fully defined) shapes.
        dtype: the members' common dtype.
    """

    #: Where the group's tensors live, for the engine: TensorFlow places them itself.
    device = None

    def __init__(self, index: int, names: List[str], positions: List[int], shapes: List[tf.TensorShape],
                 dtype: tf.DType, kept_dense: bool = False) -> None:
        self.index = index
        self.names = names
        #: Whether the group holds variables kept dense (``dense=``): dense at every step.
        self.kept_dense = kept_dense
        self.positions = positions
        self.shapes = shapes
        self.dtype = dtype
        self.name = names[0] if len(names) == 1 else f"group{index}.{names[0]}"
        self.numels = [int(shape.num_elements()) for shape in shapes]
        self.numel = sum(self.numels)
        self.residual: Optional[tf.Variable] = None
        #: The aggregated update of the step's sparse exchange (:meth:`take_result`).
        self.output: Optional[tf.Tensor] = None

    @property
    def collective_name(self) -> str:
        """The name the group's collectives carry: its :attr:`name` after its index, which keeps
        names distinct after op-name normalisation."""
        return f"{self.index}.{self.name}"

    def _ensure_residual(self) -> tf.Variable:
        if self.residual is None:
            with tf.init_scope():
                self.residual = tf.Variable(tf.zeros([self.numel], dtype=self.dtype), trainable=False,
                                            name=op_name(f"hs_residual_{self.index}"))
        return self.residual

    def flatten(self, grads: Sequence[tf.Tensor]) -> tf.Tensor:
        """The members' gradients (taken from the full list ``grads``) as one flat tensor."""
        parts = [tf.reshape(tf.convert_to_tensor(grads[i]), [-1]) for i in self.positions]
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)

    def load_gradients(self, grads: Sequence[tf.Tensor], loss_scale: Optional[tf.Tensor] = None) -> tf.Tensor:
        """``x = g + e``: the members' flat gradient plus the residual kept from earlier steps.
        With ``loss_scale`` (a float32 scalar) the gradient is first multiplied by its reciprocal,
        as ``LossScaleOptimizer.get_unscaled_gradients`` unscales, so the residual and what the
        method selects stay in the loss's own units."""
        flat = tf.cast(self.flatten(grads), self.dtype)
        return self._ensure_residual() + (flat if loss_scale is None else rescaled(flat, 1.0 / loss_scale))

    def zeroed_output(self) -> None:
        """No buffer: TensorFlow's tensors are immutable, the exchange starts from its
        communicator's zeros (``Communicator.output``)."""
        return None

    def take_result(self, update: tf.Tensor, residual: tf.Tensor) -> None:
        """Keep an exchange's ``(update, residual)``: the residual for the next step, the update as
        :attr:`output`."""
        self.store_residual(residual)
        self.output = update

    def scale_output(self, scale: tf.Tensor) -> None:
        """Multiply :attr:`output` by ``scale`` (a loss scale the gradients were divided by)."""
        assert self.output is not None
        self.output = rescaled(self.output, scale)

    def store_residual(self, residual: tf.Tensor) -> None:
        """Keep ``residual`` for the next step."""
        self._ensure_residual().assign(residual)

    def decay_residual(self, factor: float) -> None:
        """Multiply the residual by ``factor`` (MergeComp's ``residual_decay``)."""
        self.store_residual(self.residual_value() * factor)

    def load_residual(self, saved: np.ndarray) -> None:
        """Restore the residual from a checkpoint (``Backend.saved``'s NumPy form)."""
        self.store_residual(tf.constant(saved, dtype=self.dtype))

    def unflatten(self, flat: tf.Tensor) -> List[tf.Tensor]:
        """Split a flat buffer back into tensors of the members' shapes, in member order."""
        if len(self.numels) == 1:
            return [tf.reshape(flat, self.shapes[0])]
        return [tf.reshape(part, shape) for part, shape in zip(tf.split(flat, self.numels), self.shapes)]

    def residual_value(self) -> tf.Tensor:
        """The residual between steps (zeros before the group's first sparse step)."""
        if self.residual is None:
            return tf.zeros([self.numel], dtype=self.dtype)
        return tf.convert_to_tensor(self.residual)
