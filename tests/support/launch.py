"""Launch real multi-process Horovod jobs from pytest with ``horovodrun``.

Workers write their observations to files in a directory the test owns; the test reads them
back and makes its assertions in the pytest process, so a failure shows the test's own message.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

WORKERS = Path(__file__).resolve().parent.parent / "workers"
#: Seconds a test's subprocess may run: only a guard against a hang, far above what a healthy
#: launch takes even on a 2-core machine shared with other suites (a few minutes at worst).
HANG_TIMEOUT = 900.0
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
#: ``horovodrun`` without its per-launch build probe (tests/support/hvdrun.py says why).
SUITE_HOROVODRUN = [sys.executable, "-m", "tests.support.hvdrun"]
#: (launcher, seconds) of every job this pytest session launched, for the summary conftest prints.
LAUNCHES: List[Tuple[str, float]] = []


@functools.lru_cache(maxsize=None)
def built_collectives() -> str:
    """Horovod's own answer, probed once per session in a fresh process, to whether it was built
    with Gloo and with MPI: ``gloo=1,mpi=0`` style, for tests/support/hvdrun.py."""
    probe = ("from horovod.common.util import gloo_built, mpi_built; "
             "print(f'gloo={int(bool(gloo_built()))},mpi={int(bool(mpi_built()))}')")
    result = subprocess.run([sys.executable, "-c", probe], env=worker_env(), capture_output=True, text=True,
                            check=True, timeout=HANG_TIMEOUT)
    return result.stdout.strip().splitlines()[-1]


def launcher_env() -> Dict[str, str]:
    """:func:`worker_env` plus the session's build answer that tests/support/hvdrun.py reads."""
    return dict(worker_env(), HS_TEST_HOROVOD_BUILT=built_collectives())


def _run_launch(launcher: str, command: List[str], env: Dict[str, str],
                timeout: float) -> subprocess.CompletedProcess:
    """Run one job's ``command`` and note its ``launcher`` and how long it took in :data:`LAUNCHES`."""
    start = time.monotonic()
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        LAUNCHES.append((launcher, time.monotonic() - start))


def worker_env() -> Dict[str, str]:
    """The environment of a launch: one thread per worker, unbuffered output, the repository
    importable."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                PYTHONPATH=str(WORKERS.parent.parent))


def horovodrun(script: str, np: int, args: Sequence[str] = (), backend: str = "gloo",
               timeout: float = HANG_TIMEOUT, env: Optional[Dict[str, Optional[str]]] = None,
               hosts: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<script>`` on ``np`` local processes (``env`` added to
    :func:`launcher_env`, a None value removing the variable) with ``horovodrun``
    (:data:`SUITE_HOROVODRUN`) over ``backend``, or with ``torchrun`` for ``backend="torchrun"``
    (its own rendezvous on a free port); raise with the output on failure. ``hosts``:
    horovodrun's ``-H`` (default ``localhost:np``); names of this machine such as
    ``localhost:2,127.0.0.1:2`` emulate several hosts (Horovod gives each name its own
    ``cross_rank``)."""
    env = {name: value for name, value in {**launcher_env(), **(env or {})}.items() if value is not None}
    if backend == "torchrun":
        command = [TORCHRUN, "--standalone", "--nproc-per-node", str(np), str(WORKERS / script), *args]
    else:
        command = [*SUITE_HOROVODRUN, "-np", str(np), "-H", hosts or f"localhost:{np}", f"--{backend}",
                   sys.executable, str(WORKERS / script), *args]
    result = _run_launch("torchrun" if backend == "torchrun" else "horovodrun", command, env, timeout)
    if result.returncode != 0:
        # Both launchers prefix worker lines with the rank ([1]<stderr> or [rank1]:); show each
        # rank's first traceback (the root error of the rank that failed first, which a job's
        # tail of "Horovod has been shut down" lines hides), the workers' last lines, then the
        # tail of everything else.
        workers = [line for line in (result.stdout + result.stderr).splitlines()
                   if ("<stderr>" in line or "]: " in line) and "tensorflow" not in line]
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}\n--- each rank's first traceback ---\n"
                             + "\n".join(first_tracebacks(workers)) + "\n--- worker stderr ---\n"
                             + "\n".join(workers[-60:]) + f"\n--- stdout ---\n{result.stdout[-3000:]}"
                             + f"\n--- stderr ---\n{result.stderr[-3000:]}")
    return result


