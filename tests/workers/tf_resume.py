"""Worker: exact resume of the TensorFlow front end (``tests/tensorflow/test_resume.py``).

A small Keras model trains on per-rank batches through ``DistributedGradientTape`` (``api``
``"tape"``, eager, or ``"tape_function"``, the whole step inside a ``tf.function``) or through the
Keras ``DistributedOptimizer`` with ``train_on_batch`` (``"keras"``, traced). Phases:

* ``"first"``: 2N continuous steps; after step N every rank saves its checkpoint (weights, the
  optimizer's variables, the exchanger's ``state_dict()``) to ``{checkpoints}/{name}.rank{r}.pkl``;
* ``"second"``: a fresh process builds the same trainer, loads its rank's checkpoint and takes
  steps N..2N-1;
* ``"resized"``: the checkpoint of a 2-worker run is loaded by this job's ranks 0 and 1 (rank 2
  has none) and one step is taken; the record has each group's raw gradients, the loaded and the
  new residuals and the update, for the conservation check;
* ``"other_groups"``: rank 0 alone loads a checkpoint saved with other ``groups=`` (Horovod's
  checkpoint idiom); the record has the error each rank raised.

Records (``{index}.rank{r}.json``) hold arrays as ``{"dtype", "shape", "hex"}`` so the test
compares them bitwise, and the exchanger's state as plain containers.
"""
import dataclasses
import json
import pickle
from pathlib import Path

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from tests.support.streams import raw_gradient
from tests.workers.cli import configs_and_out, init_tensorflow_worker

INPUTS, HIDDEN, OUTPUTS, BATCH = 40, 30, 9, 8
SEED = 17


def plain(obj):
    """``obj`` (a state dict, a sparsifier state) as JSON: arrays as dtype, shape and the hex of
    their bytes, dataclasses as dicts, tuples as lists."""
    if isinstance(obj, (np.ndarray, np.generic, tf.Tensor, tf.Variable)):
        array = np.asarray(obj)
        return {"dtype": array.dtype.name, "shape": list(array.shape), "hex": array.tobytes().hex()}
    if dataclasses.is_dataclass(obj):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(key): plain(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(value) for value in obj]
    return obj


def batch(step, rank):
    """Rank ``rank``'s inputs and targets at ``step``."""
    x = raw_gradient(SEED, step, rank, (BATCH, INPUTS), 1).astype(np.float32)
    y = raw_gradient(SEED, step, rank, (BATCH, OUTPUTS), 2).astype(np.float32)
    return x, y


