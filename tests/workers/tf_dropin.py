"""Worker: the TensorFlow front end where Horovod users rely on Horovod's own behaviour.

Scenarios (one JSON record per rank each, the test asserts on them):

* ``tape_checkpoint``: Horovod's checkpoint idiom with the tape. N steps; rank 0 alone saves
  the variables and ``tape.state_dict()``; fresh variables (different on every rank); rank 0
  alone restores; ``hvd.broadcast_variables``; M more steps (eager, or in a ``tf.function``).
  Expected: the original run's continuation with every rank but 0 emptied of its per-rank state
  at step N (residuals, DGC's velocity).
* ``keras_checkpoint``: the same through Keras ``model.fit`` (traced unless the method is
  eager-only) with ``BroadcastGlobalVariablesCallback(0)`` after rank 0 alone restored.
* ``indexed_slices``: an embedding's ``tf.IndexedSlices`` gradient, ours against the stock tape.
* ``graph_mode``: ``PartialDistributedGradientTape`` in a TF1-style graph and session.
"""
import io
import json
import pickle

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from tests.streams import raw_gradient
from tests.workers.cli import configs_and_out, init_tensorflow_worker

SHAPES = [[12, 64], [64], [64, 6], [6]]


def compression(config):
    if config["method"] == "none":
        return hvd.Compression.none
    return hs.Compression.create(config["method"], **config.get("options", {}))


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
        tape = hs.DistributedGradientTape(tape, compression=compression(config), stats_log=log)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    run = tf.function(step) if config.get("traced") else step

    def train(index):
        run([tf.constant(raw_gradient(5, index, hvd.rank(), v.shape, i), tf.float32) for i, v in enumerate(variables)])

    return train


def exchanger_of(config, log):
    return hs.DistributedGradientTape(tf.GradientTape(), compression=compression(config), stats_log=log).exchanger


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
    optimizer = hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=compression(config))
    model.compile(optimizer=optimizer, loss="mse")
    return model, optimizer


def scenario_keras_checkpoint(config):
    steps, more = config["steps"], config["more"]
    model, optimizer = keras_model(config, 0)
    keras_fit(model, config, optimizer, steps, 0)
    blob = None
    if hvd.rank() == 0:
        blob = pickle.dumps({"weights": model.get_weights(), "iterations": int(optimizer.iterations.numpy()),
                             "sparse": optimizer.exchanger.state_dict()})
    fresh, fresh_optimizer = keras_model(config, 1 + hvd.rank())
    if hvd.rank() == 0:
        saved = pickle.loads(blob)
        fresh.set_weights(saved["weights"])
        fresh_optimizer.iterations.assign(saved["iterations"])
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


def main():
    init_tensorflow_worker()
    configs, out = configs_and_out()
    for index, config in enumerate(configs):
        config["index"] = index
        record = globals()[f"scenario_{config['scenario']}"](config)
        (out / f"{index}.rank{hvd.rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
