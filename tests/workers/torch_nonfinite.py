"""Worker: NaN/Inf gradients on any rank for every method (``tests/support/nonfinite_faults.py``).

Each config (a method) trains three times on every rank, from the same start:

* two *faulted* runs, one per policy (``"raise"``, ``"skip"``), feed the poisoned gradients and
  record, step by step, what ``step()`` raised or warned, ``last_stats.abandoned``, the
  parameters, the residuals and the delivered (aggregated) gradients;
* the *reference* run feeds, at each faulted step, the gradients as the policy documents them
  (this rank's non-finite ones dropped, i.e. zeros), lets ``synchronize()`` exchange them, does
  not call ``step()`` (no update), and sets every sparse group's residual to what it held
  before the step plus this step's kept gradient (through ``state_dict`` / ``load_state_dict``);
  healthy steps are ordinary steps. It records the same parameters and residuals.

Records: ``{name}.rank{r}.json`` (per policy, per step: raised, warned, abandoned) and
``{name}.rank{r}.npz`` (``{run}_{what}_{step}_{parameter}``, ``run`` a policy or ``reference``).
Horovod's tensor fusion is off: the boundaries of a fused buffer depend on timing and change
the order in which a dense allreduce sums, so two runs would differ in the last bit.
"""
import warnings
from typing import Any, Dict, List

import horovod.torch as hvd
import numpy as np
import torch

import horovod_sparse.torch as hs
from tests.support import nonfinite_faults as faults
from tests.workers.cli import configs_and_out, init_torch_worker, write_record
from tests.workers.torch_reliability import make_params


POLICIES = ("raise", "skip")


def build(config: Dict[str, Any], policy: str):
    """Fresh parameters (the same on every rank and run) and their wrapped SGD with momentum (a
    zero-gradient update would still move them), one group per tensor."""
    params = make_params(faults.SHAPES, seed=3)
    method = config["method"]
    compression = (hvd.Compression.none if method == "none" else
                   hs.Compression.create(method, warmup_steps=faults.WARMUP, **config.get("options", {})))
    opt = hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9),
                                  named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                  compression=compression, groups="tensor", nonfinite=policy)
    assert opt.groups == [[f"p{i}"] for i in range(len(params))], opt.groups  # group i is parameter i
    return params, opt


def backward(params: List[torch.Tensor], step: int, drop: bool) -> None:
    """Gradients ``faults.gradient(step, rank, i)``; with ``drop`` the non-finite ones are zeros."""
    dropped = faults.poisoned(step, hvd.rank()) if drop else set()
    terms = [(p * (torch.zeros_like(p) if i in dropped else
                   torch.from_numpy(faults.gradient(step, hvd.rank(), i)).to(p.dtype))).sum()
             for i, p in enumerate(params)]
    sum(terms).backward()


def record(arrays: Dict[str, np.ndarray], run: str, step: int, params, opt, grads: bool) -> None:
    residuals = list(opt.residuals().values())
    for i, p in enumerate(params):
        arrays[f"{run}_param_{step}_{i}"] = p.detach().numpy().copy()
        arrays[f"{run}_residual_{step}_{i}"] = residuals[i].numpy().copy()
        if grads:
            arrays[f"{run}_grad_{step}_{i}"] = p.grad.numpy().copy()


def faulted(config: Dict[str, Any], policy: str, arrays: Dict[str, np.ndarray]) -> List[Dict[str, Any]]:
    params, opt = build(config, policy)
    steps = []
    for step in range(faults.STEPS):
        opt.zero_grad()
        backward(params, step, drop=False)
        seen: Dict[str, Any] = {"raised": None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt.step()
            except FloatingPointError as err:
                seen["raised"] = str(err)
        seen["warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        seen["abandoned"] = opt.last_stats.abandoned
        steps.append(seen)
        record(arrays, policy, step, params, opt, grads=True)
    return steps


def reference(config: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
    params, opt = build(config, "raise")
    for step in range(faults.STEPS):
        opt.zero_grad()
        if step not in faults.FAULTS:
            backward(params, step, drop=False)
            opt.step()
        else:
            before = [r.clone() for r in opt.residuals().values()]
            backward(params, step, drop=True)
            opt.synchronize()  # the exchange runs on the documented gradients; no step(): no update
            state = opt.state_dict()
            for i, group in enumerate(state["horovod_sparse"]["groups"].values()):
                if not faults.dense(step, i, config["method"]):
                    kept = faults.kept(step, hvd.rank(), i, config["method"])
                    gradient = torch.from_numpy(faults.gradient(step, hvd.rank(), i)).to(before[i].dtype)
                    group["residual"] = before[i] + gradient.reshape(-1) if kept else before[i]
            opt.load_state_dict(state)
        record(arrays, "reference", step, params, opt, grads=False)


def main() -> None:
    configs, out = configs_and_out()
    init_torch_worker(reproducible_sums=True)
    for config in configs:
        arrays: Dict[str, np.ndarray] = {}
        seen = {policy: faulted(config, policy, arrays) for policy in POLICIES}
        reference(config, arrays)
        write_record(out, config["name"], hvd.rank(), arrays, seen)


if __name__ == "__main__":
    main()
