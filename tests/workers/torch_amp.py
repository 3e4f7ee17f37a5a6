"""Worker: the PyTorch training loops users write (issue 29), through Horovod's optimizer.

Scenarios (one JSON record and one ``.npz`` per config and rank, the test asserts on them):

* ``recipe``: Horovod's documented AMP recipe (``scaler.scale(loss).backward()``,
  ``synchronize()``, ``scaler.unscale_``, ``skip_synchronize()`` + ``scaler.step``,
  ``scaler.update``) with float16 autocast on CPU and a ``GradScaler`` whose first steps
  overflow (``init_scale`` far too large), run with the stock optimizer and with ours (the
  method, or Horovod's ``none``). Records per step the scale, whether the parameters moved,
  the loss, and the residuals' finiteness; the final parameters.
* ``units``: loss-scale units, exactly. Given gradients ``G_t`` (``given_gradients.py``) enter
  as ``S_t * G_t`` through a ``GradScaler`` whose scale is set to a power of two ``S_t`` that
  changes from step to step; the reference run feeds ``G_t`` without a scaler. Both record
  every step's unscaled aggregate, residuals and parameters (``scaled_*`` / ``plain_*``).
* ``layout``: ``channels_last`` and transposed parameters with fused AdamW, foreach AdamW or
  SGD, against the same parameters contiguous, both through ``hs.DistributedOptimizer`` on the
  same given gradients: the parameters after three steps (``strided_*`` / ``contiguous_*``)
  and whether every ``p.grad`` had ``p``'s strides after ``synchronize()``.
"""
import warnings
from typing import Any, Dict, List

import horovod.torch as hvd
import numpy as np
import torch

import horovod_sparse.torch as hs
from tests.support.amp_loop import regression_model, train
from tests.workers.cli import configs_and_out, init_torch_worker, write_record
from tests.workers.given_gradients import make_params, step_gradients


def compression(config: Dict[str, Any]) -> Any:
    if config["method"] == "none":
        return hvd.Compression.none
    return hs.Compression.create(config["method"], **config.get("options", {}))


# -- recipe ---------------------------------------------------------------------------------------
def recipe(config: Dict[str, Any], stock: bool) -> Dict[str, Any]:
    """Train ``config["steps"]`` steps with Horovod's AMP recipe (:func:`tests.support.amp_loop.train`)
    under ``config["autocast"]`` (float16 by default; bfloat16 runs with the scaler disabled, as
    users do); with ``config["pass_scaler"]`` false our optimizer is not given the scaler. Also
    records the warnings the run raised."""
    model = regression_model()
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dtype = getattr(torch, config.get("autocast", "float16"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** config["init_exponent"], growth_interval=4,
                                  enabled=dtype == torch.float16)
    if stock:
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        opt = hs.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression(config),
                                      loss_scaler=scaler if config.get("pass_scaler", True) else None)

    def step(loss: torch.Tensor) -> None:
        opt.zero_grad()
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = train(model, scaler, config["steps"], hvd.rank(), step,
                       lambda: [] if stock else list(opt.residuals().values()), dtype)
    return {**record, "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}


# -- units ----------------------------------------------------------------------------------------
def units(config: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
    """The given gradients through a loss scaler of changing scale, and without one."""
    for run in ("scaled", "plain"):
        params = make_params(config["shapes"], config["seed"], torch.float32)
        exponents = config["exponents"]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** exponents[0]) if run == "scaled" else None
        opt = hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                      named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                      compression=compression(config), groups="tensor", loss_scaler=scaler)
        for step in range(len(exponents)):
            opt.zero_grad()
            grads = step_gradients(params, config["seed"], step, hvd.rank())
            loss = sum((p * g).sum() for p, g in zip(params, grads))
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                opt.synchronize()
                scaler.unscale_(opt)
                with opt.skip_synchronize():
                    scaler.step(opt)
                scaler.update(2.0 ** exponents[(step + 1) % len(exponents)])  # the next step's scale
            for i, (p, residual) in enumerate(zip(params, opt.residuals().values())):
                arrays[f"{run}_agg_{step}_{i}"] = p.grad.numpy().copy()
                arrays[f"{run}_residual_{step}_{i}"] = residual.numpy().copy()
                arrays[f"{run}_param_{step}_{i}"] = p.detach().numpy().copy()


# -- layout ---------------------------------------------------------------------------------------
LAYOUT_SHAPES = [[8, 3, 3, 3], [8], [7, 5], [4, 8, 3, 3]]

OPTIMIZERS = {"adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
              "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, foreach=False)}


def layout_params(strided: bool) -> List[torch.nn.Parameter]:
    """The parameters of :data:`LAYOUT_SHAPES`, same values either way; with ``strided`` the 4-D
    ones are ``channels_last`` and the matrix is stored transposed (dense, not contiguous)."""
    params = make_params(LAYOUT_SHAPES, 4, torch.float32)
    if not strided:
        return params
    return [torch.nn.Parameter(p.detach().contiguous(memory_format=torch.channels_last)) if p.dim() == 4
            else torch.nn.Parameter(p.detach().t().contiguous().t()) if p.dim() == 2 else p for p in params]


def layout(config: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> Dict[str, Any]:
    """Three steps on given gradients with strided and with contiguous parameters; whether the
    gradients kept their parameters' strides."""
    strides_kept = True
    for run in ("strided", "contiguous"):
        params = layout_params(run == "strided")
        opt = hs.DistributedOptimizer(OPTIMIZERS[config["optimizer"]](params),
                                      named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                      compression=compression(config))
        for step in range(3):
            opt.zero_grad()
            grads = step_gradients(params, 4, step, hvd.rank())
            sum((p * g).sum() for p, g in zip(params, grads)).backward()
            opt.synchronize()
            strides_kept &= all(p.grad.stride() == p.stride() for p in params)
            with opt.skip_synchronize():
                opt.step()
        for i, p in enumerate(params):
            arrays[f"{run}_{i}"] = p.detach().contiguous().numpy()
    return {"strides_kept": strides_kept}


def main() -> None:
    configs, out = configs_and_out()
    init_torch_worker(reproducible_sums=True)
    for config in configs:
        arrays: Dict[str, np.ndarray] = {}
        record: Dict[str, Any] = {}
        if config["scenario"] == "recipe":
            record = {"stock": recipe(config, stock=True), "ours": recipe(config, stock=False)}
        elif config["scenario"] == "units":
            units(config, arrays)
        else:
            record = layout(config, arrays)
        write_record(out, config["name"], hvd.rank(), arrays, record)


if __name__ == "__main__":
    main()
