"""The TensorFlow side of :mod:`benchmarks.emulated.synthetic` (``--framework tensorflow``): the same
benchmark, options and printed lines, in the shape of Horovod's
``tensorflow2_synthetic_benchmark.py`` (a ``tf.function`` step around
``horovod_sparse.tensorflow.DistributedGradientTape``, every method). The models are the Keras
counterparts of :mod:`benchmarks.shared.models` (same layer shapes; ``resnet50`` is Keras' own).
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Tuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hs
from benchmarks.emulated.synthetic_harness import (DENSE_COMPRESSORS, check_stock, compressor_options, describe,
                                                   measure, topology)
from benchmarks.shared.models import model_spec

layers = tf.keras.layers


def _conv_bn(x: tf.Tensor, filters: int, kernel: int, stride: int = 1) -> tf.Tensor:
    x = layers.Conv2D(filters, kernel, stride, padding="same", use_bias=False)(x)
    return layers.BatchNormalization()(x)


def resnet20(size: int) -> tf.keras.Model:
    """CIFAR ResNet-20 (the layers of :func:`benchmarks.shared.models.resnet20`)."""
    inputs = tf.keras.Input((size, size, 3))
    x = layers.ReLU()(_conv_bn(inputs, 16, 3))
    cin = 16
    for stage, width in enumerate((16, 32, 64)):
        for i in range(3):
            stride = 2 if stage > 0 and i == 0 else 1
            body = _conv_bn(layers.ReLU()(_conv_bn(x, width, 3, stride)), width, 3)
            shortcut = _conv_bn(x, width, 1, stride) if stride != 1 or cin != width else x
            x = layers.ReLU()(layers.Add()([body, shortcut]))
            cin = width
    outputs = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
    return tf.keras.Model(inputs, outputs)


def vgg(size: int) -> tf.keras.Model:
    """The VGG-like communication-heavy net of :func:`benchmarks.shared.models.vgg`."""
    model = tf.keras.Sequential([tf.keras.Input((size, size, 3))])
    for filters in (64, 128, 256, 512):
        model.add(layers.Conv2D(filters, 3, padding="same", use_bias=False))
        model.add(layers.BatchNormalization())
        model.add(layers.ReLU())
        model.add(layers.MaxPooling2D())
    for layer in (layers.Flatten(), layers.Dense(4096, activation="relu"), layers.Dropout(0.5),
                  layers.Dense(4096, activation="relu"), layers.Dropout(0.5), layers.Dense(10)):
        model.add(layer)
    return model


def lstm(steps: int) -> tf.keras.Model:
    """The two-layer LSTM language model of :func:`benchmarks.shared.models.lstm` (logits per step)."""
    return tf.keras.Sequential([tf.keras.Input((steps,), dtype="int64"), layers.Embedding(10000, 650),
                                layers.LSTM(650, return_sequences=True, dropout=0.5),
                                layers.LSTM(650, return_sequences=True), layers.Dense(10000)])


KERAS_MODELS: Dict[str, Callable[[int], tf.keras.Model]] = {
    "resnet20": resnet20,
    "resnet50": lambda size: tf.keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=1000),
    "vgg": vgg,
    "lstm": lstm,
}


def synthetic_batch(name: str, batch_size: int, size: int, seed: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """The torch side's synthetic batch (same generator), channels last for images."""
    import torch

    inputs, targets = model_spec(name).batch(batch_size, size, torch.Generator().manual_seed(seed))
    data = inputs.numpy()
    if data.ndim == 4:
        data = data.transpose(0, 2, 3, 1)
    return tf.constant(data), tf.constant(targets.numpy())


def run(config: argparse.Namespace, log: Callable[[str], None]) -> Dict[str, Any]:
    """One benchmark: Horovod's warm-up and timed iterations; returns the figures (all ranks)."""
    size = config.size or model_spec(config.model).default_size
    tf.keras.utils.set_random_seed(config.seed)
    model = KERAS_MODELS[config.model](size)
    opt = tf.keras.optimizers.SGD(0.01 * hvd.size())
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    data, target = synthetic_batch(config.model, config.batch_size, size, config.seed + hvd.rank())
    name, options = compressor_options(config.compressor, config.density)
    compression = (getattr(hvd.Compression, name) if name in DENSE_COMPRESSORS
                   else hs.Compression.create(name, **options))
    if config.optimizer == "stock":
        check_stock(config, name)
    exchangers: List[Any] = []

    def step(first_batch: bool) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        if config.optimizer == "stock":
            tape = hvd.DistributedGradientTape(tape, compression=compression, groups=config.groups)
        elif config.optimizer == "hs":
            tape = hs.DistributedGradientTape(tape, compression=compression, groups=config.groups,
                                              hierarchical=config.hierarchical)
            exchangers[:] = [tape.exchanger]
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch and config.optimizer != "local":
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)

    benchmark_step = tf.function(step)

    def timed_step() -> Any:
        benchmark_step(False)
        return exchangers[0].last_stats if exchangers else None

    benchmark_step(True)
    kind = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    parameters = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    log(f"Hosts: {hvd.cross_size()} x {hvd.local_size()} workers")
    figures = measure(config, timed_step, hvd.size(), kind, describe(config), parameters, log)
    return {"framework": "tensorflow", "frontend": "horovod", "size": size, "optimizer": config.optimizer,
            "compressor": name, "options": options, "groups": config.groups,
            **topology(config, hvd, exchangers[0].tiers if exchangers else None), **figures}