def first_tracebacks(lines: Sequence[str], length: int = 30) -> List[str]:
    """Of a job's worker ``lines`` (prefixed ``[r]<stderr>:`` or ``[rankr]:``), each rank's first
    ``length`` lines from its first ``Traceback``, ranks in order of appearance."""
    found: Dict[str, List[str]] = {}
    for line in lines:
        rank = line.split("]", 1)[0]
        if rank in found and len(found[rank]) < length:
            found[rank].append(line)
        elif rank not in found and "Traceback" in line:
            found[rank] = [line]
    return [line for trace in found.values() for line in trace]


def horovodrun_elastic(script: str, hosts_file: Path, hosts: str, min_np: int, max_np: int,
                       args: Sequence[str] = ()) -> None:
    """Run ``tests/workers/<script>`` as a Horovod elastic job on local hosts, starting with the
    workers ``hosts`` lists (lines ``host:slots``): the driver's host discovery prints
    ``hosts_file``, written with ``hosts`` here (a worker may rewrite it to change the
    membership). Raises with the output on failure; the only time limit is :data:`HANG_TIMEOUT`."""
    hosts_file.write_text(hosts)
    discover = hosts_file.with_name(hosts_file.name + ".discover.sh")
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    # Gloo's rendezvous gives a joining worker 30 s to start by default, a timing dependency (a
    # worker starting on a busy machine takes longer): the hang guard is the only limit here.
    env = dict(launcher_env(), HOROVOD_GLOO_TIMEOUT_SECONDS=str(int(HANG_TIMEOUT)))
    start = sum(int(line.split(":")[1]) for line in hosts.split())
    # --network-interface lo: without it the elastic driver's interface discovery stalls here.
    command = [*SUITE_HOROVODRUN, "--network-interface", "lo", "-np", str(start), "--min-np", str(min_np),
               "--max-np", str(max_np), "--host-discovery-script", str(discover), "--gloo", sys.executable,
               str(WORKERS / script), *args]
    result = _run_launch("horovodrun (elastic)", command, env, HANG_TIMEOUT)
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}\n" + (
        result.stdout[-4000:] + result.stderr[-4000:])


def run_configs(script: str, np: int, out: Path, configs: List[Dict[str, Any]], backend: str = "gloo",
                timeout: float = HANG_TIMEOUT, env: Optional[Dict[str, Optional[str]]] = None,
                hosts: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run one launch that goes through every config in ``configs`` (one launch amortises the
    few seconds of start-up every worker pays); results go under ``out`` (``hosts``: see
    :func:`horovodrun`)."""
    spec = out / "configs.json"
    spec.write_text(json.dumps(configs))
    return horovodrun(script, np, ["--configs", str(spec), "--out", str(out)], backend, timeout, env, hosts)


def job_fixture(script: str, np: int, configs: List[Dict[str, Any]], timeout: float = HANG_TIMEOUT,
                hosts: Optional[str] = None, env: Optional[Dict[str, Optional[str]]] = None) -> Any:
    """A module-scoped pytest fixture running every config of ``configs`` in one ``script`` job
    on ``np`` workers (:func:`run_configs`, ``hosts`` and ``env`` as there); it yields the folder
    of the workers' records."""
    import pytest

    @pytest.fixture(scope="module")
    def job(tmp_path_factory: Any) -> Path:
        out = tmp_path_factory.mktemp(Path(script).stem)
        run_configs(script, np, out, configs, timeout=timeout, env=env, hosts=hosts)
        return out

    return job


def rank_records(out: Path, index: int, np: int) -> List[Any]:
    """The JSON records the ranks of a job wrote for its ``index``-th config, in rank order
    (workers that name their records ``{index}.rank{r}.json``)."""
    return [json.loads((out / f"{index}.rank{r}.json").read_text()) for r in range(np)]
