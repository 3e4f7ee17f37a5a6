"""Worker: TensorFlow mixed precision with a Keras ``LossScaleOptimizer`` (issue 29), the
counterpart of ``torch_amp.py``.

Scenarios (one JSON record and one ``.npz`` per record name and rank; the test asserts on them):

* ``recipe``: a small regression net under the ``mixed_float16`` policy whose LossScaleOptimizer
  starts at a scale far too large (its first steps overflow in float16) trains through one
  ``loop`` with stock Horovod, then with horovod_sparse for every method of the config (and
  Horovod's ``none`` through our wrappers), from the same initial weights and batches. Loops:
  ``fit`` (``model.fit``, traced) and ``fit_eager`` (``run_eagerly=True``) with
  ``LossScaleOptimizer(DistributedOptimizer(SGD))``; ``tape`` (eager) and ``tape_function``
  (inside a ``tf.function``): ``get_scaled_loss``, the distributed tape (ours given
  ``loss_scaler=``), ``get_unscaled_gradients``, ``apply_gradients`` of a LossScaleOptimizer
  around a plain SGD. Records ``recipe_{loop}_{method}``: per step the scale it ran at, whether
  the weights moved, the loss and the residuals' finiteness; the final weights (the format
  ``tests.torch.test_amp.check_recipe`` reads).
* ``units``: loss-scale units, exactly. Given gradients ``G_t`` (``tests.support.streams.raw_gradient``)
  enter as ``S_t * G_t`` through a LossScaleOptimizer whose scale is set to a power of two
  ``S_t`` that changes from step to step; the reference run feeds ``G_t`` with no loss scaling.
  APIs: ``tape`` and ``tape_function`` (the tape given ``loss_scaler=``) and ``keras`` and
  ``keras_function`` (``compute_gradients`` + ``apply_gradients`` of a LossScaleOptimizer around
  our Keras optimizer; the reference calls our optimizer itself). Records ``units_{api}_{method}``:
  every step's unscaled aggregate, residuals and variables (``scaled_*`` / ``plain_*``).
* ``policy``: the Keras wrapper without a loss scaler, eagerly and inside a ``tf.function``,
  under ``nonfinite="raise"`` and ``"skip"``; rank 1's gradient is infinite at step 1 of 3.
  Records ``policy_{mode}_{policy}``: per step what it raised or warned, ``last_stats.abandoned``,
  the optimizer's ``iterations``, the variables and the aggregated gradients (when returned).
  And ``policy_unchecked``: what the first step of our Keras optimizer with ``nonfinite=None``
  inside a LossScaleOptimizer raised.
"""
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hsk
from tests.support.streams import raw_gradient
from tests.workers.cli import configs_and_out, init_tensorflow_worker

BATCH = 32


def compression(method: str, options: Dict[str, Any]) -> Any:
    return hvd.Compression.none if method == "none" else hs.Compression.create(method, **options)


# -- recipe ---------------------------------------------------------------------------------------
def regression_model() -> tf.keras.Model:
    """The same initial net on every rank and in every run (float16 compute, float32 weights)."""
    tf.keras.utils.set_random_seed(5)
    return tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(64, activation="tanh"),
                                tf.keras.layers.Dense(4, dtype="float32")])


def regression_data(steps: int) -> Tuple[np.ndarray, np.ndarray]:
    """This rank's ``steps`` batches, concatenated: inputs and a linear target."""
    x = np.random.default_rng([100, hvd.rank()]).standard_normal((steps * BATCH, 32)).astype(np.float32)
    return x, x[:, :4] * 0.5 + 0.1


def loss_scale_optimizer(inner: tf.keras.optimizers.Optimizer, config: Dict[str, Any]) -> Any:
    return tf.keras.mixed_precision.LossScaleOptimizer(inner, initial_scale=2.0 ** config["init_exponent"],
                                                       dynamic_growth_steps=config["growth_steps"])


def weights(model: tf.keras.Model) -> List[np.ndarray]:
    return [w.copy() for w in model.get_weights()]


def flat_weights(model: tf.keras.Model) -> List[float]:
    return np.concatenate([w.reshape(-1) for w in model.get_weights()]).tolist()


def step_record(scale: float, before: List[np.ndarray], model: tf.keras.Model, loss: float,
                residuals: Callable[[], List[tf.Tensor]]) -> Dict[str, Any]:
    moved = any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    return {"scale": scale, "moved": moved, "loss": loss,
            "residuals_finite": all(bool(np.isfinite(r.numpy()).all()) for r in residuals())}


