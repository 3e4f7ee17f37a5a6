"""Keras ``model.fit`` on real data (scikit-learn's digits) through
horovod_sparse.tensorflow.keras.DistributedOptimizer, on a real two-worker horovodrun job."""
from __future__ import annotations

import json

import pytest

from tests.support.checks import Observed, assert_identical_replicas
from tests.support.launch import run_configs

CONFIGS = [{"name": "dense", "spec": "none", "epochs": 6},
           {"name": "topk", "spec": "topk:density=0.01,min_numel=0", "epochs": 6},
           # Decides on the host: the traced step runs its exchange in a tf.py_function.
           {"name": "micro", "spec": "micro:density=0.01,min_numel=0", "epochs": 6}]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    out = tmp_path_factory.mktemp("tf_keras_digits")
    run_configs("tf_keras_digits.py", 2, out, CONFIGS)
    return {c["name"]: [json.loads((out / f"{c['name']}.rank{r}.json").read_text()) for r in range(2)]
            for c in CONFIGS}, out


@pytest.mark.parametrize("name,mode", [("topk", "tf.function"), ("micro", "tf.function")])
def test_sparse_methods_reach_the_dense_accuracy_band(fitted, name, mode):
    rows, _ = fitted
    dense, sparse = rows["dense"][0], rows[name][0]
    assert dense["accuracy"] > 0.93, dense
    assert sparse["accuracy"] >= dense["accuracy"] - 0.04, (dense, sparse)
    assert sparse["mode"] == mode


def test_sparse_methods_send_a_fraction_of_dense(fitted):
    rows, _ = fitted
    dense, topk, micro = (rows[name][0]["stats"] for name in ("dense", "topk", "micro"))
    assert dense["union_density"] == 1.0
    assert 0.01 <= topk["union_density"] <= 2 * 0.01 + 1e-9, "union of two ranks' top-1%"
    assert micro["union_density"] < 2 * 0.01, "exclusive partitions: no build-up beyond the target"
    for sparse in (topk, micro):
        assert sparse["bytes_sent"] < dense["bytes_sent"] / 20


@pytest.mark.parametrize("name", [c["name"] for c in CONFIGS])
def test_replicas_identical_after_fit(fitted, name):
    _, out = fitted
    assert_identical_replicas(Observed(out, name, 2))
