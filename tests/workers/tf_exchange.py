"""Worker: trains a set of TensorFlow variables on known per-rank gradients through horovod_sparse
and writes what it observed (aggregated gradients, residuals, variables, statistics) in the same
file format as ``torch_exchange.py``, so the same checks (``tests/support/checks.py``) apply.

Each config: {"name", "method", "options", "groups", "steps", "seed", "shapes", "dtype", "stream",
"zero_ranks", "zero_after", "api", "backward_passes", "compare_stock", "expect_error", "stock",
"step_seconds", "cost_model", "local_cost", "prefix", "hierarchical"} (``prefix``: of the variable
names, which are ``<prefix><i>``; the config's name and ``_p`` by default; ``hierarchical``: the
wrapper's argument, Horovod then started with dynamic process sets).
``groups`` is what ``groups=`` takes, with lists of variable indices for lists of variables and
``{"mergecomp": {options}}`` for ``MergeCompOptions``; for the gradients see ``gradient_stream``.
``api`` is how the exchange is driven:

* ``"tape"``: ``DistributedGradientTape`` in eager mode (the default);
* ``"tape_function"``: the same step inside a ``tf.function``;
* ``"keras"``: the Keras ``DistributedOptimizer`` (``compute_gradients`` + ``apply_gradients``);
* ``"keras_function"``: the Keras optimizer inside a ``tf.function``.

``step_seconds``, ``cost_model`` and ``local_cost`` give times instead of measured ones, as in
``torch_exchange.py`` (every gradient arrives at once here, when the tape returns).

With ``compare_stock`` a second copy of the variables is trained by Horovod's own wrapper (the
tape or the Keras optimizer) with the same compression and both results are written. With
``expect_error`` the worker records the error the first step raises instead of training (with
``stock``: through Horovod's own wrapper).
"""
import json
from pathlib import Path

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from horovod_sparse.common.cost_model import AlphaBeta
from horovod_sparse.common.cost_model import LocalCost
from horovod_sparse.common.mergecomp import MergeCompOptions
from tests.support.reference_partitioned import stream_gradient
from tests.support.streams import raw_gradient
from tests.workers.cli import configs_and_out, init_tensorflow_worker
from tests.workers.virtual_time import VirtualClock, step_seconds


def make_variables(shapes, seed, dtype, prefix):
    rng = np.random.default_rng(seed)
    return [tf.Variable(rng.standard_normal(s).astype(dtype), name=f"{prefix}{i}") for i, s in enumerate(shapes)]


def gradient_stream(variables, config, step, rank):
    """This rank's raw gradient of every variable at ``step`` (the loss below has exactly it):
    ``tests.support.streams`` (``stream``), or, for the normal stream, the partitioned tests' variant
    (``zero_ranks``, ``zero_after``)."""
    stream = config.get("stream", "normal")
    return [tf.constant(stream_gradient(config, step, rank, v.shape, i) if stream == "normal"
                        else raw_gradient(config["seed"], step, rank, v.shape, i, stream), dtype=v.dtype)
            for i, v in enumerate(variables)]


def loss_of(variables, raw_grads):
    return tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, raw_grads)])


