"""Worker: reliability scenarios of the TensorFlow front end (configuration mismatch across ranks,
dtypes, variables without gradients), the counterpart of ``torch_reliability.py``, with one group
per tensor (the records and the errors name variables).
Each scenario writes a JSON record per rank; the test asserts on them. Scenarios run one after
another in the same launch, so a scenario that hung or left Horovod in a bad state would also
fail every later one.

Each scenario trains its own variables (named after the config, or its ``prefix``), so every
scenario has its own layout, residuals and step counter in the shared exchangers.
"""
import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from tests.support.mismatch import BASE_OPTIONS, wrapper_arguments
from tests.support.streams import raw_gradient
from tests.workers.cli import configs_and_out, init_tensorflow_worker

SHAPES = [[40, 30], [30], [20, 9]]


def make_variables(prefix, dtype="float32", shapes=SHAPES, seed=5):
    rng = np.random.default_rng(seed)
    return [tf.Variable(tf.cast(rng.standard_normal(s), dtype), name=f"{prefix}{i}") for i, s in enumerate(shapes)]


def raw_gradients(variables, step, skip=()):
    """This rank's gradient of every variable at ``step`` (None for the ``skip`` ones)."""
    return [None if i in skip else tf.cast(raw_gradient(5, step, hvd.rank(), v.shape, i), v.dtype)
            for i, v in enumerate(variables)]


def loss_of(variables, grads):
    """A loss whose gradient with respect to each variable is ``grads`` (None: not in the loss)."""
    return tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads) if g is not None])


def compression(config):
    return hs.Compression.create(config.get("method", "topk"), **{**BASE_OPTIONS, **config.get("options", {})})


def as_lists(tensors):
    return [tf.cast(t, tf.float64).numpy().tolist() for t in tensors]


class Trainer:
    """Variables, a Keras SGD with momentum and horovod_sparse's tape or Keras wrapper.

    ``api``: ``"tape"`` (eager), ``"tape_function"`` (the gradient inside a ``tf.function``,
    applied outside it unless the step was abandoned) or ``"keras"`` (eager
    ``compute_gradients`` + ``apply_gradients`` of the Keras wrapper, which skips abandoned
    steps itself).
    """

    def __init__(self, config, dtype="float32", **wrapper_args):
        self.config = config
        self.variables = make_variables(f"{config.get('prefix', config['name'])}_p", dtype,
                                        config.get("shapes", SHAPES))
        self.api = config.get("api", "tape")
        self.wrapper_args = {"groups": "tensor", **wrapper_args, "compression": compression(config)}
        self.optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        if self.api == "keras":
            self.optimizer = hs_keras.DistributedOptimizer(self.optimizer, **self.wrapper_args)
        self.optimizer.build(self.variables)
        self.tape = None
        self._gradient = tf.function(self._tape_gradient) if self.api == "tape_function" else self._tape_gradient

    def _tape_gradient(self, raw):
        with tf.GradientTape() as tape:
            loss = loss_of(self.variables, raw)
        self.tape = hs.DistributedGradientTape(tape, **self.wrapper_args)
        return self.tape.gradient(loss, self.variables)

    def step(self, raw):
        """One training step on the raw gradients ``raw``; returns the exchanged gradients."""
        if self.api == "keras":
            with tf.GradientTape() as tape:
                loss = loss_of(self.variables, raw)
            grads = [g for g, _ in self.optimizer.compute_gradients(loss, self.variables, tape)]
            self.optimizer.apply_gradients(zip(grads, self.variables))
            return grads
        grads = self._gradient(raw)
        if not self.exchanger.last_stats.abandoned:
            self.optimizer.apply_gradients(zip(grads, self.variables))
        return grads

    @property
    def exchanger(self):
        return self.optimizer.exchanger if self.api == "keras" else self.tape.exchanger

    def residuals(self):
        return [r.numpy().astype(np.float64) for r in self.exchanger.residuals().values()]

    def params(self):
        return [v.numpy().astype(np.float64) for v in self.variables]


