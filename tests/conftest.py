"""Shared fixtures: the repository root on sys.path so tests import the ``tests`` helpers."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
