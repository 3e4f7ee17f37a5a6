"""Worker: Keras 3 ``model.fit`` through horovod_sparse.tensorflow.keras.DistributedOptimizer,
launched without ``TF_USE_LEGACY_KERAS`` (``tf.keras`` is Keras 3), on known per-rank gradients.

The model holds variables of ``shapes`` and its loss on a sample ``x`` (every variable's flat
gradient at one step, concatenated) is ``sum_i <v_i, x_i>``: ``model.fit`` (traced, batch size 1,
no shuffling) then differentiates exactly the gradient stream of ``tests/workers/tf_exchange.py``
(``tests.support.reference_partitioned.stream_gradient``), so the slow references of the Keras 2 tests
apply. Each rank starts from its own weights (rank 0 from zeros), and
``callbacks.BroadcastGlobalVariablesCallback(0)`` must make them rank 0's. The optimizer is
``SGD(learning_rate=1)`` without momentum, so the aggregated gradient of step t is the difference
of the weights before and after it: they are recorded after every batch and written in
``tf_exchange.py``'s format (``agg_{t}_{i}``, ``param_{i}``, ``residual_{g}``; the groups and
statistics in the JSON record), which ``tests/support/checks.py`` reads.

Config: {"name", "method" ("none": Horovod's Compression.none), "options", "groups", "shapes",
"seed", "steps", "scenario", "run_eagerly"}, the scenario one of

* ``"reference"``: as above, with ``MetricAverageCallback`` and ``SparsificationStatsCallback``;
* ``"passes"``: ``backward_passes_per_step=passes``, step t's gradient arriving over that many
  batches in parts 1:2:...:passes (only every ``passes``-th batch may change the weights);
* ``"nonfinite"``: rank ``bad[0]`` has an Inf in its gradient at step ``bad[1]``, under the
  policy ``nonfinite`` (``"raise"``: ``model.fit`` raises; the error is recorded);
* ``"scaler"``: the same Inf, with the optimizer a ``keras.optimizers.LossScaleOptimizer``
  (``initial_scale``) wrapped by ours; records the final scale;
* ``"mixed"``: the model under Keras' ``mixed_float16`` policy (float16 compute, float32
  variables), the optimizer a ``LossScaleOptimizer`` (``initial_scale``) wrapped by ours, as
  Keras' mixed-precision guide has it; records the dtypes and the final scale;
* ``"restored"``: ``SGD(0.1, momentum=0.9)``; rank 0 alone sets its optimizer's state (momentum
  buffers, ``iterations``) before the fit, as after restoring a checkpoint.
"""
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hsk
from horovod_sparse.tensorflow.keras3 import tf_variable
from tests.support.reference_partitioned import stream_gradient
from tests.workers.cli import configs_and_out, init_tensorflow_worker, write_record


class GivenGradients(keras.Model):
    """Variables of ``shapes``; the output on a batch of flat gradients is ``<v, x>`` per sample."""

    def __init__(self, shapes, prefix):
        super().__init__()
        self.sizes = [int(np.prod(s)) for s in shapes]
        self.params = [self.add_weight(shape=tuple(s), initializer="zeros", name=f"{prefix}{i}")
                       for i, s in enumerate(shapes)]

    def call(self, x):
        pieces = tf.split(x, self.sizes, axis=-1)
        return tf.add_n([tf.reduce_sum(tf.reshape(v, [-1]) * p, axis=-1) for v, p in zip(self.params, pieces)])


class Recorder(keras.callbacks.Callback):
    """The weights when training begins (after the broadcast) and after every batch, and the
    exchange's statistics after every batch."""

    def __init__(self):
        super().__init__()
        self.weights, self.stats = [], []

    def snapshot(self):
        return [v.numpy().astype(np.float64) for v in self.model.params]

    def on_train_begin(self, logs=None):
        self.weights.append(self.snapshot())

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(self.snapshot())
        stats = self.model.optimizer.last_stats
        self.stats.append(None if stats is None else stats.as_dict())


def samples(config, rank):
    """This rank's batches: step t's flat gradient (split over the passes), with the Inf of
    ``bad`` in place."""
    passes = config.get("passes", 1)
    rows = []
    for step in range(config["steps"]):
        flat = np.concatenate([stream_gradient(config, step, rank, s, i).reshape(-1)
                               for i, s in enumerate(config["shapes"])])
        if config.get("bad") == [rank, step]:
            flat[3] = np.inf
        rows += [flat * (part / (passes * (passes + 1) / 2)) for part in range(1, passes + 1)]
    return np.asarray(rows, dtype=np.float32)


