"""The main job's TensorFlow side: the digits MLP trained with Keras ``model.fit`` through
``horovod_sparse.tensorflow.keras.DistributedOptimizer``. Run through
``python -m benchmarks.digits --framework tensorflow`` (same options, same table).

Rows have the keys of the PyTorch side's rows. Methods whose TensorFlow exchange is not traceable
are trained with ``run_eagerly=True`` (the ``mode`` key says which).
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Tuple

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow.keras as hs_keras
from benchmarks.data import digits_split, shard
from horovod_sparse.common.registry import parse_spec
from horovod_sparse.tensorflow import Compression, Sparsifier


def keras_digits_mlp(hidden: int, seed: int) -> tf.keras.Model:
    """The 64-hidden-hidden-10 MLP of the PyTorch side, as a Keras model, initialised from
    ``seed`` (identically on every rank)."""
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.Input(shape=(64,)), tf.keras.layers.Dense(hidden, activation="relu"),
                                tf.keras.layers.Dense(hidden, activation="relu"), tf.keras.layers.Dense(10)])


def local_batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int) -> tf.data.Dataset:
    """This rank's shard, reshuffled every epoch, in full batches, repeated."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    return dataset.batch(batch_size, drop_remainder=True).repeat()


def fit(spec: str, args: argparse.Namespace) -> Tuple[tf.keras.Model, Dict[str, Any]]:
    """Train one model with compressor ``spec`` through ``model.fit``; return the model and this
    rank's figures."""
    name, options = parse_spec(spec)
    compression = Compression.create(name, **options)
    x_train, y_train, x_test, y_test = digits_split(seed=args.seed)
    rank, size = hvd.rank(), hvd.size()
    # Every rank must take the same number of steps: size them on the smallest shard.
    steps_per_epoch = (len(x_train) // size) // args.batch_size
    model = keras_digits_mlp(args.hidden, args.seed)
    optimizer = hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(args.lr * size, momentum=0.9),
                                              compression=compression)
    run_eagerly = isinstance(compression, Sparsifier) and not compression.traceable
    model.compile(optimizer=optimizer, run_eagerly=run_eagerly,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = local_batches(shard(x_train, rank, size), shard(y_train, rank, size), args.batch_size, args.seed + rank)
    start = time.perf_counter()
    history = model.fit(data, epochs=args.epochs, steps_per_epoch=steps_per_epoch, verbose=0,
                        callbacks=[hs_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hs_keras.SparsificationStatsCallback()])
    elapsed = time.perf_counter() - start
    accuracy = float((model.predict(x_test, verbose=0).argmax(1) == y_test).mean())
    samples = args.epochs * steps_per_epoch * args.batch_size * size
    row = {"compressor": spec, "accuracy": accuracy, "samples_per_s": samples / elapsed,
           "bytes_sent_per_step": float(np.mean(history.history["bytes_sent"])),
           "union_density": float(np.mean(history.history["union_density"])),
           "parameters": int(model.count_params()), "workers": size,
           "mode": "eager" if run_eagerly else "tf.function"}
    return model, row


def run(args: argparse.Namespace) -> Tuple[int, int, List[Dict[str, Any]]]:
    """Initialise Horovod for TensorFlow and train every compressor of ``args.compressors``;
    return ``(rank, size, rows)``."""
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rows = [fit(spec, args)[1] for spec in args.compressors]
    return hvd.rank(), hvd.size(), rows
