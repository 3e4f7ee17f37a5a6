"""The docs' "Adding a method" example is real: its code block, taken from docs/adding-a-method.md
as it is, registers ``randomk`` in fresh two-worker horovodrun jobs, and the method then runs
through the PyTorch optimizer and the TensorFlow tape inside a ``tf.function`` (its exchange on the
host), matching a slow NumPy reference of what the page says it does, with nothing lost."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.support.checks import Observed, assert_conservation, assert_identical_replicas, assert_matches_reference
from tests.support.launch import run_configs
from tests.support.reference import allgather_method

PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "adding-a-method.md"
SIZE = 2
DENSITY = 0.05
CONFIG = {"method": "randomk", "options": {"density": DENSITY, "min_numel": 0}, "steps": 4, "seed": 3,
          "shapes": [[30, 20], [20], [7]], "groups": "tensor"}
RUNS = {"torch": ("torch_exchange.py", {}), "tensorflow": ("tf_exchange.py", {"api": "tape_function"})}


def documented_example() -> str:
    """The Python block of the docs' "Adding a method" page."""
    section = PAGE.read_text().split("# Adding a method", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return block


def random_k(x: np.ndarray, step: int) -> np.ndarray:
    """The page's rule: k = max(1, int(density * numel)) coordinates drawn without replacement
    by a generator seeded with the step, the same on every rank."""
    k = max(1, int(DENSITY * x.size))
    return np.random.default_rng(step).choice(x.size, k, replace=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    plugin = tmp_path_factory.mktemp("plugin") / "randomk.py"
    plugin.write_text(documented_example())
    outputs = {}
    for framework, (worker, extra) in RUNS.items():
        config = dict(CONFIG, name=f"randomk_{framework}", plugin=str(plugin), **extra)
        outputs[framework] = tmp_path_factory.mktemp(framework), config
        run_configs(worker, SIZE, outputs[framework][0], [config])
    return outputs


@pytest.mark.parametrize("framework", list(RUNS))
def test_readme_method_matches_its_reference_and_loses_nothing(runs, framework):
    out, config = runs[framework]
    obs = Observed(out, config["name"], SIZE)
    assert obs.groups == [[0], [1], [2]]
    assert_matches_reference(obs, config, lambda grads: allgather_method(grads, random_k))
    assert_conservation(obs, config)
    assert_identical_replicas(obs)
    for record in obs.stats(0):
        for group in record["groups"]:
            assert group["selected"] == group["union"] == max(1, int(DENSITY * group["numel"]))
