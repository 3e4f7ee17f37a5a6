"""Worker: the host reads of one training step, per method, as a GPU would make them (issue 29).

Every method trains given gradients (``given_gradients.py``) through ``hs.DistributedOptimizer``
with one group per tensor; after two steps (the state agreement and the first exchange are
behind), one step's ``step()`` runs inside
:func:`horovod_sparse.torch_core.selection.accelerator_paths` and :class:`tests.support.host_reads.HostReads`;
the same run on the host paths must give bitwise the same aggregates, residuals and statistics.
The gradients are set, not backpropagated, so that ``step()`` launches every group's exchange
itself, through the same code as the hooks (the autograd engine runs hooks outside Python's
function modes, where nothing would be counted). A config with ``nan_step`` puts a NaN in rank
1's first gradient at that step (policy ``"skip"``): the accelerators' paths decide finiteness on
the device and read it when the step ends; both paths must abandon the step alike (NaN
aggregates, the same residuals, the same warning). A config may set a method's ``capacity``.
With ``"grads": "in place"`` the loop zeroes the gradients in place (``zero_grad(set_to_none=False)``)
and writes the given ones into them, as backward accumulates: after the first step the ``.grad``
tensors are the views of the groups' buffers the optimizer published.
Record per config: the reads' names and the
number of operations dispatched (of the last step, a finite one), the number of groups, whether
both paths agreed (statistics' selected and union counts included), their warnings and the
groups' overflow counts.
"""
import contextlib
import math
import warnings
from typing import Any, Dict

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hs
from horovod_sparse.torch_core.selection import accelerator_paths
from tests.support.host_reads import DispatchedOps, HostReads
from tests.workers.cli import configs_and_out, write_record
from tests.workers.given_gradients import make_params, step_gradients


def run(config: Dict[str, Any], forced: bool) -> Dict[str, Any]:
    """``steps`` steps (3 by default); the last one's host reads (accelerators' paths ``forced``
    on CPU tensors or not), every step's aggregates, the final residuals and the warnings."""
    params = make_params(config["shapes"], 5, torch.float32)
    opt = hs.DistributedOptimizer(torch.optim.SGD(params, lr=0.01),
                                  named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                  compression=hs.Compression.create(config["method"], **config["options"]),
                                  groups=config.get("groups", "tensor"), nonfinite=config.get("nonfinite", "raise"))
    aggregates = []
    in_place = config.get("grads") == "in place"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(config.get("steps", 3)):
            opt.zero_grad(set_to_none=not in_place)
            for p, g in zip(params, step_gradients(params, 5, step, hvd.rank())):
                # no backward pass: step() launches every group itself, inside the count
                if in_place and p.grad is not None:
                    p.grad.copy_(g)
                else:
                    p.grad = g
            if step == config.get("nan_step") and hvd.rank() == 1:
                params[0].grad.view(-1)[0] = math.nan
            with accelerator_paths() if forced else contextlib.nullcontext(), HostReads() as reads, \
                    DispatchedOps() as ops:
                opt.step()
            aggregates.append([p.grad.clone() for p in params])
    assert opt.last_stats is not None and not any(g.dense for g in opt.last_stats.groups)
    return {"reads": reads.names, "ops": ops.count, "groups": len(opt.groups), "aggregates": aggregates,
            "residuals": list(opt.residuals().values()), "unions": [g.union for g in opt.last_stats.groups],
            "selected": [g.selected for g in opt.last_stats.groups],
            "overflow": [g.extra.get("overflow", 0) for g in opt.last_stats.groups],
            "warnings": [str(w.message) for w in caught]}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaNs in the same places."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def count(config: Dict[str, Any]) -> Dict[str, Any]:
    """The accelerators' paths' reads, and whether they computed bitwise what the host paths do
    (aggregates, residuals, union statistics)."""
    device, host = run(config, forced=True), run(config, forced=False)
    agree = (all(same(a, b) for step_a, step_b in zip(device["aggregates"], host["aggregates"])
                 for a, b in zip(step_a, step_b))
             and all(torch.equal(a, b) for a, b in zip(device["residuals"], host["residuals"]))
             and device["unions"] == host["unions"] and device["selected"] == host["selected"])
    return {"reads": device["reads"], "ops": device["ops"], "host_path_reads": len(host["reads"]),
            "groups": device["groups"], "overflow": device["overflow"], "host_overflow": host["overflow"],
            "same_as_host_paths": agree, "warnings": device["warnings"], "host_warnings": host["warnings"],
            "abandoned": [bool(step[0].isnan().all()) for step in device["aggregates"]],
            "last_aggregates": [a.tolist() for a in device["aggregates"][-1]]}


def main() -> None:
    configs, out = configs_and_out()
    hvd.init()
    torch.set_num_threads(1)
    for config in configs:
        write_record(out, config.get("name", config["method"]), hvd.rank(), {}, count(config))


if __name__ == "__main__":
    main()
