"""What every benchmark shares: result files that say where and how they were made, and a
progress line for long runs.

Result files are JSON objects ``{"benchmark", "command", "machine", "results": ...}`` under
``results/`` (git-ignored); the tables of docs/benchmarks.md are made from them.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, TextIO

#: Default directory for result files, relative to the working directory.
RESULTS_DIR = Path("results")


def machine() -> Dict[str, Any]:
    """The machine and software a result was measured with (``horovod`` None where it is not
    installed: the GPU check needs PyTorch alone)."""
    import torch

    try:
        import horovod
        horovod_version: Optional[str] = horovod.__version__
    except ImportError:
        horovod_version = None

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "horovod": horovod_version,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def command_line(argv: Optional[Sequence[str]] = None, module: Optional[str] = None) -> str:
    """The command that reproduces this run (``python -m <module> <args>``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    head = f"python -m {module}" if module else shlex.quote(sys.argv[0])
    return " ".join([head, *map(shlex.quote, args)])


def write_results(path: Path, benchmark: str, results: Any, command: str) -> Path:
    """Write ``results`` with the command and machine description as JSON; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": benchmark, "command": command, "machine": machine(), "results": results}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def read_results(path: Path) -> Any:
    """The ``results`` part of a file written by :func:`write_results`."""
    return json.loads(Path(path).read_text())["results"]


class Progress:
    """A one-line-per-item progress display with elapsed time and a naive ETA, on stderr.

    ``with Progress(total, "cluster") as progress: ... progress.done("n=2 topk", "12.3 img/s")``
    """

    def __init__(self, total: int, label: str, stream: TextIO = sys.stderr) -> None:
        self.total = total
        self.label = label
        self.stream = stream
        self.count = 0
        self.start = time.monotonic()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stream.write(f"[{self.label}] {self.count}/{self.total} done in {_clock(self._elapsed())}\n")
        self.stream.flush()

    def _elapsed(self) -> float:
        return time.monotonic() - self.start

    def starting(self, item: str) -> None:
        """Announce the next item (long items otherwise look like a hang)."""
        self.stream.write(f"[{self.label}] {self.count + 1}/{self.total} {item} ...\n")
        self.stream.flush()

    def done(self, item: str, outcome: str = "") -> None:
        """Mark one item finished, with a short outcome."""
        self.count += 1
        elapsed = self._elapsed()
        eta = elapsed / self.count * (self.total - self.count)
        self.stream.write(f"[{self.label}] {self.count}/{self.total} {item}: {outcome} "
                          f"(elapsed {_clock(elapsed)}, eta {_clock(eta)})\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s"
