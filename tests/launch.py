"""Launch real multi-process Horovod jobs from pytest with ``horovodrun``.

Workers write their observations to files in a directory the test owns; the test reads them
back and makes its assertions in the pytest process, so a failure shows the test's own message.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

WORKERS = Path(__file__).resolve().parent / "workers"
#: Seconds a test's subprocess may run: only a guard against a hang, far above what a healthy
#: launch takes even on a 2-core machine shared with other suites (a few minutes at worst).
HANG_TIMEOUT = 900.0
HOROVODRUN = str(Path(sys.executable).with_name("horovodrun"))


def horovodrun(script: str, np: int, args: Sequence[str] = (), backend: str = "gloo",
               timeout: float = HANG_TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<script>`` on ``np`` local processes; raise with the output on failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(WORKERS.parent.parent))
    command = [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}", f"--{backend}",
               sys.executable, str(WORKERS / script), *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        # horovodrun prefixes worker lines with [rank]<stream>; show the workers' errors first,
        # then the tail of everything else.
        workers = [line for line in (result.stdout + result.stderr).splitlines()
                   if "<stderr>" in line and "tensorflow" not in line]
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}\n--- worker stderr ---\n"
                             + "\n".join(workers[-60:]) + f"\n--- stdout ---\n{result.stdout[-3000:]}")
    return result


def run_configs(script: str, np: int, out: Path, configs: List[Dict[str, Any]], backend: str = "gloo",
                timeout: float = HANG_TIMEOUT) -> subprocess.CompletedProcess:
    """Run one launch that goes through every config in ``configs`` (one launch amortises the
    few seconds of start-up every worker pays); results go under ``out``."""
    spec = out / "configs.json"
    spec.write_text(json.dumps(configs))
    return horovodrun(script, np, ["--configs", str(spec), "--out", str(out)], backend, timeout)


def job_fixture(script: str, np: int, configs: List[Dict[str, Any]], timeout: float = HANG_TIMEOUT) -> Any:
    """A module-scoped pytest fixture running every config of ``configs`` in one ``script`` job
    on ``np`` workers (:func:`run_configs`); it yields the folder of the workers' records."""
    import pytest

    @pytest.fixture(scope="module")
    def job(tmp_path_factory: Any) -> Path:
        out = tmp_path_factory.mktemp(Path(script).stem)
        run_configs(script, np, out, configs, timeout=timeout)
        return out

    return job


def rank_records(out: Path, index: int, np: int) -> List[Any]:
    """The JSON records the ranks of a job wrote for its ``index``-th config, in rank order
    (workers that name their records ``{index}.rank{r}.json``)."""
    return [json.loads((out / f"{index}.rank{r}.json").read_text()) for r in range(np)]
