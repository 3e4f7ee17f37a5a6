"""Worker: the TensorFlow front end where Horovod users rely on Horovod's own behaviour.

Scenarios (one JSON record per rank each, the test asserts on them):

* ``tape_checkpoint``: Horovod's checkpoint idiom with the tape. N steps; rank 0 alone saves
  the variables and ``tape.state_dict()``; fresh variables (different on every rank); rank 0
  alone restores; ``hvd.broadcast_variables``; M more steps (eager, or in a ``tf.function``).
  Expected: the original run's continuation with every rank but 0 emptied of its per-rank state
  at step N (residuals, DGC's velocity).
* ``keras_checkpoint``: the same through Keras ``model.fit`` (traced unless the method is
  eager-only) with ``BroadcastGlobalVariablesCallback(0)`` after rank 0 alone restored.
* ``graph_checkpoint``: the TF1 idiom, ``hvd.DistributedOptimizer`` of a
  ``tf.compat.v1.train`` optimizer in a graph and session (Horovod's own wrapper, dense), rank 0
  alone restores every global variable, ``hvd.broadcast_global_variables(0)``.
* ``indexed_slices``: an embedding's ``tf.IndexedSlices`` gradient, ours against the stock tape.
* ``graph_mode``: ``PartialDistributedGradientTape`` in a TF1-style graph and session.
* ``own_collectives``: a Keras model making Horovod collectives of its own in both passes
  (Horovod's ``SyncBatchNormalization`` and an allreduce in a layer's ``call``), trained through
  the tape with ``Compression.none``, and with the method at density 1 and 0.1.
* ``kept_dense``: the tape with ``dense`` keeping the biases dense beside a sparsifier: per
  step, which gradients are the ranks' average (Horovod's allreduce of their own gradients), the
  groups and their statistics, and the errors of a misspelt name and of ranks choosing
  differently.

``"swap": true`` runs a scenario as a codebase migrated by a global swap at start-up
(:func:`swapped`): Horovod's names are rebound to ours and the scenario calls them by Horovod's
names (``hvd.DistributedGradientTape``, ``hvd_keras.DistributedOptimizer``,
``hvd.DistributedOptimizer``), and the Keras rank 0 restores with ``hvd_keras.load_model``.
"""
import contextlib
import io
import json
import os
import pickle
import tempfile

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from tests.support.streams import raw_gradient
from tests.workers.cli import configs_and_out, init_tensorflow_worker

SHAPES = [[12, 64], [64], [64, 6], [6]]
#: The global swap of a codebase moved to horovod_sparse: (module, name, ours).
SWAPS = [(hvd, "DistributedGradientTape", hs.DistributedGradientTape),
         (hvd, "DistributedOptimizer", hs.DistributedOptimizer),
         (hvd_keras, "DistributedOptimizer", hs_keras.DistributedOptimizer)]


def compression(config):
    if config["method"] == "none":
        return hvd.Compression.none
    return hs.Compression.create(config["method"], **config.get("options", {}))


@contextlib.contextmanager
def swapped(config):
    """Horovod's wrappers rebound to ours while the scenario runs when ``config["swap"]``, as a
    codebase does once at start-up (``hvd.DistributedGradientTape = hs.DistributedGradientTape``);
    Horovod's are back afterwards, for the next config of the launch."""
    originals = [(module, name, getattr(module, name)) for module, name, _ in SWAPS]
    if config.get("swap"):
        for module, name, ours in SWAPS:
            setattr(module, name, ours)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def wrap_tape(config, tape, **options):
    """Our tape: by Horovod's name after the swap, as the migrated code calls it."""
    wrapper = hvd.DistributedGradientTape if config.get("swap") else hs.DistributedGradientTape
    return wrapper(tape, compression=compression(config), **options)


def make_variables(prefix, seed):
    rng = np.random.default_rng(seed)
    return [tf.Variable(rng.standard_normal(s).astype(np.float32), name=f"{prefix}{i}") for i, s in enumerate(SHAPES)]


def flat(variables):
    return np.concatenate([v.numpy().reshape(-1) for v in variables]).astype(np.float64).tolist()


