"""Grouping in TensorFlow: every compression x every grouping the TensorFlow front end takes, on
one real horovodrun job (``DistributedGradientTape``, eager), with the PyTorch matrix's checks:
per step and group the delivered coordinates, their values and the final residuals against the
slow reference of ``tests.support.reference_grouping`` fed the same gradients and the groups each step
launched (MergeComp's regroupings included), conservation, identical replicas; plus the
``defaults-*`` configs (default ``min_numel``, warm-up steps).

Not in the matrix: Horovod's dense path (``none``) with ``"size:N"`` or MergeComp, which only
shape the flat buffers of a sparsifier (Horovod's own ``groups=`` has no such forms): the tape
refuses both, naming what it takes (tested here).
"""
from __future__ import annotations

import json

import pytest

from tests.support.checks import Observed, assert_conservation, assert_identical_replicas
from tests.support.launch import job_fixture
from tests.torch.test_grouping import (EXPECTED_GROUPS, GROUPINGS, METHODS, assert_matches_model_reference,
                                       matrix_config)

STEPS = 6
#: Steps of the MergeComp configs: the PyTorch matrix's, in which its search decides.
MERGECOMP_STEPS = 10
DENSE_ONLY = ("size256", "buckets", "mergecomp")  # groupings that shape a sparsifier's buffers only


def tf_config(method, grouping, **options):
    steps = MERGECOMP_STEPS if grouping == "mergecomp" else STEPS
    return {**matrix_config(method, grouping, **options), "steps": steps, "api": "tape"}


MATRIX = [tf_config(m, g) for m in METHODS for g in GROUPINGS if m != "none" or g not in DENSE_ONLY]
DEFAULTS = [{**tf_config(m, "size256", min_numel=None, warmup_steps=2), "name": f"defaults-{m}"}
            for m in METHODS[1:]]
CONFIGS = MATRIX + DEFAULTS
REFUSED = [{**tf_config("none", g), "expect_error": True} for g in DENSE_ONLY]

run = job_fixture("tf_exchange.py", 2, CONFIGS + REFUSED)


def launched_groups(obs, config):
    """The groups each step launched, as the worker recorded them before every step; the first
    step's are formed as it runs: per tensor under MergeComp (its dense recording step), else
    the final ones (no other grouping changes)."""
    step_groups = obs.meta[0]["step_groups"]
    assert obs.meta[1]["step_groups"] == step_groups and step_groups[0] == []
    first = [[i] for i in range(len(config["shapes"]))] if isinstance(config["groups"], dict) else obs.groups
    return [first] + step_groups[1:]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["name"])
def test_every_step_matches_the_reference(run, config):
    obs = Observed(run, config["name"], 2)
    assert obs.meta[1]["groups"] == obs.groups
    assert_matches_model_reference(obs, config, launched_groups(obs, config))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["name"])
def test_replicas_identical_and_nothing_lost(run, config):
    obs = Observed(run, config["name"], 2)
    assert_identical_replicas(obs)
    assert_conservation(obs, config)


@pytest.mark.parametrize("grouping", sorted(EXPECTED_GROUPS))
def test_groups_formed_as_asked(run, grouping):
    for config in MATRIX:
        if config["name"].endswith(f"-{grouping}"):
            assert Observed(run, config["name"], 2).groups == EXPECTED_GROUPS[grouping], config["name"]
            assert launched_groups(Observed(run, config["name"], 2), config) == \
                [EXPECTED_GROUPS[grouping]] * config["steps"], config["name"]


def test_mergecomp_result_identical_on_every_rank_and_applied(run):
    for method in METHODS[1:]:
        obs = Observed(run, f"{method}-mergecomp", 2)
        result = obs.meta[0]["mergecomp"]
        assert result is not None, f"{method}: the search did not finish in {MERGECOMP_STEPS} steps"
        assert (obs.meta[1]["mergecomp"]["splits"], obs.meta[1]["mergecomp"]["trials"]) == \
            (result["splits"], result["trials"])
        assert [[int(name.rsplit("_p", 1)[1].split(":")[0]) for name in group] for group in result["groups"]] \
            == obs.groups
        # Step 0 is the dense recording step; the last step launched the chosen groups.
        assert all(group["dense"] for group in obs.stats(0)[0]["groups"])
        assert launched_groups(obs, tf_config(method, "mergecomp"))[-1] == obs.groups


def errors(run, config):
    """The error each rank recorded for an ``expect_error`` config."""
    return [json.loads((run / f"{config['name']}.rank{rank}.json").read_text())["error"] for rank in range(2)]


@pytest.mark.parametrize("config", REFUSED, ids=lambda c: c["name"])
def test_buffer_groupings_are_refused_for_horovods_dense_path(run, config):
    spelled = {"size256": "groups='size:256'", "buckets": "groups='buckets:0.002'",
               "mergecomp": "groups='mergecomp' (MergeComp)"}
    for error in errors(run, config):
        assert error["type"] == "ValueError"
        assert (f"{spelled[config['name'].split('-')[1]]} sets the flat buffers of a sparsifier; with Horovod's "
                "dense compressors pass an int, lists of variables, 'tensor' or 'model'") in error["message"]
