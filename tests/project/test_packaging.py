"""The package as users install it: ``pyproject.toml`` builds an sdist and a wheel with
``python -m build``, and the wheel, installed into a fresh virtual environment that holds
PyTorch and nothing else of the stack (no Horovod, no TensorFlow), runs a two-process DDP
comm-hook job under that environment's ``torchrun`` (``tests/workers/ddp_installed.py``)."""
from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import horovod_sparse
from tests.support.launch import HANG_TIMEOUT, WORKERS

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = ROOT / "horovod_sparse"
MODULES = {f"horovod_sparse/{p.relative_to(PACKAGE).as_posix()}" for p in PACKAGE.rglob("*.py")}
EXTRAS = {"torch", "tensorflow", "test"}


def run(command, **kwargs) -> subprocess.CompletedProcess:
    """``command`` with its output captured; raise with the output's tail on failure."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_TIMEOUT, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, command))} exited {result.returncode}\n" + (
        result.stdout[-3000:] + result.stderr[-3000:])
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """``python -m build`` (isolated, as a release would run it) on a copy of what the sdist
    needs, so that nothing is written into the repository; the folder with both archives."""
    source = tmp_path_factory.mktemp("source")
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copy(ROOT / "README.md", source)
    shutil.copytree(PACKAGE, source / "horovod_sparse", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", str(out), str(source)])
    return out


def only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"{pattern} in {folder}: {found}"
    return found[0]


def test_wheel_and_sdist_carry_every_module_and_the_metadata(built):
    wheel = only(built, "horovod_sparse-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_string(archive.read(info).decode())
    assert MODULES <= names, sorted(MODULES - names)
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "scripts/"))]
    assert metadata["Version"] == horovod_sparse.__version__  # one version string, the package's
    assert set(metadata.get_all("Provides-Extra")) >= EXTRAS
    requires = metadata.get_all("Requires-Dist")
    assert "numpy" in requires and not [r for r in requires if r.startswith("horovod")]
    assert metadata["License-Expression"] == "Apache-2.0"
    with tarfile.open(only(built, f"horovod_sparse-{horovod_sparse.__version__}.tar.gz")) as archive:
        inside = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md"} <= inside and MODULES <= inside


def test_wheel_with_pytorch_only_runs_the_ddp_hook(built, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python, torchrun = venv / "bin" / "python", venv / "bin" / "torchrun"
    # This stack's PyTorch build (its exact version: a bare requirement could pull another
    # build), and the wheel with its own dependencies.
    run([str(python), "-m", "pip", "install", "-q", f"torch=={torch.__version__}",
         str(only(built, "*.whl"))])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = tmp_path / "out"
    out.mkdir()
    # Run from tmp_path with a copy of the worker: the repository is nowhere on the path.
    worker = shutil.copy(WORKERS / "ddp_installed.py", tmp_path)
    run([str(torchrun), "--standalone", "--nproc-per-node", "2", worker, str(out)], cwd=tmp_path, env=env)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for record in records:
        assert Path(record["package_file"]).is_relative_to(venv), record["package_file"]
        assert record["version"] == horovod_sparse.__version__
        assert record["importable"] == {"horovod": False, "tensorflow": False, "tests": False, "numpy": True}
        assert record["replicas_identical"] and record["finite"] and record["moved"] > 0, record
        first, *sparse_steps = record["steps"]
        assert all(g["dense"] for g in first)  # the warm-up step
        for groups in sparse_steps:
            for g in groups:
                assert not g["dense"] and 0 < g["union"] <= 2 * g["target"] < g["numel"], groups
    assert records[0]["steps"] == records[1]["steps"]