def tape_trainer(config, variables, log):
    """``train(index)``: one SGD step of ``variables`` on this rank's gradient stream at step
    ``index``, through our tape (its exchanger is the one of ``log``: a new ``log``, a new
    exchanger, as in a fresh process); traced (a ``tf.function``) when the config says so."""
    optimizer = tf.keras.optimizers.SGD(0.05)

    def step(grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v * g) for v, g in zip(variables, grads)])
        tape = wrap_tape(config, tape, stats_log=log)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    run = tf.function(step) if config.get("traced") else step

    def train(index):
        run([tf.constant(raw_gradient(5, index, hvd.rank(), v.shape, i), tf.float32) for i, v in enumerate(variables)])

    return train


def exchanger_of(config, log):
    return wrap_tape(config, tf.GradientTape(), stats_log=log).exchanger


def scenario_tape_checkpoint(config):
    steps, more = config["steps"], config["more"]
    prefix = f"t{config['index']}_"
    variables = make_variables(prefix, 0)
    log, fresh_log = io.StringIO(), io.StringIO()
    train = tape_trainer(config, variables, log)
    for index in range(steps):
        train(index)
    blob = None
    if hvd.rank() == 0:
        blob = pickle.dumps({"variables": [v.numpy() for v in variables],
                             "sparse": exchanger_of(config, log).state_dict()})

    fresh = make_variables(prefix, 1 + hvd.rank())  # every rank starts elsewhere: the broadcast must matter
    fresh_exchanger = exchanger_of(config, fresh_log)
    if hvd.rank() == 0:
        saved = pickle.loads(blob)
        for v, value in zip(fresh, saved["variables"]):
            v.assign(value)
        fresh_exchanger.load_state_dict(saved["sparse"])
    hvd.broadcast_variables(fresh, root_rank=0)
    resume = tape_trainer(config, fresh, fresh_log)
    resumed = []
    for index in range(steps, steps + more):
        resume(index)
        resumed.append(flat(fresh))
    record = {"resumed": resumed, "steps": fresh_exchanger.steps,
              "residual_norms": [float(tf.norm(tf.cast(r, tf.float64))) for r in fresh_exchanger.residuals().values()]}
    if config.get("swap"):  # Horovod's PartialDistributedGradientTape calls DistributedGradientTape by name
        partial = hvd.PartialDistributedGradientTape(tf.GradientTape(), compression=compression(config))
        record["partial_is_ours"] = hasattr(partial, "exchanger")

    exchanger = exchanger_of(config, log)
    if hvd.rank() != 0:  # what a rank-0 checkpoint cannot hold for another rank
        layout = exchanger._layouts[tuple(v.ref() for v in variables)]
        for group in layout.groups:
            group.store_residual(tf.zeros([group.numel], group.dtype))
        if exchanger.compression.per_rank_state:
            layout.model.states.clear()
    expected = []
    for index in range(steps, steps + more):
        train(index)
        expected.append(flat(variables))
    record["expected"] = expected
    return record


class GraphTrainer:
    """A TF1 graph and session training ``make_variables(prefix, seed)`` with
    ``hvd.DistributedOptimizer`` of a momentum ``tf.compat.v1.train`` optimizer on this rank's
    gradient stream, with a global step."""

    def __init__(self, config, prefix, seed):
        graph = tf.Graph()
        with graph.as_default():
            self.variables = make_variables(prefix, seed)
            self.step = tf.compat.v1.train.get_or_create_global_step()
            self.grads = [tf.compat.v1.placeholder(tf.float32, shape) for shape in SHAPES]
            loss = tf.add_n([tf.reduce_sum(v * v * g) for v, g in zip(self.variables, self.grads)])
            optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.05, 0.9),
                                                 compression=compression(config))
            self.train_op = optimizer.minimize(loss, global_step=self.step, var_list=self.variables)
            self.everything = tf.compat.v1.global_variables()  # momentum slots and global step included
            self.broadcast_op = hvd.broadcast_global_variables(0)
            self.session = tf.compat.v1.Session(graph=graph)
            self.session.run(tf.compat.v1.global_variables_initializer())

    def train(self, index):
        self.session.run(self.train_op, {g: raw_gradient(5, index, hvd.rank(), shape, i)
                                         for i, (g, shape) in enumerate(zip(self.grads, SHAPES))})

    def flat(self):
        return np.concatenate([v.reshape(-1) for v in self.session.run(self.variables)]).astype(np.float64).tolist()

    def checkpoint(self):
        return self.session.run(self.everything)

    def restore(self, values):
        with self.session.graph.as_default():
            for variable, value in zip(self.everything, values):
                variable.load(value, self.session)


