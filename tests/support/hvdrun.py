"""``horovodrun`` for the test suite: Horovod's own launcher (``horovod.runner.launch``), run as
the installed ``horovodrun`` runs it, except for its build probe.

Before every launch, ``horovodrun`` asks whether Horovod was built with Gloo (or MPI) by forking a
process that imports ``horovod.tensorflow``: seconds of one core per launch, paid again by every
one of the suite's launches, for an answer that does not change. Here the answer comes from
``HS_TEST_HOROVOD_BUILT`` (``gloo=1,mpi=1``), which :func:`tests.support.launch.built_collectives` probes
once per pytest session with Horovod's own probe. The workers, the rendezvous and the
collectives are untouched. The launches the benchmarks make themselves (the main job, the
emulated cluster) use the installed ``horovodrun``.

Usage: ``python -m tests.support.hvdrun`` followed by ``horovodrun``'s own arguments.
"""
import os
import sys

import horovod.runner.launch as launch


def _answer(collective: str) -> bool:
    built = dict(pair.split("=") for pair in os.environ["HS_TEST_HOROVOD_BUILT"].split(","))
    return built[collective] == "1"


if __name__ == "__main__":
    launch.gloo_built = lambda verbose=False: _answer("gloo")
    launch.mpi_built = lambda verbose=False: _answer("mpi")
    sys.exit(launch.run_commandline())
