"""Worker: horovod_sparse's TensorFlow wrappers with Horovod's own compressions against the stock
``hvd.DistributedGradientTape`` and Keras ``hvd.DistributedOptimizer``, one wrapper argument at a
time (tests/engine/test_stock.py).

Scenarios (one JSON record per rank each, the test asserts on them):

* ``tape`` / ``keras``: a config names a compression (``none`` / ``fp16``) and the ``wrapper``
  arguments both wrappers get (``op``, ``gradient_predivide_factor``, ``num_groups``, ``groups``
  as an int or lists of variable positions, ``sparse_as_dense``, ``process_set`` as a list of
  ranks; Keras also ``backward_passes_per_step`` and ``average_aggregated_gradients``). Both
  train the same model (an embedding, whose gradient is a ``tf.IndexedSlices`` with
  ``sparse_embedding``, else one-hot rows times a matrix, and two dense layers) from the same
  initial values on the same rank-dependent batches with SGD (the tape eagerly or, with
  ``traced``, in a ``tf.function``; Keras through ``model.fit``); the record holds, per kind,
  the gradients (tape) and the weights after every step, or the error raised.
* ``mismatch``: rank 1 builds the model with one variable of another shape (as many elements)
  or dtype; every rank records the ``ValueError`` its tape raised (None: it went on).
"""
import json

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from tests.workers.cli import compression as shared_compression
from tests.workers.cli import configs_and_out, init_tensorflow_worker

STEPS = 3
#: Process sets by their ranks, created at ``hvd.init`` (see :func:`main`).
PROCESS_SETS = {}


def compression(name):
    return shared_compression(hvd, hs, name)


def wrapper_arguments(config, kind, variables):
    """The config's wrapper arguments for ``kind`` (stock or ours) as the wrappers take them."""
    arguments = dict(config["wrapper"], **(config.get("stock", {}) if kind == "stock" else {}))
    if "op" in arguments:
        arguments["op"] = getattr(hvd, arguments["op"])
    if isinstance(arguments.get("groups"), list):
        arguments["groups"] = [[variables[i] for i in members] for members in arguments["groups"]]
    if "process_set" in arguments:
        arguments["process_set"] = PROCESS_SETS[tuple(arguments["process_set"])]
    return arguments


def batch(step, micro=0):
    rng = np.random.default_rng([step, micro, hvd.rank()])
    return rng.integers(0, 10, (6, 2)), rng.standard_normal((6, 3)).astype(np.float32)


def make_variables(prefix, shape=(16, 8), dtype="float32"):
    """Embedding table, hidden layer, output layer and a ``scale`` matrix (same values on every
    rank, by seed)."""
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((10, 4), (8, 16), (16,), (16, 3), (3,))]
    variables = [tf.Variable(v, name=f"{prefix}{name}")
                 for v, name in zip(values, ("embedding", "hidden", "hidden_bias", "out", "out_bias"))]
    scale = rng.standard_normal((16, 8)).astype(dtype).reshape(shape)
    return variables + [tf.Variable(scale, name=f"{prefix}scale")]


def tape_loss(variables, ids, y, sparse_embedding=False):
    """The loss; the embedding's gradient is a ``tf.IndexedSlices`` with ``sparse_embedding``
    (a lookup), else dense (a product with one-hot rows)."""
    embedding, hidden, hidden_bias, out, out_bias, scale = variables
    rows = tf.gather(embedding, ids) if sparse_embedding else tf.tensordot(tf.one_hot(ids, 10), embedding, 1)
    h = tf.tanh(tf.matmul(tf.reshape(rows, [6, 8]), hidden) + hidden_bias)
    h = h + tf.cast(tf.reduce_sum(scale), tf.float32) * 1e-3
    return tf.reduce_mean((tf.matmul(h, out) + out_bias - y) ** 2)


def flat(value):
    return tf.reshape(tf.cast(tf.convert_to_tensor(value), tf.float64), [-1]).numpy().tolist()


def scenario_tape(config):
    return {kind: run_tape(config, kind) for kind in ("stock", "ours")}