def scenario_graph_checkpoint(config):
    """Horovod's TF1 idiom: N steps; rank 0 alone restores every global variable into a fresh
    graph (different on every rank), ``hvd.broadcast_global_variables(0)``, M more steps.
    Dense (Horovod's own wrapper): the original run's continuation on every rank."""
    steps, more = config["steps"], config["more"]
    prefix = f"g{config['index']}_"
    original = GraphTrainer(config, prefix, 0)
    for index in range(steps):
        original.train(index)
    fresh = GraphTrainer(config, prefix, 1 + hvd.rank())
    if hvd.rank() == 0:
        fresh.restore(original.checkpoint())
    fresh.session.run(fresh.broadcast_op)
    resumed, expected = [], []
    for index in range(steps, steps + more):
        fresh.train(index)
        original.train(index)
        resumed.append(fresh.flat())
        expected.append(original.flat())
    return {"resumed": resumed, "expected": expected, "steps": int(fresh.session.run(fresh.step))}


def digits_model(seed):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.layers.Dense(32, activation="tanh", input_shape=(12,)),
                                tf.keras.layers.Dense(6)])


def keras_fit(model, config, optimizer, steps, first):
    rng = np.random.default_rng([first, hvd.rank()])
    x, y = rng.standard_normal((8 * steps, 12)), rng.standard_normal((8 * steps, 6))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])


def keras_model(config, seed):
    tf.keras.backend.clear_session()  # layer names as in a fresh process: the checkpoint matches by them
    model = digits_model(seed)
    wrapper = hvd_keras.DistributedOptimizer if config.get("swap") else hs_keras.DistributedOptimizer
    optimizer = wrapper(tf.keras.optimizers.SGD(0.05), compression=compression(config))
    model.compile(optimizer=optimizer, loss="mse")
    return model, optimizer


