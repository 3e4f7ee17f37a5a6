"""Shared fixtures: the repository root on sys.path so tests import the ``tests`` helpers;
Hypothesis without its timing checks (a 200 ms deadline per example, a "too slow" health check):
on a shared 2-core machine they fail by how busy the machine is, not by what the code does; and
a closing line counting the multi-process jobs the session launched and their time. Before any
test imports TensorFlow, ``TF_USE_LEGACY_KERAS=1`` (unless set): ``tf.keras`` is Keras 2 (tf-keras),
the Keras of most TensorFlow tests, in pytest and in every worker it launches (the Keras 3 job
removes it from its workers' environment)."""
import collections
import os
import sys
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

settings.register_profile("untimed", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("untimed")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How many jobs each launcher started and their wall time (where the suite's time goes)."""
    from tests.support.launch import LAUNCHES

    if not LAUNCHES:
        return
    count: collections.Counter = collections.Counter()
    seconds: collections.Counter = collections.Counter()
    for launcher, took in LAUNCHES:
        count[launcher] += 1
        seconds[launcher] += took
    terminalreporter.write_line("jobs launched: " + ", ".join(
        f"{launcher} {count[launcher]} ({seconds[launcher]:.0f} s)" for launcher in sorted(count)))
