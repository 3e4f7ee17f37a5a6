"""Shared fixtures: the repository root on sys.path so tests import the ``tests`` helpers; and
Hypothesis without its timing checks (a 200 ms deadline per example, a "too slow" health check):
on a shared 2-core machine they fail by how busy the machine is, not by what the code does."""
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

settings.register_profile("untimed", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("untimed")