def load_through_horovod(model, config):
    """``model`` saved to a file and loaded back by Horovod's ``hvd_keras.load_model``, which
    wraps the optimizer through the module's ``DistributedOptimizer`` (ours after the swap)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "checkpoint.h5")
        model.save(path)
        tf.keras.backend.clear_session()  # layer names as in a fresh process: the broadcast matches by them
        return hvd_keras.load_model(path, compression=compression(config))


def scenario_keras_checkpoint(config):
    """Rank 0 alone restores weights and iterations (after the swap: through Horovod's
    ``load_model``, as Horovod's Keras examples resume) and the exchanger's state."""
    steps, more = config["steps"], config["more"]
    model, optimizer = keras_model(config, 0)
    keras_fit(model, config, optimizer, steps, 0)
    if hvd.rank() == 0:
        saved = pickle.loads(pickle.dumps({"weights": model.get_weights(), "sparse": optimizer.exchanger.state_dict(),
                                           "iterations": int(optimizer.iterations.numpy())}))
    if hvd.rank() == 0 and config.get("swap"):
        fresh = load_through_horovod(model, config)
        fresh_optimizer = fresh.optimizer
    else:
        fresh, fresh_optimizer = keras_model(config, 1 + hvd.rank())
        if hvd.rank() == 0:
            fresh.set_weights(saved["weights"])
            fresh_optimizer.iterations.assign(saved["iterations"])
    if hvd.rank() == 0:
        fresh_optimizer.exchanger.load_state_dict(saved["sparse"])
    keras_fit(fresh, config, fresh_optimizer, more, steps)
    return {"weights": np.concatenate([w.reshape(-1) for w in fresh.get_weights()]).astype(np.float64).tolist(),
            "steps": fresh_optimizer.exchanger.steps, "iterations": int(fresh_optimizer.iterations.numpy()),
            "residual_norms": [float(tf.norm(tf.cast(r, tf.float64)))
                               for r in fresh_optimizer.exchanger.residuals().values()]}


def keras_behaviours(kind, config):
    """Horovod's Keras tests' behaviours through one wrapper (``kind``: stock or ours)."""
    def wrap(optimizer, **options):
        if kind == "stock":
            return hvd_keras.DistributedOptimizer(optimizer, **options)
        return hs_keras.DistributedOptimizer(optimizer, compression=compression(config),
                                             nonfinite=config.get("nonfinite", "default"), **options)

    tf.keras.backend.clear_session()
    tf.keras.utils.set_random_seed(7)
    record = {}
    # model.fit with Horovod's learning-rate callbacks, two backward passes per step, and an
    # embedding exchanged as dense (sparse_as_dense).
    model = tf.keras.Sequential([tf.keras.layers.Embedding(20, 4, input_length=3), tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(2)])
    optimizer = wrap(tf.keras.optimizers.Adam(0.01), backward_passes_per_step=2, sparse_as_dense=True)
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng([3, hvd.rank()])
    x, y = rng.integers(0, 20, (32, 3)), rng.standard_normal((32, 2))
    rates = []
    callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd_keras.callbacks.LearningRateWarmupCallback(initial_lr=0.02, warmup_epochs=2, steps_per_epoch=4),
                 hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=0.02, multiplier=0.5, start_epoch=2),
                 tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: rates.append(
                     float(tf.keras.backend.get_value(model.optimizer.learning_rate))))]
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, shuffle=False, callbacks=callbacks)
    record["weights"] = np.concatenate([w.reshape(-1) for w in model.get_weights()]).astype(np.float64).tolist()
    record["rates"] = rates
    # get_config / from_config round trip.
    config_of = optimizer.get_config()
    record["from_config"] = (optimizer.from_config(config_of).get_config() == config_of
                             and type(optimizer).from_config(config_of).get_config() == config_of)
    # Gradient aggregation with an Inf gradient in the first cycle (Horovod's
    # test_grad_aggregation_with_inf_grad): the second cycle's gradient is finite.
    count = tf.Variable(0, trainable=False, dtype=tf.int32)
    w = tf.Variable(0.0)
    aggregating = wrap(tf.keras.optimizers.SGD(), backward_passes_per_step=2, sparse_as_dense=True)

    def loss():
        count.assign_add(1)
        return tf.cond(count > 1, lambda: w, lambda: w * float("inf"))

    for _ in range(4):
        grads_and_vars = aggregating._compute_gradients(loss=loss, var_list=[w])
        aggregating.apply_gradients(grads_and_vars)
    record["inf_then_finite"] = bool(tf.math.is_finite(grads_and_vars[0][0]))
    return record


def scenario_keras_behaviours(config):
    return {kind: keras_behaviours(kind, config) for kind in ("stock", "ours")}


def scenario_indexed_slices(config):
    """An embedding's IndexedSlices gradient: ours and the stock tape, plus the local gradient."""
    ids = tf.constant([[1, 2, 4, 5], [4, 3, 2, 9]] if hvd.rank() == 0 else [[1, 3, 4, 4], [4, 7, 9, 9]])
    record = {}
    for kind in ("stock", "ours"):
        table = tf.Variable(np.arange(33, dtype=np.float32).reshape(11, 3) / 10, name=f"table_{kind}")
        dense = tf.Variable(np.ones((3, 2), np.float32), name=f"dense_{kind}")
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(tf.matmul(tf.reshape(tf.gather(table, ids), [-1, 3]), dense) ** 2)
        local = tape.gradient(loss, table)
        wrapped = (hvd.DistributedGradientTape(tape) if kind == "stock"
                   else hs.DistributedGradientTape(tape, compression=compression(config)))
        grads = wrapped.gradient(loss, [table, dense])
        record[kind] = {"table": tf.convert_to_tensor(grads[0]).numpy().tolist(),
                        "is_slices": isinstance(grads[0], tf.IndexedSlices),
                        "local": tf.convert_to_tensor(local).numpy().tolist(),
                        "dense": grads[1].numpy().tolist()}
    return record


def scenario_graph_mode(config):
    """PartialDistributedGradientTape in a TF1-style graph with a session: ours (Compression.none)
    against the stock tape; a sparsifier refuses with a clear error."""
    record = {}
    for kind in ("stock", "ours", "sparsifier"):
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            local = tf.Variable(np.full((3, 2), 1.0 + hvd.rank(), np.float32), name="local")
            shared = tf.Variable(np.full((2,), 2.0 + hvd.rank(), np.float32), name="shared")
            x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3))
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.matmul(x, local) * shared)
            if kind == "stock":
                wrapped = hvd.PartialDistributedGradientTape(tape, local_layers=[])
                wrapped.register_local_source(local)
            else:
                wrapped = hs.PartialDistributedGradientTape(
                    tape, compression=compression(config) if kind == "ours" else hs.Compression.topk(density=0.5))
                wrapped.register_local_source(local)
            try:
                grads = wrapped.gradient(loss, [local, shared])
            except RuntimeError as err:
                record[kind] = {"error": str(err)}
                continue
            session.run(tf.compat.v1.global_variables_initializer())
            record[kind] = {"grads": [g.tolist() for g in session.run(grads)]}
    return record


