"""The ``torchrun`` jobs of ``tests/outer``'s modules: the flat one of 2 ranks
(:data:`tests.outer.jobs.CONFIGS`) and the two-tier one of 4 ranks in 2 nodes of 2
(:data:`tests.outer.tiers.CONFIGS`)."""
import pytest

from tests.outer import tiers
from tests.outer.jobs import CONFIGS
from tests.support.launch import run_configs


@pytest.fixture(scope="package")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("outer")
    run_configs("outer_steps.py", 2, out, CONFIGS, backend="torchrun")
    return out


@pytest.fixture(scope="package")
def tiers_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("outer_tiers")
    run_configs("outer_steps.py", tiers.NP, out, tiers.CONFIGS, backend="torchrun")
    return out