def run_tape(config, kind):
    variables = make_variables(f"{kind}{config['index']}_")
    arguments = wrapper_arguments(config, kind, variables)
    optimizer = tf.keras.optimizers.SGD(0.1)
    wrap = hvd.DistributedGradientTape if kind == "stock" else hs.DistributedGradientTape

    def step(ids, y):
        with tf.GradientTape() as tape:
            loss = tape_loss(variables, ids, y, config["sparse_embedding"])
        tape = wrap(tape, compression=compression(config["compression"]), **arguments)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return [tf.convert_to_tensor(g) for g in grads]

    run = tf.function(step) if config.get("traced") else step
    record = {"grads": [], "params": []}
    try:
        for index in range(STEPS):
            grads = run(*batch(index))
            record["grads"].append([flat(g) for g in grads])
            record["params"].append([flat(v) for v in variables])
    except Exception as error:  # noqa: BLE001  (the test compares what each wrapper raised)
        record["error"] = f"{type(error).__name__}: {error}"
    return record


def scenario_keras(config):
    return {kind: run_keras(config, kind) for kind in ("stock", "ours")}


def run_keras(config, kind):
    tf.keras.backend.clear_session()
    tf.keras.utils.set_random_seed(3)
    dense = [tf.keras.layers.Dense(16, activation="tanh"), tf.keras.layers.Dense(3)]
    if config["sparse_embedding"]:
        model = tf.keras.Sequential([tf.keras.layers.Embedding(10, 4, input_length=2), tf.keras.layers.Flatten(),
                                     *dense])
        model.build((None, 2))
    else:  # the ids as one-hot rows: no IndexedSlices gradient
        model = tf.keras.Sequential(dense)
        model.build((None, 20))
    arguments = wrapper_arguments(config, kind, model.trainable_variables)
    wrap = hvd_keras.DistributedOptimizer if kind == "stock" else hs_keras.DistributedOptimizer
    passes = arguments.get("backward_passes_per_step", 1)
    ids, y = zip(*(batch(step, micro) for step in range(STEPS) for micro in range(passes)))
    x = np.concatenate(ids)
    if not config["sparse_embedding"]:
        x = np.eye(10, dtype=np.float32)[x].reshape(-1, 20)
    record = {"params": []}
    try:
        optimizer = wrap(tf.keras.optimizers.SGD(0.1), compression=compression(config["compression"]), **arguments)
        model.compile(optimizer=optimizer, loss="mse")
        weights = tf.keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: record["params"].append([flat(w) for w in model.weights]))
        model.fit(x, np.concatenate(y), batch_size=6, epochs=1, verbose=0, shuffle=False,
                  callbacks=[weights])
    except Exception as error:  # noqa: BLE001  (the test compares what each wrapper raised)
        record["error"] = f"{type(error).__name__}: {error}"
    return record


def scenario_mismatch(config):
    """Rank 1's ``scale`` variable has ``config['rank1']``'s shape / dtype instead of 16 x 8
    float32; every rank records the error its tape raised (one group per tensor, so that the
    error names the variable: in a bucket it names the bucket)."""
    rank1 = config["rank1"] if hvd.rank() == 1 else {}
    variables = make_variables("m_", tuple(rank1.get("shape", (16, 8))), rank1.get("dtype", "float32"))
    ids, y = batch(0)
    with tf.GradientTape() as tape:
        loss = tape_loss(variables, ids, y)
    tape = hs.DistributedGradientTape(tape, compression=compression(config["compression"]), groups="tensor")
    try:
        tape.gradient(loss, variables)
    except ValueError as error:
        return {config["name"]: str(error)}
    return {config["name"]: None}


def main():
    configs, out = configs_and_out()
    ranks = sorted({tuple(c["wrapper"]["process_set"]) for c in configs if "process_set" in c.get("wrapper", {})})
    sets = [hvd.ProcessSet(list(r)) for r in ranks]
    init_tensorflow_worker(process_sets=sets)
    PROCESS_SETS.update(zip(ranks, sets))
    for index, config in enumerate(configs):
        config["index"] = index
        record = globals()[f"scenario_{config['scenario']}"](config)
        (out / f"{index}.rank{hvd.rank()}.json").write_text(json.dumps(record))
    hvd.join()  # a rank outside a process set finishes first; its shutdown would stop the others


if __name__ == "__main__":
    main()
