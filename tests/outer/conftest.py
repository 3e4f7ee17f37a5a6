"""The one ``torchrun`` job of ``tests/outer``'s modules (:data:`tests.outer.jobs.CONFIGS`)."""
import pytest

from tests.outer.jobs import CONFIGS
from tests.support.launch import run_configs


@pytest.fixture(scope="package")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("outer")
    run_configs("outer_steps.py", 2, out, CONFIGS, backend="torchrun")
    return out
