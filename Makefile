# The two commands of the README. Each one installs what is missing first (scripts/install.sh is
# idempotent: seconds when everything is there). `make demo` installs only what the main job needs
# (PyTorch and Horovod's PyTorch front end: install.sh core); the other targets install everything.
VENV ?= .venv
NP ?= 2
# HOSTS=localhost:2,127.0.0.1:2 puts the main job on two hosts of this machine (two-tier rows).
HOSTS ?=
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
# TensorFlow's C++ start-up lines (CPU features, oneDNN) say nothing to a user: the install's
# `horovodrun --check-build` and the TensorFlow jobs would print them.
export TF_CPP_MIN_LOG_LEVEL ?= 2
# TensorFlow >= 2.16's tf.keras is Keras 3 unless this makes it tf-keras (Keras 2), which
# Horovod 0.28.1's Keras layer and the suite's Keras 2 tests need (tests/tensorflow/test_keras3.py runs
# its workers without it, under Keras 3).
export TF_USE_LEGACY_KERAS ?= 1

.PHONY: install install-core demo lint docs test mutations gpu-build

install:
	bash scripts/install.sh full

install-core:
	bash scripts/install.sh core

# The main job: dense Horovod and every sparse method trained on scikit-learn's digits in one
# NP-worker horovodrun job (CPU, Gloo), measured, projected to 1 and 10 Gbit/s clusters by the
# scaling model, and a recommendation (`python -m benchmarks.main_job.digits --help` lists the ARGS;
# `ARGS="--framework tensorflow"` installs everything first).
demo: $(if $(findstring tensorflow,$(ARGS)),install,install-core)
	$(PY) -m benchmarks.main_job.digits $(if $(HOSTS),--hosts $(HOSTS),--np $(NP)) $(ARGS)

# The linter (ruff.toml) over the package, the tests and the benchmarks; `make test` runs it first.
lint: install
	$(VENV)/bin/ruff check horovod_sparse tests benchmarks

# The docs site (mkdocs.yml, docs/) built into site/, strict: a broken link or API reference fails.
docs: install
	$(VENV)/bin/mkdocs build --strict --site-dir site

test: lint docs
	$(PY) -m pytest -q tests $(ARGS)

# Horovod's NCCL build (not part of `make test`; no GPU needed to build it): its own venv
# ($(GPU_VENV)) with PyTorch's CUDA wheel (`===` refuses the +cpu build), the CUDA toolkit and NCCL
# from the package index at the versions that wheel pins (scripts/install.sh,
# cuda_from_the_package_index), kernels for compute capabilities 8.0 and 9.0, PyTorch only
# (docs/versions.md says why not TensorFlow); then the Horovod PyTorch front end's tests on the CPU
# (those importing TensorFlow left out: this build has none).
GPU_VENV ?= .venv-gpu
gpu-build:
	HS_VENV=$(GPU_VENV) HS_TORCH_SPEC="torch===2.13.0" HOROVOD_GPU_OPERATIONS=NCCL \
		HOROVOD_BUILD_CUDA_CC_LIST=80,90 bash scripts/install.sh core
	$(GPU_VENV)/bin/python -m pip install -q pytest hypothesis
	$(GPU_VENV)/bin/python -m pytest -q tests/torch/test_api.py tests/torch/test_topk.py -k "not tensorflow" $(ARGS)

# The mutation check (not part of `make test`): every break of scripts/mutations.py applied to a
# copy of HEAD in turn, its tests run there; prints caught or survived (and by which test) per
# break and exits non-zero when one survives (`ARGS="--only NAME ..."`, `--list`, `--jobs N`).
mutations: install
	$(PY) scripts/mutations.py --results results/mutations.json $(ARGS)
