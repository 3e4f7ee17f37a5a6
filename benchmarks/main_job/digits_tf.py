"""The main job's TensorFlow side: the digits MLP trained with Keras ``model.fit`` through
``horovod_sparse.tensorflow.keras.DistributedOptimizer``, one rank of the job
``python -m benchmarks.main_job.digits --framework tensorflow`` launches (same options, same table).

Rows have the keys of the PyTorch side's (:meth:`benchmarks.main_job.digits_training.Recorder.row`) and
``mode``: ``tf.function`` when Keras traced the step (its default, every method) or ``eager``
(Keras' ``model.run_eagerly``, as observed after training). Traced steps are not timed phase by
phase, so every TensorFlow row's local work (``stats["seconds"]``) is its step minus the
compute-only step of the same job, one phase ``step_minus_compute`` (an upper bound: it holds the
loopback exchange too); the phases the exchange timed itself (eager ones, and those of a step run
on the host) are kept in ``stats["timed_phases"]``.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Optional, Tuple

import horovod.tensorflow.keras as hvd
import tensorflow as tf

import horovod_sparse.tensorflow.keras as hs_keras
from benchmarks.main_job.digits_training import (LOCAL, Recorder, groups_argument, parse_configuration, process_sets,
                                                 search_summary)
from benchmarks.shared.data import digits_split, shard
from benchmarks.shared.tiers import placement
from horovod_sparse.common.registry import parse_spec
from horovod_sparse.tensorflow import Compression


def keras_digits_mlp(hidden: int, seed: int) -> tf.keras.Model:
    """The 64-hidden-hidden-10 MLP of the PyTorch side, as a Keras model, initialised from
    ``seed`` (identically on every rank)."""
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.Input(shape=(64,)), tf.keras.layers.Dense(hidden, activation="relu"),
                                tf.keras.layers.Dense(hidden, activation="relu"), tf.keras.layers.Dense(10)])


def local_batches(x: Any, y: Any, batch_size: int, seed: int) -> tf.data.Dataset:
    """This rank's shard, reshuffled every epoch, in full batches, repeated."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    return dataset.batch(batch_size, drop_remainder=True).repeat()


class Measure(tf.keras.callbacks.Callback):
    """Feeds every training step of ``model.fit`` (its wall time, the optimizer's ``last_stats``
    and whether MergeComp's search had ended before it, when ``searching``) and every epoch's
    training loss to a :class:`Recorder`."""

    def __init__(self, recorder: Recorder, seed: int, searching: bool) -> None:
        super().__init__()
        self.recorder = recorder
        self.seed = seed
        self.searching = searching
        self.epoch = 0
        self.start = 0.0
        self.settled = not searching

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.searching:
            scheduler = self.model.optimizer.exchanger.mergecomp
            self.settled = scheduler is not None and scheduler.result is not None
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.recorder.step(self.epoch, time.perf_counter() - self.start,
                           getattr(self.model.optimizer, "last_stats", None), self.settled)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.recorder.end_epoch(self.seed, epoch, float((logs or {}).get("loss", float("nan"))))


def fit(label: str, args: argparse.Namespace) -> Tuple[tf.keras.Model, Dict[str, Any]]:
    """Train configuration ``label`` once per seed through ``model.fit``; return the last seed's
    model and the configuration's row."""
    configuration = parse_configuration(label)
    spec, groups = configuration.spec, configuration.groups
    x_train, y_train, x_test, y_test = digits_split(seed=0)
    rank, size = hvd.rank(), hvd.size()
    # Every rank must take the same number of steps: size them on the smallest shard.
    steps_per_epoch = (len(x_train) // size) // args.batch_size
    recorder = Recorder(label, args.epochs, announce=rank == 0)
    for seed in args.seeds:
        model = keras_digits_mlp(args.hidden, seed)
        optimizer = tf.keras.optimizers.SGD(args.lr * size, momentum=0.9)
        if spec != LOCAL:
            name, options = parse_spec(spec)
            compression = Compression.create(name, **options)
            optimizer = hs_keras.DistributedOptimizer(optimizer, compression=compression,
                                                      groups=groups_argument(groups),
                                                      hierarchical=configuration.two_tier)
        model.compile(optimizer=optimizer,
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        data = local_batches(shard(x_train, rank, size), shard(y_train, rank, size), args.batch_size,
                             seed * 1000 + rank)
        model.fit(data, epochs=args.epochs, steps_per_epoch=steps_per_epoch, verbose=0,
                  callbacks=[hs_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                             Measure(recorder, seed, searching=groups == "mergecomp")])
        recorder.end_run(float((model.predict(x_test, verbose=0).argmax(1) == y_test).mean()))
    exchanger = getattr(model.optimizer, "exchanger", None)
    return model, recorder.row(int(model.count_params()), size, mode="eager" if model.run_eagerly else "tf.function",
                               **search_summary(getattr(exchanger, "mergecomp", None)),
                               **placement(hvd, getattr(exchanger, "tiers", None)))


def run(args: argparse.Namespace) -> Tuple[int, List[Dict[str, Any]]]:
    """Initialise Horovod for TensorFlow and train every configuration of ``args.compressors``
    (the compute-only one first); return ``(rank, rows)`` with every row's local work set to its
    step minus the compute-only step."""
    hvd.init(process_sets=process_sets(args.compressors))
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rows = [fit(label, args)[1] for label in args.compressors]
    compute = next(r["step_seconds"] for r in rows if r["compressor"] == LOCAL)
    for row in rows:
        if row["stats"]:
            row["stats"]["timed_phases"] = row["stats"]["seconds"]
            row["stats"]["seconds"] = {"step_minus_compute": max(0.0, row["step_seconds"] - compute)}
    return hvd.rank(), rows