def scenario_mismatches(config):
    """Each case (``tests/support/mismatch.py``): rank 1's settings differ in one field; every rank must
    raise ValueError at the first exchange. Settings: ``method``, ``options``, ``wrapper``
    arguments of the tape (``op`` by name, ``groups`` with ``{"mergecomp": {...}}``), ``shapes``,
    ``dtype``; the variables are named after the case."""
    results = {}
    for case in config["cases"]:
        settings = {**case["rank0"], **(case["rank1"] if hvd.rank() == 1 else {}), "name": case["name"]}
        trainer = Trainer(settings, settings.get("dtype", "float32"), **wrapper_arguments(settings, hvd))
        try:
            trainer.step(raw_gradients(trainer.variables, 0))
            results[case["name"]] = None
        except ValueError as err:
            results[case["name"]] = str(err)
    return results


def scenario_dtypes(config):
    """Train a few steps with variables of one dtype; report variables and conservation terms."""
    trainer = Trainer(config, config["dtype"])
    delivered = [np.zeros(int(np.prod(s))) for s in SHAPES]
    grads = []
    for step in range(5):
        grads = trainer.step(raw_gradients(trainer.variables, step))
        for total, g in zip(delivered, grads):
            total += tf.cast(g, tf.float64).numpy().reshape(-1)
    return {"params": [p.tolist() for p in trainer.params()], "delivered": [d.tolist() for d in delivered],
            "residuals": [r.tolist() for r in trainer.residuals()], "grad_dtypes": [g.dtype.name for g in grads]}


def scenario_odd_variables(config):
    """An integer, a bool and a zero-size variable are passed through; rank 0 has no gradient
    for variable 1 on even steps and no rank ever has one for ``unused``; an empty variable list
    exchanges nothing: no hang, identical replicas, nothing lost."""
    trainer = Trainer(config)
    counter = tf.Variable([1, 2, 3], name=f"{config['name']}_int")
    flag = tf.Variable([True, False], name=f"{config['name']}_bool")
    empty = tf.Variable(tf.zeros([0]), name=f"{config['name']}_empty")
    unused = tf.Variable(tf.ones([7]), name=f"{config['name']}_unused")
    delivered = [np.zeros(int(np.prod(s))) for s in SHAPES]
    odd, unused_grads = [], []
    for step in range(6):
        skip = (1,) if hvd.rank() == 0 and step % 2 == 0 else ()
        raw = raw_gradients(trainer.variables, step, skip=skip)
        with tf.GradientTape() as tape:
            loss = loss_of(trainer.variables, raw) + tf.reduce_sum(empty)
        tape = hs.DistributedGradientTape(tape, compression=compression(config), groups="tensor")
        grads = tape.gradient(loss, trainer.variables + [counter, flag, empty, unused])
        odd = [None if g is None else g.shape.as_list() for g in grads[len(SHAPES):-1]]
        unused_grads.append(None if grads[-1] is None else float(tf.reduce_max(tf.abs(grads[-1]))))
        trainer.optimizer.apply_gradients(zip(grads[:len(SHAPES)], trainer.variables))
        for total, g in zip(delivered, grads):
            total += g.numpy().astype(np.float64).reshape(-1)
        trainer.tape = tape
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(unused)
    nothing = hs.DistributedGradientTape(tape, compression=compression(config)).gradient(loss, [])
    return {"params": [p.tolist() for p in trainer.params()], "delivered": [d.tolist() for d in delivered],
            "residuals": [r.tolist() for r in trainer.residuals()], "groups": trainer.exchanger.groups(),
            "odd": odd, "unused_grads": unused_grads, "nothing": nothing}


def main():
    configs, out = configs_and_out()
    init_tensorflow_worker()
    for config in configs:
        record = globals()[f"scenario_{config['scenario']}"](config)
        (out / f"{config['name']}.rank{hvd.rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
