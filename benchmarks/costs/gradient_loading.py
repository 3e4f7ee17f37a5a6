"""How a group's gradients are best added into its residual on a CPU: staged in one flat buffer
first, or each where it lies; what sets ``horovod_sparse.torch_core.buffers.ADD_IN_PLACE_FROM``.

    python -m benchmarks.costs.gradient_loading [--models digits resnet20 resnet50 vgg] [--repeats 15] \
        [--results results/gradient_loading.json]

One process, one thread (``torch.set_num_threads(1)``). Per model
(:mod:`benchmarks.shared.models`; ``digits`` is the main job's MLP), its parameters as one
:class:`~horovod_sparse.torch_core.buffers.FlatGroup` (what a flat bucket of the Horovod optimizer
holds), random gradients, and the Horovod optimizer's default check (``nonfinite="raise"``:
:func:`~horovod_sparse.torch_core.tensor_backend.all_finite`). Side by side and interleaved
(medians of ``--repeats`` of the process's CPU time, so that other load on a shared machine does
not count; only the ratio is meant to be read), ``FlatGroup.load_gradients`` with the group's
``adds_in_place`` forced each way:

* ``staged``: every gradient copied into the group's flat output buffer, one check of the buffer,
  one addition into the residual;
* ``in place``: one check and one addition per gradient, into its slice of the residual;

each followed by the zeroing of the output that the exchange does next. ``in place / staged``
is below 1 where adding in place is faster; ``picks`` says which the group takes by itself. Both
are checked once to leave the same residual, bitwise.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from benchmarks.costs.top_k_paths import interleaved_medians
from benchmarks.shared.models import digits_mlp, model_spec
from horovod_sparse.torch_core.buffers import ADD_IN_PLACE_FROM, FlatGroup
from horovod_sparse.torch_core.tensor_backend import all_finite

DEFAULT_MODELS = ["digits", "resnet20", "resnet50", "vgg"]


def parameters(name: str) -> List[torch.nn.Parameter]:
    """The parameters of model ``name`` (``digits``: the main job's MLP), built with seed 0."""
    torch.manual_seed(0)
    if name == "digits":
        return list(digits_mlp().parameters())
    spec = model_spec(name)
    return list(spec.build(spec.default_size).parameters())


def loading(params: List[torch.nn.Parameter], in_place: bool) -> Callable[[], torch.Tensor]:
    """A step's loading of ``params``' gradients into a group of them (``adds_in_place`` set to
    ``in_place``), from a residual of zeros at every call; returns the residual."""
    group = FlatGroup(0, [str(i) for i in range(len(params))], params)
    group.adds_in_place = in_place

    def run() -> torch.Tensor:
        if group.residual is not None:
            group.residual.zero_()
        residual = group.load_gradients(lambda tensors: all_finite(*tensors))
        group.zeroed_output()
        return residual
    return run


def row(name: str, repeats: int) -> Dict[str, object]:
    """The medians of both ways on model ``name``, interleaved, and their ratio."""
    params = parameters(name)
    generator = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    staged, in_place = interleaved_medians([loading(params, False), loading(params, True)], repeats,
                                           f"the two ways left different residuals on {name}")
    numel = sum(p.numel() for p in params)
    picks = FlatGroup(0, [str(i) for i in range(len(params))], params).adds_in_place
    return {"model": name, "tensors": len(params), "numel": numel, "staged_ms": staged, "in_place_ms": in_place,
            "in_place_over_staged": in_place / staged, "picks": "in place" if picks else "staged"}


def print_rows(rows: List[Dict[str, object]], repeats: int) -> None:
    print(f"CPU ms of loading a group's gradients, medians of {repeats}; ADD_IN_PLACE_FROM = {ADD_IN_PLACE_FROM:,} "
          "elements per parameter")
    print(f"{'model':>9} {'tensors':>8} {'elements':>11} {'per tensor':>11} {'staged ms':>10} {'in place ms':>12} "
          f"{'in place/staged':>16} {'picks':>9}")
    for r in rows:
        print(f"{r['model']:>9} {r['tensors']:>8} {r['numel']:>11,} {r['numel'] // r['tensors']:>11,} "
              f"{r['staged_ms']:>10.3f} {r['in_place_ms']:>12.3f} {r['in_place_over_staged']:>16.2f} {r['picks']:>9}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--results", type=Path, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row(name, args.repeats) for name in args.models]
    print_rows(rows, args.repeats)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"benchmark": "gradient_loading", "rows": rows}, indent=1))
        print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
