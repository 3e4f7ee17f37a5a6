"""Worker: NaN/Inf gradients on any rank for every method, TensorFlow front end
(``tests/support/nonfinite_faults.py``); the counterpart of ``torch_nonfinite.py``.

A config is a method, the ``runs`` to make (pairs of an API of
``tests.workers.tf_reliability.Trainer`` and a policy) and the API of its reference run. The
APIs: the tape eager (``"tape"``), the tape inside a ``tf.function`` (``"tape_function"``) or
the Keras wrapper (``"keras"``, eager ``compute_gradients`` + ``apply_gradients``, which skips
an abandoned step's update itself; with the tape the trainer skips ``apply_gradients`` when
``last_stats.abandoned``). Each config trains on every rank, from the same start:

* one *faulted* run per entry of ``runs``, named ``{api}_{policy}``: the poisoned gradients;
  records, step by step, what the step raised or warned, ``last_stats.abandoned``, the
  optimizer's ``iterations``, the variables, the residuals and the delivered gradients;
* the *reference* run: at each faulted step nothing is exchanged (the documented abandoned
  step), every sparse group's residual becomes what it held before the step plus this step's
  kept gradient (this rank's non-finite gradients dropped) and the step counter advances,
  through the exchanger's ``state_dict`` / ``load_state_dict``; healthy steps are ordinary.

Records: ``{name}.rank{r}.json`` and ``{name}.rank{r}.npz``, as ``torch_nonfinite.py`` writes them.
Horovod's tensor fusion is off, as there.
"""
import io
import json
import os
import warnings
from typing import Any, Dict, List

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from tests.support import nonfinite_faults as faults
from tests.workers.cli import configs_and_out, init_tensorflow_worker
from tests.workers.tf_reliability import Trainer


def build(config: Dict[str, Any], run: str, api: str, policy: str) -> Trainer:
    """A trainer of its own (variables, optimizer, exchanger) for ``run`` through ``api`` under
    ``policy``, at the default density and ``min_numel`` with warm-up, one group per variable."""
    options = {"density": 0.01, "min_numel": faults.MIN_NUMEL, "warmup_steps": faults.WARMUP,
               **config.get("options", {})}
    settings = dict(config, prefix=f"{config['name']}_{run}", api=api, shapes=faults.SHAPES, options=options)
    # A stats log of its own gives the tape an exchanger of its own (they are cached by arguments).
    return Trainer(settings, nonfinite=policy, groups="tensor", stats_log=io.StringIO())


def raw_gradients(step: int, drop: bool) -> List[tf.Tensor]:
    """``faults.gradient(step, rank, i)`` as float32; with ``drop`` the non-finite ones are zeros."""
    dropped = faults.poisoned(step, hvd.rank()) if drop else set()
    return [tf.zeros(shape) if i in dropped else tf.constant(faults.gradient(step, hvd.rank(), i), tf.float32)
            for i, shape in enumerate(faults.SHAPES)]


def record(arrays: Dict[str, np.ndarray], run: str, step: int, trainer: Trainer, grads: Any) -> None:
    residuals = [r.numpy() for r in trainer.exchanger.residuals().values()]
    for i, v in enumerate(trainer.variables):
        arrays[f"{run}_param_{step}_{i}"] = v.numpy()
        arrays[f"{run}_residual_{step}_{i}"] = residuals[i]
        if grads is not None:
            delivered = np.full(v.shape, np.nan, np.float32) if grads is False else grads[i].numpy()
            arrays[f"{run}_grad_{step}_{i}"] = delivered


def faulted(config: Dict[str, Any], api: str, policy: str, arrays: Dict[str, np.ndarray]) -> List[Dict[str, Any]]:
    run = f"{api}_{policy}"
    trainer = build(config, run, api, policy)
    steps = []
    for step in range(faults.STEPS):
        seen: Dict[str, Any] = {"raised": None}
        grads: Any = False  # nothing delivered when the step raised: recorded as NaN, as abandoned
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                grads = trainer.step(raw_gradients(step, drop=False))
            except (FloatingPointError, tf.errors.OpError) as err:
                seen["raised"] = f"{type(err).__name__}: {err}"
        seen["warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        seen["abandoned"] = trainer.exchanger.last_stats.abandoned
        seen["iterations"] = int(trainer.optimizer.iterations)
        steps.append(seen)
        record(arrays, run, step, trainer, grads)
    return steps


def reference(config: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> List[int]:
    trainer = build(config, "reference", config["api"], "raise")
    iterations = []
    for step in range(faults.STEPS):
        if step not in faults.FAULTS:
            trainer.step(raw_gradients(step, drop=False))
        else:
            exchanger = trainer.exchanger
            before = list(exchanger.residuals().values())
            kept = raw_gradients(step, drop=True)
            state = exchanger.state_dict()
            (layout,) = state["layouts"]
            for i, group in enumerate(layout["groups"].values()):
                if not faults.dense(step, i, config["method"]):
                    group["residual"] = (before[i] + tf.cast(tf.reshape(kept[i], [-1]), before[i].dtype)).numpy()
            layout["steps"] += 1
            exchanger.load_state_dict(state)
        iterations.append(int(trainer.optimizer.iterations))
        record(arrays, "reference", step, trainer, None)
    return iterations


def main() -> None:
    configs, out = configs_and_out()
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    init_tensorflow_worker()
    for config in configs:
        arrays: Dict[str, np.ndarray] = {}
        seen: Dict[str, Any] = {f"{api}_{policy}": faulted(config, api, policy, arrays)
                                for api, policy in config["runs"]}
        seen["reference_iterations"] = reference(config, arrays)
        np.savez(out / f"{config['name']}.rank{hvd.rank()}.npz", **arrays)
        (out / f"{config['name']}.rank{hvd.rank()}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