class _Steps(tf.keras.callbacks.Callback):
    """Records every batch of ``model.fit`` as :func:`step_record` does."""

    def __init__(self, optimizer: Any, residuals: Callable[[], List[tf.Tensor]]) -> None:
        super().__init__()
        self.optimizer, self.residuals = optimizer, residuals
        self.steps: List[Dict[str, Any]] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.before, self.scale = weights(self.model), float(self.optimizer.loss_scale)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.steps.append(step_record(self.scale, self.before, self.model, float(logs["loss"]), self.residuals))


def fit_run(config: Dict[str, Any], method: Optional[str], eager: bool) -> Dict[str, Any]:
    """``model.fit`` with ``LossScaleOptimizer(DistributedOptimizer(SGD))``: Horovod's wrapper
    (``method`` None) or ours."""
    model = regression_model()
    sgd = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    inner = (hvd_keras.DistributedOptimizer(sgd) if method is None
             else hsk.DistributedOptimizer(sgd, compression=compression(method, config["options"])))
    optimizer = loss_scale_optimizer(inner, config)
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=eager)
    steps = _Steps(optimizer, lambda: [] if method is None else list(inner.exchanger.residuals().values()))
    x, y = regression_data(config["steps"])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[steps])
    return {"steps": steps.steps, "params": flat_weights(model)}


def tape_run(config: Dict[str, Any], method: Optional[str], traced: bool) -> Dict[str, Any]:
    """Keras' custom-loop recipe with Horovod's tape (``method`` None) or ours given the
    LossScaleOptimizer, eagerly or inside a ``tf.function``."""
    model = regression_model()
    optimizer = loss_scale_optimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9), config)
    tapes: List[Any] = []

    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
            scaled = optimizer.get_scaled_loss(loss)
        tape = (hvd.DistributedGradientTape(tape) if method is None
                else hs.DistributedGradientTape(tape, compression=compression(method, config["options"]),
                                                loss_scaler=optimizer))
        tapes.append(tape)
        grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    run = tf.function(step) if traced else step
    x, y = regression_data(config["steps"])
    record = []
    for t in range(config["steps"]):
        before, scale = weights(model), float(optimizer.loss_scale)
        loss = float(run(x[t * BATCH:(t + 1) * BATCH], y[t * BATCH:(t + 1) * BATCH]))
        record.append(step_record(scale, before, model, loss,
                                  lambda: [] if method is None else list(tapes[-1].exchanger.residuals().values())))
    return {"steps": record, "params": flat_weights(model)}


LOOPS = {"fit": lambda c, m: fit_run(c, m, eager=False), "fit_eager": lambda c, m: fit_run(c, m, eager=True),
         "tape": lambda c, m: tape_run(c, m, traced=False), "tape_function": lambda c, m: tape_run(c, m, traced=True)}


def recipe(config: Dict[str, Any], out: Path) -> None:
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    loop = LOOPS[config["loop"]]
    stock = loop(config, None)
    for method in config["methods"]:
        write(out, f"recipe_{config['loop']}_{method}", {"stock": stock, "ours": loop(config, method)}, {})
    tf.keras.mixed_precision.set_global_policy("float32")


