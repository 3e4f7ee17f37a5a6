"""What SparseLoCo's payload costs the host to make and to read, against a read pass of the buffer.

    python -m benchmarks.costs.sparseloco_wire [--numel 85002 6400000 25600000] [--density 0.015625] \\
        [--workers 2] [--repeats 9] [--results FILE]

One process, one thread, PyTorch's CPU paths. For each ``--numel``, a float32 buffer of normal
elements and SparseLoCo's selection at ``--density`` in chunks of 4,096 (``m`` indices; the
default density is the paper's 64 of 4,096, so ``m`` is ``numel / 64``); then, side by side and
interleaved (medians of ``--repeats``, CPU time), each step of the payload as
:class:`~horovod_sparse.methods.sparseloco.SparseLoCo`'s exchange takes it:

* ``sum``: ``x.sum()``, a read pass over the buffer (the scale of the others);
* ``quantize``: the 2-bit statistical quantizer of the ``m`` selected values
  (:func:`~horovod_sparse.methods.sparseloco.quantize`);
* ``pack codes`` / ``unpack codes``: the codes packed four to a byte; unpacked for ``--workers``
  rows, as every rank unpacks every rank's;
* ``pack offsets`` / ``unpack offsets``: the indices as 12-bit offsets inside their chunks, packed;
  unpacked for ``--workers`` rows to the global indices.

The defaults: the main job's buffer (the digits MLP), a ResNet-50 bucket of DDP's 25 MB and the
whole of ResNet-50. CPU times are only meaningful as ratios measured in the same run.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from benchmarks.costs.selection_cost import time_side_by_side
from benchmarks.shared.results import command_line, write_results
from horovod_sparse.methods.sparseloco import chunk_counts, offset_width, quantize
from horovod_sparse.torch import backend as B

#: The chunk length (SparseLoCo's default), the codes' width and the quantizer's range.
CHUNK, BITS, SPREAD = 4096, 2, 6.0
#: The steps of the payload timed, in the table's order.
STEPS = ("quantize", "pack codes", "unpack codes", "pack offsets", "unpack offsets")


def payload_steps(x: torch.Tensor, density: float, workers: int) -> Tuple[int, Dict[str, Callable[[], object]]]:
    """SparseLoCo's count ``m`` of ``x`` and the callables of ``sum`` and each of :data:`STEPS`
    on its selection from ``x``."""
    full, k, _, k_last = chunk_counts(density, x.numel(), CHUNK)
    m, width = full * k + k_last, offset_width(CHUNK)
    idx = B.top_k_chunks(x, CHUNK, k, k_last)
    values = x[idx]
    codes, _ = quantize(B, values, BITS, SPREAD)
    packed_codes = torch.cat([B.pack_codes(codes, BITS)] * workers)
    packed_offsets = torch.cat([B.pack_offsets(idx, CHUNK, width)] * workers)
    return m, {"sum": x.sum,
               "quantize": lambda: quantize(B, values, BITS, SPREAD),
               "pack codes": lambda: B.pack_codes(codes, BITS),
               "unpack codes": lambda: B.unpack_codes(packed_codes, BITS, m),
               "pack offsets": lambda: B.pack_offsets(idx, CHUNK, width),
               "unpack offsets": lambda: B.unpack_offsets(packed_offsets, CHUNK, k, width, m)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, nargs="+", default=[85_002, 6_400_000, 25_600_000])
    p.add_argument("--density", type=float, default=1 / 64)
    p.add_argument("--workers", type=int, default=2, help="the rows unpacked (every rank's payload)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, help="write the figures as JSON here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    print(f"SparseLoCo's payload at density {args.density} in chunks of {CHUNK}, {args.workers} rows unpacked, "
          f"1 thread, medians of {args.repeats} (CPU time): ms, and / the read pass")
    print(f"{'numel':>10s} {'m':>8s} {'sum ms':>7s}" + "".join(f"{name:>19s}" for name in STEPS))
    rows: List[Dict[str, float]] = []
    for numel in args.numel:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(args.seed))
        m, steps = payload_steps(x, args.density, args.workers)
        seconds = time_side_by_side(steps, args.repeats)
        row = {"numel": numel, "m": m, **{f"{name}_ms": 1e3 * value for name, value in seconds.items()},
               **{f"{name}_over_sum": seconds[name] / seconds["sum"] for name in STEPS}}
        rows.append(row)
        print(f"{numel:10d} {m:8d} {row['sum_ms']:7.2f}"
              + "".join(f"{row[name + '_ms']:11.2f} {row[name + '_over_sum']:7.2f}" for name in STEPS))
    if args.results:
        write_results(args.results, "sparseloco_wire", {"density": args.density, "workers": args.workers,
                                                         "rows": rows}, command_line(argv, __name__))


if __name__ == "__main__":
    main()
