"""The ``torchrun`` jobs of ``tests/outer``'s modules: the flat one of 2 ranks
(:data:`tests.outer.jobs.CONFIGS`), the two-tier one of 4 ranks in 2 nodes of 2
(:data:`tests.outer.tiers.CONFIGS`) and the FSDP2 one of 4 ranks as a 2 x 2 mesh
(:data:`tests.outer.fsdp.CONFIGS`)."""
import pytest

from tests.outer import fsdp, tiers
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


@pytest.fixture(scope="package")
def fsdp_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("outer_fsdp")
    run_configs("outer_steps.py", fsdp.NP, out, fsdp.CONFIGS, backend="torchrun")
    return out
