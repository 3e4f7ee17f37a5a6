"""What keeping the outer state off the device costs (``OuterSteps(offload=True)``): the anchor
and the outer optimizer's state in CPU memory (pinned on a GPU) against both on the model's
device, side by side in one process.

    python -m benchmarks.outer.offload_cost [--device cpu|cuda] [--width 2048] [--layers 4] [--rounds 20]

One process, a Gloo group of one (no link: what is measured is the round boundary's own work:
the pseudo-gradient, the exchange's local part, the outer step, the anchor and parameters moved).
The model is an MLP of ``--layers`` square ``--width`` layers; DiLoCo's dense exchange
(``Compression.none``) and its Nesterov outer optimizer, one inner SGD step a round
(``every=1``), so every step is a boundary. The two settings alternate round by round (A, B, B,
A, ...), each timing its boundaries (medians, milliseconds). Memory: the bytes the outer state
holds (the anchor and the optimizer's tensors) on the device and on the host, read from the
tensors after the last round; on a GPU also the peak device memory a boundary adds above what the
step before it held (``torch.cuda.max_memory_allocated``). Prints a table, ``--results FILE``
writes the rows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

import horovod_sparse.outer as hso


def mlp(width: int, layers: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)


def state_bytes(outer: hso.OuterSteps) -> Dict[str, int]:
    """Bytes of the outer state (anchor and outer optimizer's tensors) per device type."""
    held: Dict[str, int] = {}
    tensors = list(outer.anchor.flat)
    tensors += [v for state in outer.outer_optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0]
    for t in tensors:
        held[t.device.type] = held.get(t.device.type, 0) + t.numel() * t.element_size()
    return held


class Setting:
    """One model, inner optimizer and :class:`OuterSteps` (``offload`` or not); :meth:`round`
    takes one inner step (a boundary) and returns its seconds and peak device bytes added."""

    def __init__(self, offload: bool, args: argparse.Namespace) -> None:
        self.offload, self.device = offload, args.device
        self.model = mlp(args.width, args.layers, args.device)
        self.inner = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.outer = hso.OuterSteps(self.model, self.inner, hso.Compression.none, every=1, offload=offload)
        self.x = torch.randn(args.batch_size, args.width, device=args.device)
        self.seconds: List[float] = []
        self.peaks: List[int] = []

    def round(self) -> None:
        self.outer.zero_grad()
        self.model(self.x).square().mean().backward()
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        self.outer.step()
        if cuda:
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated() - before)
        self.seconds.append(time.perf_counter() - start)

    def row(self) -> Dict[str, Any]:
        held = state_bytes(self.outer)
        parameters = sum(p.numel() for p in self.model.parameters())
        return {"offload": self.offload, "device": self.device, "parameters": parameters,
                "boundary_ms": 1e3 * statistics.median(self.seconds),
                "state_device_mb": held.get(self.device, 0) / 1e6 if self.device != "cpu" else None,
                "state_host_mb": held.get("cpu", 0) / 1e6,
                "boundary_peak_device_mb": statistics.median(self.peaks) / 1e6 if self.peaks else None}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per setting")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds per setting first")
    p.add_argument("--results", type=Path, help="write the rows as JSON")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    from benchmarks.shared.results import command_line, write_results

    args = parser().parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    settings = [Setting(False, args), Setting(True, args)]
    for _ in range(args.warmup):
        for setting in settings:
            setting.round()
    for setting in settings:
        setting.seconds.clear()
        setting.peaks.clear()
    for i in range(args.rounds):
        for setting in (settings if i % 2 == 0 else settings[::-1]):
            setting.round()
    rows = [s.row() for s in settings]
    dist.destroy_process_group()
    print(f"{rows[0]['parameters'] / 1e6:.1f} M parameters on {args.device}; medians of {args.rounds} "
          f"boundaries (every=1), ms; the outer state's MB")
    print(f"{'offload':>8} {'boundary':>9} {'device MB':>10} {'host MB':>8} {'peak add MB':>11}")
    for r in rows:
        device = "-" if r["state_device_mb"] is None else f"{r['state_device_mb']:.1f}"
        peak = "-" if r["boundary_peak_device_mb"] is None else f"{r['boundary_peak_device_mb']:.1f}"
        print(f"{str(r['offload']):>8} {r['boundary_ms']:9.2f} {device:>10} {r['state_host_mb']:8.1f} {peak:>11}")
    print(f"offload / on the device, boundary time: {rows[1]['boundary_ms'] / rows[0]['boundary_ms']:.2f}x")
    if args.results:
        write_results(args.results, "outer_offload_cost", rows, command_line(argv, "benchmarks.outer.offload_cost"))


if __name__ == "__main__":
    main(sys.argv[1:])