def optimizer_for(config):
    scenario = config.get("scenario", "reference")
    compression = (hvd.Compression.none if config["method"] == "none"
                   else hs.Compression.create(config["method"], **config.get("options", {})))
    if scenario == "restored":
        base = keras.optimizers.SGD(0.1, momentum=0.9)
    else:
        base = keras.optimizers.SGD(1.0)
    if scenario in ("scaler", "mixed"):
        base = keras.optimizers.LossScaleOptimizer(base, initial_scale=config["initial_scale"])
    options = {"compression": compression, "backward_passes_per_step": config.get("passes", 1)}
    if "groups" in config:
        options["groups"] = config["groups"]
    if "nonfinite" in config:
        options["nonfinite"] = config["nonfinite"]
    return hsk.DistributedOptimizer(base, **options)


def run(config, out):
    rank = hvd.rank()
    prefix = f"{config['name']}_p"
    mixed = config.get("scenario") == "mixed"
    keras.mixed_precision.set_global_policy("mixed_float16" if mixed else "float32")
    model = GivenGradients(config["shapes"], prefix)
    rng = np.random.default_rng([config["seed"], 99, rank])
    for variable in model.params:  # rank 0 starts from zeros, the others elsewhere
        variable.assign(np.zeros(variable.shape) if rank == 0 else rng.standard_normal(variable.shape))
    optimizer = optimizer_for(config)
    model.compile(optimizer=optimizer, loss=lambda y_true, y_pred: y_pred, jit_compile=False,
                  run_eagerly=config.get("run_eagerly", False))
    if config.get("scenario") == "restored" and rank == 0:
        optimizer.build(model.trainable_variables)
        optimizer.iterations.assign(5)
        for momentum in optimizer.momentums:
            momentum.assign(rng.standard_normal(momentum.shape))
    recorder = Recorder()
    callbacks = [hsk.callbacks.BroadcastGlobalVariablesCallback(0), recorder, hsk.callbacks.MetricAverageCallback(),
                 hsk.SparsificationStatsCallback()]
    x = samples(config, rank)
    record = {"keras": keras.__version__, "tf_keras": tf.keras.__name__, "run_eagerly": model.run_eagerly,
              "error": None, "compute_dtype": model.compute_dtype, "variable_dtype": model.params[0].dtype,
              "optimizer_is_ours": model.optimizer is optimizer}
    try:
        history = model.fit(x, np.zeros(len(x), np.float32), batch_size=1, epochs=1, shuffle=False, verbose=0,
                            callbacks=callbacks)
        record["history"] = history.history
    except Exception as error:  # noqa: BLE001 (the test checks type and message)
        record["error"] = {"type": type(error).__name__, "message": str(error)}
    passes = config.get("passes", 1)
    weights = recorder.weights
    steps = (len(weights) - 1) // passes
    arrays = {f"agg_{t}_{i}": weights[t * passes][i] - weights[(t + 1) * passes][i]
              for t in range(steps) for i in range(len(model.params))}
    arrays.update({f"param_{i}": w for i, w in enumerate(recorder.snapshot())})
    arrays.update({f"start_{i}": w for i, w in enumerate(weights[0])})
    exchanger = optimizer.exchanger
    arrays.update({f"residual_{g}": r.numpy().astype(np.float64) for g, r in enumerate(exchanger.residuals().values())})
    index = {tf_variable(v).name: i for i, v in enumerate(model.params)}
    record.update({
        "groups": [[index[name] for name in names] for names in exchanger.groups()],
        "stats": recorder.stats,
        "iterations": int(optimizer.iterations.numpy()),
        # Batches after which the weights did not change (the passes between exchanges, abandoned steps).
        "unchanged": [b for b in range(1, len(weights))
                      if all(np.array_equal(a, z) for a, z in zip(weights[b - 1], weights[b]))],
        "final_is_last_recorded": all(np.array_equal(a, z) for a, z in zip(weights[-1], recorder.snapshot())),
        "loss_scale": float(optimizer.dynamic_scale.numpy()) if config.get("scenario") in ("scaler", "mixed")
        else None,
    })
    write_record(out, config["name"], rank, arrays, record)


def main():
    configs, out = configs_and_out()
    init_tensorflow_worker()
    for config in configs:
        run(config, out)


if __name__ == "__main__":
    main()