# -- units ----------------------------------------------------------------------------------------
def units_run(config: Dict[str, Any], method: str, scaled: bool, arrays: Dict[str, np.ndarray]) -> None:
    """The given gradients through ``config["api"]``, scaled by ``2 ** exponents[t]`` at step t
    (``scaled``) or not; records ``{scaled|plain}_{agg|residual|param}_{step}_{i}``."""
    api, exponents, shapes = config["api"], config["exponents"], config["shapes"]
    run = "scaled" if scaled else "plain"
    rng = np.random.default_rng(config["seed"])
    variables = [tf.Variable(rng.standard_normal(s).astype(np.float32), name=f"{api}_{method}_{run}_{i}")
                 for i, s in enumerate(shapes)]
    arguments = {"compression": compression(method, config["options"][method]), "groups": "tensor"}
    keras = api.startswith("keras")
    ours = hsk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), **arguments) if keras else None
    inner = ours if keras else tf.keras.optimizers.SGD(0.1)
    optimizer = tf.keras.mixed_precision.LossScaleOptimizer(inner) if scaled else inner
    exchangers: List[Any] = []

    def step(grads: List[tf.Tensor]) -> List[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
            if scaled and not keras:
                loss = optimizer.get_scaled_loss(loss)
        if keras:  # the LossScaleOptimizer scales the loss and unscales the aggregate itself
            aggregated = [g for g, _ in optimizer.compute_gradients(loss, variables, tape)]
            exchangers.append(ours.exchanger)
        else:
            tape = hs.DistributedGradientTape(tape, loss_scaler=optimizer if scaled else None, **arguments)
            exchangers.append(tape.exchanger)
            aggregated = tape.gradient(loss, variables)
            if scaled:
                aggregated = optimizer.get_unscaled_gradients(aggregated)
        optimizer.apply_gradients(zip(aggregated, variables))
        return aggregated

    traced = tf.function(step) if api.endswith("_function") else step
    for t, exponent in enumerate(exponents):
        if scaled:
            optimizer._loss_scale.current_loss_scale.assign(2.0 ** exponent)  # this step's scale
        grads = [tf.constant(raw_gradient(config["seed"], t, hvd.rank(), s, i), tf.float32)
                 for i, s in enumerate(shapes)]
        aggregated = traced(grads)
        residuals = list(exchangers[-1].residuals().values())
        for i, v in enumerate(variables):
            arrays[f"{run}_agg_{t}_{i}"] = aggregated[i].numpy()
            arrays[f"{run}_residual_{t}_{i}"] = residuals[i].numpy()
            arrays[f"{run}_param_{t}_{i}"] = v.numpy()


def units(config: Dict[str, Any], out: Path) -> None:
    for method in config["methods"]:
        arrays: Dict[str, np.ndarray] = {}
        for scaled in (True, False):
            units_run(config, method, scaled, arrays)
        write(out, f"units_{config['api']}_{method}", {}, arrays)


# -- policy ---------------------------------------------------------------------------------------
def policy_run(config: Dict[str, Any], traced: bool, policy: str) -> Dict[str, Any]:
    """Three steps of given gradients through our Keras optimizer (SGD with momentum, so a
    zero or NaN update would show), rank 1's gradient infinite at step 1."""
    shapes = config["shapes"]
    rng = np.random.default_rng(config["seed"])
    variables = [tf.Variable(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    optimizer = hsk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), nonfinite=policy,
                                         compression=compression("topk", config["options"]))

    def step(grads: List[tf.Tensor]) -> List[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        aggregated = [g for g, _ in optimizer.compute_gradients(loss, variables, tape)]
        optimizer.apply_gradients(zip(aggregated, variables))
        return aggregated

    run = tf.function(step) if traced else step
    record = []
    for t in range(3):
        grads = [tf.constant(raw_gradient(config["seed"], t, hvd.rank(), s, i), tf.float32)
                 for i, s in enumerate(shapes)]
        if t == 1 and hvd.rank() == 1:
            grads[0] = grads[0] * np.inf
        seen: Dict[str, Any] = {"raised": None, "aggregated": None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                seen["aggregated"] = [g.numpy().tolist() for g in run(grads)]
            except (FloatingPointError, tf.errors.OpError) as error:
                seen["raised"] = f"{type(error).__name__}: {error}"
        seen.update(warned=[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                    abandoned=optimizer.last_stats.abandoned, iterations=int(optimizer.iterations),
                    params=[v.numpy().tolist() for v in variables])
        record.append(seen)
    return {"steps": record}


def unchecked_run(config: Dict[str, Any]) -> Dict[str, Any]:
    """One step of our Keras optimizer with ``nonfinite=None`` inside a LossScaleOptimizer."""
    variable = tf.Variable(tf.ones(config["shapes"][0]))
    ours = hsk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), nonfinite=None,
                                    compression=compression("topk", config["options"]))
    optimizer = tf.keras.mixed_precision.LossScaleOptimizer(ours)
    try:
        optimizer.minimize(lambda: tf.reduce_sum(variable * variable), [variable])
    except ValueError as error:
        return {"raised": str(error)}
    return {"raised": None}


def policy(config: Dict[str, Any], out: Path) -> None:
    for mode in ("eager", "traced"):
        for name in ("raise", "skip"):
            write(out, f"policy_{mode}_{name}", policy_run(config, mode == "traced", name), {})
    write(out, "policy_unchecked", unchecked_run(config), {})


def write(out: Path, name: str, record: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
    np.savez(out / f"{name}.rank{hvd.rank()}.npz", **arrays)
    (out / f"{name}.rank{hvd.rank()}.json").write_text(json.dumps(record))


def main() -> None:
    configs, out = configs_and_out()
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    init_tensorflow_worker()
    for config in configs:
        {"recipe": recipe, "units": units, "policy": policy}[config["scenario"]](config, out)


if __name__ == "__main__":
    main()
