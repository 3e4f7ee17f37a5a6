# The two commands of the README. Each one installs what is missing first (scripts/install.sh is
# idempotent: seconds when everything is there, about 15 minutes on a fresh machine).
VENV ?= .venv
NP ?= 2
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test

install:
	bash scripts/install.sh

# The main job: a real NP-worker horovodrun training run (CPU, Gloo) on scikit-learn's digits,
# dense Horovod and the sparse methods side by side.
demo: install
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo $(PY) -m benchmarks.digits $(ARGS)

test: install
	$(PY) -m pytest -q tests $(ARGS)
