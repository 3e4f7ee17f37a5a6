"""Grouping in TensorFlow: every compression x every grouping the TensorFlow front end takes, on
one real horovodrun job (``DistributedGradientTape``, eager), with the PyTorch matrix's checks:
per step and group the delivered coordinates, their values and the final residuals against the
slow reference of ``tests.reference_grouping`` fed the same gradients and groups, conservation,
identical replicas; plus the ``defaults-*`` configs (default ``min_numel``, warm-up steps).

Not in the matrix: MergeComp (``groups=MergeCompOptions(...)``), which only the PyTorch optimizer
takes, and ``"size:N"`` for Horovod's dense path (``none``), since Horovod's own ``groups=`` has
no such form: the tape refuses both, naming what it takes (tested here).
"""
from __future__ import annotations

import json

import pytest

from tests.checks import Observed, assert_conservation, assert_identical_replicas
from tests.launch import job_fixture
from tests.test_torch_grouping import (EXPECTED_GROUPS, GROUPINGS, METHODS, assert_matches_model_reference,
                                       matrix_config)

STEPS = 6
TF_GROUPINGS = [g for g in GROUPINGS if g != "mergecomp"]


def tf_config(method, grouping, **options):
    return {**matrix_config(method, grouping, **options), "steps": STEPS, "api": "tape"}


MATRIX = [tf_config(m, g) for m in METHODS for g in TF_GROUPINGS if (m, g) != ("none", "size256")]
DEFAULTS = [{**tf_config(m, "size256", min_numel=None, warmup_steps=2), "name": f"defaults-{m}"}
            for m in METHODS[1:]]
CONFIGS = MATRIX + DEFAULTS
MERGECOMP = {**tf_config("topk", "mergecomp"), "expect_error": True}
DENSE_BY_SIZE = {**tf_config("none", "size256"), "expect_error": True}

run = job_fixture("tf_exchange.py", 2, CONFIGS + [MERGECOMP, DENSE_BY_SIZE])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["name"])
def test_every_step_matches_the_reference(run, config):
    obs = Observed(run, config["name"], 2)
    assert obs.meta[1]["groups"] == obs.groups
    assert_matches_model_reference(obs, config, [obs.groups] * config["steps"])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["name"])
def test_replicas_identical_and_nothing_lost(run, config):
    obs = Observed(run, config["name"], 2)
    assert_identical_replicas(obs)
    assert_conservation(obs, config)


@pytest.mark.parametrize("grouping", TF_GROUPINGS)
def test_groups_formed_as_asked(run, grouping):
    for config in MATRIX:
        if config["name"].endswith(f"-{grouping}"):
            assert Observed(run, config["name"], 2).groups == EXPECTED_GROUPS[grouping], config["name"]


def errors(run, config):
    """The error each rank recorded for an ``expect_error`` config."""
    return [json.loads((run / f"{config['name']}.rank{rank}.json").read_text())["error"] for rank in range(2)]


def test_mergecomp_is_refused_with_the_forms_groups_takes(run):
    for error in errors(run, MERGECOMP):
        assert error["type"] == "TypeError"
        assert "groups must be None, an int, a strategy name or lists of parameters" in error["message"]
        assert "MergeCompOptions" in error["message"]


def test_size_groups_are_refused_for_horovods_dense_path(run):
    for error in errors(run, DENSE_BY_SIZE):
        assert error["type"] == "ValueError"
        assert "groups='size:256' sets the flat buffers of a sparsifier" in error["message"]