class Trainer:
    """The model (layers named after the config, weights the same on every rank), a Keras SGD with
    momentum and the horovod_sparse wrapper the config's ``api`` names."""

    def __init__(self, config, groups=None):
        name, self.api = config["name"], config["api"]
        self.model = tf.keras.Sequential([tf.keras.Input((INPUTS,)),
                                          tf.keras.layers.Dense(HIDDEN, activation="tanh", name=f"{name}_hidden"),
                                          tf.keras.layers.Dense(OUTPUTS, name=f"{name}_out")])
        rng = np.random.default_rng(SEED)
        for weight in self.model.weights:
            weight.assign(0.3 * rng.standard_normal(weight.shape))
        self.loss = tf.keras.losses.MeanSquaredError()
        compression = hs.Compression.create(config["method"], **config.get("options", {}))
        self.wrapper = {"compression": compression, "groups": groups if groups is not None else config.get("groups")}
        optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
        if self.api == "keras":
            optimizer = hs_keras.DistributedOptimizer(optimizer, **self.wrapper)
            self.model.compile(optimizer=optimizer, loss=self.loss)
            self.exchanger = optimizer.exchanger
        else:
            # Every tape wrapped with these arguments shares one exchanger (and its residuals).
            self.exchanger = hs.DistributedGradientTape(tf.GradientTape(), **self.wrapper).exchanger
        self.optimizer = optimizer
        optimizer.build(self.model.trainable_variables)
        self._tape_step = tf.function(self._tape_step_eager) if self.api == "tape_function" else self._tape_step_eager

    def _tape_step_eager(self, x, y):
        with tf.GradientTape() as tape:
            loss = self.loss(y, self.model(x, training=True))
        tape = hs.DistributedGradientTape(tape, **self.wrapper)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return grads

    def step(self, step):
        """One training step on this rank's batch of ``step``."""
        x, y = batch(step, hvd.rank())
        if self.api == "keras":
            self.model.train_on_batch(x, y)
        else:
            self._tape_step(tf.constant(x), tf.constant(y))

    def raw_and_exchanged(self, step):
        """This rank's own gradients at ``step`` (a plain tape) and the exchanged ones, as the
        eager tape returns them; applies the exchanged ones."""
        x, y = batch(step, hvd.rank())
        with tf.GradientTape() as tape:
            loss = self.loss(y, self.model(x, training=True))
        raw = tape.gradient(loss, self.model.trainable_variables)
        return raw, self._tape_step_eager(tf.constant(x), tf.constant(y))

    def checkpoint(self):
        return {"weights": [w.numpy() for w in self.model.weights],
                "optimizer": [v.numpy() for v in self.optimizer.variables],
                "sparse": self.exchanger.state_dict()}

    def load(self, saved):
        for variable, value in zip(self.model.weights + list(self.optimizer.variables),
                                   saved["weights"] + saved["optimizer"]):
            variable.assign(value)
        self.exchanger.load_state_dict(saved["sparse"])

    def record(self):
        return {"weights": plain([w.numpy() for w in self.model.weights]),
                "optimizer": plain([v.numpy() for v in self.optimizer.variables]),
                "state": plain(self.exchanger.state_dict()), "steps": self.exchanger.steps}


def checkpoint_path(config, rank):
    return Path(config["checkpoints"]) / f"{config['name']}.rank{rank}.pkl"


def phase_first(config):
    trainer, half = Trainer(config), config["half"]
    record = {}
    for step in range(2 * half):
        if step == half:
            saved = trainer.checkpoint()
            checkpoint_path(config, hvd.rank()).write_bytes(pickle.dumps(saved))
            record["saved"] = plain(saved["sparse"])
        trainer.step(step)
    return dict(record, **trainer.record())


def phase_second(config):
    trainer, half = Trainer(config), config["half"]
    trainer.load(pickle.loads(checkpoint_path(config, hvd.rank()).read_bytes()))
    for step in range(half, 2 * half):
        trainer.step(step)
    return trainer.record()


def by_group(exchanger, variables, tensors):
    """``tensors`` (one per variable) flattened per group of ``exchanger``, in group order."""
    position = {v.name: i for i, v in enumerate(variables)}
    return [np.concatenate([np.asarray(tensors[position[name]]).reshape(-1) for name in names])
            for names in exchanger.groups()]


def phase_resized(config):
    trainer, half = Trainer(config), config["half"]
    path = checkpoint_path(config, hvd.rank())
    saved = pickle.loads(path.read_bytes()) if path.exists() else None
    if saved is not None:
        trainer.load(saved)
    raw, exchanged = trainer.raw_and_exchanged(half)
    variables, residuals = trainer.model.trainable_variables, trainer.exchanger.residuals()
    loaded = [np.zeros_like(r.numpy()) if saved is None else saved["sparse"]["layouts"][0]["groups"][name]["residual"]
              for name, r in residuals.items()]
    return dict(trainer.record(), loaded=plain(loaded), raw=plain(by_group(trainer.exchanger, variables, raw)),
                update=plain(by_group(trainer.exchanger, variables, exchanged)),
                residuals=plain(list(residuals.values())))


def phase_other_groups(config):
    trainer = Trainer(config, groups=config["load_groups"])
    if hvd.rank() == 0:
        trainer.load(pickle.loads(checkpoint_path(config, 0).read_bytes()))
    try:
        trainer.step(config["half"])
        return {"error": None}
    except ValueError as err:
        return {"error": str(err)}


def main():
    configs, out = configs_and_out()
    init_tensorflow_worker()
    for index, config in enumerate(configs):
        record = globals()[f"phase_{config['phase']}"](config)
        (out / f"{index}.rank{hvd.rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