class Trainer:
    """One copy of the variables and the wrapper that exchanges their gradients."""

    def __init__(self, config, compression, stock, prefix):
        self.config = config
        self.variables = make_variables(config["shapes"], config["seed"], config.get("dtype", "float32"), prefix)
        self.api = config.get("api", "tape")
        self.tape_module = hvd if stock else hs
        keras_module = hvd_keras if stock else hs_keras
        groups = config.get("groups")
        if isinstance(groups, list):
            groups = [[self.variables[i] for i in members] for members in groups]
        elif isinstance(groups, dict):
            groups = MergeCompOptions(**groups["mergecomp"])
        self.wrapper_args = {"compression": compression}
        if groups is not None:
            self.wrapper_args["groups"] = groups
        if config.get("hierarchical") is not None:
            self.wrapper_args["hierarchical"] = config["hierarchical"]
        self.optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        self.passes = config.get("backward_passes", 1)
        #: The exchanger's clock with ``step_seconds`` (given step times), else None (measured).
        self.clock = VirtualClock() if "step_seconds" in config else None
        if self.api.startswith("keras"):
            self.optimizer = keras_module.DistributedOptimizer(self.optimizer, backward_passes_per_step=self.passes,
                                                               **self.wrapper_args)
            self._use_clock(self.optimizer)
        self.tape = None
        #: Times the step's Python body ran: once per step eagerly, once per trace in a tf.function.
        self.traces = 0
        self._step = tf.function(self._eager_step) if self.api.endswith("_function") else self._eager_step

    def _eager_step(self, raw_grads):
        """One optimizer step; with ``backward_passes`` (Keras) the step's gradient arrives over
        that many passes, in parts 1:2:...:passes, and the last pass returns the exchanged one."""
        self.traces += 1
        for part in range(1, self.passes + 1):
            with tf.GradientTape() as tape:
                loss = loss_of(self.variables, raw_grads) * (part / (self.passes * (self.passes + 1) / 2))
            if self.api.startswith("keras"):
                grads = [g for g, _ in self.optimizer.compute_gradients(loss, self.variables, tape)]
            else:
                self.tape = self.tape_module.DistributedGradientTape(tape, **self.wrapper_args)
                self._use_clock(self.tape)
                grads = self.tape.gradient(loss, self.variables)
            self.optimizer.apply_gradients(zip(grads, self.variables))
        return grads

    def _use_clock(self, wrapper):
        """Gives ``wrapper``'s exchanger the virtual clock, if there is one (a stock Horovod
        wrapper has no exchanger and is never given one)."""
        if self.clock is not None:
            wrapper.exchanger.clock = self.clock

    def next_groups(self):
        """Variable names of the groups the next step launches; [] before the first step, whose
        groups are formed when it runs (per tensor under MergeComp, whose first step records)."""
        return self.exchanger.groups() if self.tape is not None or self.api.startswith("keras") else []

    def step(self, step):
        raw_grads = gradient_stream(self.variables, self.config, step, hvd.rank())
        if self.clock is not None:  # the step takes its given time with the groups it will use
            groups = self.next_groups()
            numel = {v.name: int(np.prod(v.shape)) for v in self.variables}
            sizes = [sum(numel[n] for n in g) for g in groups] or list(numel.values())
            self.clock.advance(step_seconds(self.config["step_seconds"], sizes, step, hvd.rank()))
        return [g.numpy().astype(np.float64) for g in self._step(raw_grads)]

    @property
    def exchanger(self):
        return self.optimizer.exchanger if self.api.startswith("keras") else self.tape.exchanger


def run(config, out: Path):
    rank = hvd.rank()
    compression = hs.Compression.create(config["method"], **config.get("options", {}))
    if "cost_model" in config:
        compression.cost_model = AlphaBeta(workers=hvd.size(), **config["cost_model"])
    if "local_cost" in config:
        compression.local_cost = LocalCost(**config["local_cost"])
    prefix = config.get("prefix", f"{config['name']}_p")  # variable names: p0, p1, ... after it
    trainer = Trainer(config, compression, stock=config.get("stock", False), prefix=prefix)
    if config.get("expect_error"):
        try:
            trainer.step(0)
            error = None
        except Exception as err:  # noqa: BLE001 (the test checks type and message)
            error = {"type": type(err).__name__, "message": str(err)}
        (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps({"error": error}))
        return
    stock = None
    if config.get("compare_stock"):
        stock = Trainer(config, compression, stock=True, prefix=f"{config['name']}_s")
    def indices(groups):
        return [[int(n[len(prefix):].split(":")[0]) for n in names] for names in groups]

    aggregated, stats, traces, step_groups = [], [], [], []
    for step in range(config["steps"]):
        step_groups.append(indices(trainer.next_groups()))
        aggregated.append(trainer.step(step))
        stats.append(trainer.exchanger.last_stats.as_dict())
        traces.append(trainer.traces)
        if stock is not None:
            stock.step(step)
    arrays = {f"agg_{t}_{i}": a for t, grads in enumerate(aggregated) for i, a in enumerate(grads)}
    arrays.update({f"param_{i}": v.numpy().astype(np.float64) for i, v in enumerate(trainer.variables)})
    arrays.update({f"residual_{j}": r.numpy().astype(np.float64)
                   for j, r in enumerate(trainer.exchanger.residuals().values())})
    if stock is not None:
        arrays.update({f"stock_{i}": v.numpy().astype(np.float64) for i, v in enumerate(stock.variables)})
    np.savez(out / f"{config['name']}.rank{rank}.npz", **arrays)
    scheduler = trainer.exchanger.mergecomp
    meta = {"groups": indices(trainer.exchanger.groups()), "step_groups": step_groups, "stats": stats, "traces": traces,
            "mergecomp": None if scheduler is None or scheduler.result is None else scheduler.result.as_dict()}
    (out / f"{config['name']}.rank{rank}.json").write_text(json.dumps(meta))


def main():
    configs, out = configs_and_out()
    init_tensorflow_worker("dynamic" if any(c.get("hierarchical") for c in configs) else None)
    for config in configs:
        run(config, out)
    # A two-tier step ends with the node's collectives: every rank finishes its last one before
    # any exits (Horovod shuts every rank down when one leaves; docs/two-tier.md).
    hvd.allreduce(tf.constant(0.0), name="hs.test.end", op=hvd.Sum)


if __name__ == "__main__":
    main()