class GlobalMix(tf.keras.layers.Layer):
    """``x`` plus its batch mean averaged over every rank (Horovod's allreduce, which has a gradient)."""

    def call(self, x):
        return x + hvd.allreduce(tf.reduce_mean(x, axis=0, keepdims=True), op=hvd.Average)


def scenario_own_collectives(config):
    """Three eager tape steps beside the model's own collectives: the weights after each step, per
    run (``dense``, ``full``: density 1, ``sparse``), and whether every rank ended with the same."""
    from horovod.tensorflow.sync_batch_norm import SyncBatchNormalization

    record = {}
    for run, method, density in (("dense", "none", None), ("full", config["method"], 1.0),
                                 ("sparse", config["method"], 0.1)):
        tf.keras.utils.set_random_seed(0)
        # Named: Keras numbers unnamed layers per process, and earlier scenarios made more on rank 0.
        model = tf.keras.Sequential([tf.keras.Input((12,)), tf.keras.layers.Dense(32, name=f"own_{run}_in"),
                                     SyncBatchNormalization(name=f"own_{run}_norm"), tf.keras.layers.Activation("tanh"),
                                     GlobalMix(), tf.keras.layers.Dense(6, name=f"own_{run}_out")])
        optimizer = tf.keras.optimizers.SGD(0.05)
        history = []
        for step in range(3):
            rng = np.random.default_rng([step, hvd.rank()])
            x, y = (tf.constant(rng.standard_normal(shape), tf.float32) for shape in ((16, 12), (16, 6)))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            tape = wrap_tape({"method": method, "options": {"density": density, "min_numel": 0}}, tape)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            history.append(flat(model.trainable_variables))
        mine = tf.constant([history[-1]])
        record[run] = history
        record[f"{run}_identical"] = bool(tf.reduce_all(hvd.allgather(mine, name=f"own.{run}") == mine))
    return record


def scenario_kept_dense(config):
    """Three eager tape steps keeping the biases dense (see the module docstring)."""
    variables = make_variables(f"kd{config['index']}_", 0)
    names = [v.name for v in variables]
    optimizer = tf.keras.optimizers.SGD(0.05)

    def gradients(step, dense=None):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v * tf.constant(raw_gradient(5, step, hvd.rank(), v.shape, i),
                                                                tf.float32)) for i, v in enumerate(variables)])
        if dense is None:
            return tape.gradient(loss, variables), None
        tape = hs.DistributedGradientTape(tape, compression=compression(config), dense=dense)
        return tape.gradient(loss, variables), tape

    record = {"exact": []}
    for name, dense in (("typo", names[1][:-1] + "O"), ("mismatch", names[1] if hvd.rank() == 0 else names[3])):
        try:
            gradients(0, dense)
        except ValueError as error:
            record[name] = str(error)
    for step in range(3):
        own, _ = gradients(step)
        average = [hvd.allreduce(g, op=hvd.Average, name=f"kept.{step}.{i}") for i, g in enumerate(own)]
        grads, tape = gradients(step, [names[1], names[3]])
        record["exact"].append([bool(np.array_equal(g.numpy(), a.numpy())) for g, a in zip(grads, average)])
        optimizer.apply_gradients(zip(grads, variables))
    record["groups"] = tape.exchanger.groups()
    record["stats"] = [{"name": g.name, "dense": g.dense, "kept_dense": g.kept_dense} for g in tape.last_stats.groups]
    record["names"] = names
    return record


def main():
    init_tensorflow_worker()
    configs, out = configs_and_out()
    for index, config in enumerate(configs):
        config["index"] = index
        with swapped(config):
            record = globals()[f"scenario_{config['scenario']}"](config)
        (out / f"{index}.rank{hvd.rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
