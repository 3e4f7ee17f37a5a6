"""Horovod elastic and the TensorFlow front end: refused, with the reason and the alternatives.

After a membership change the TensorFlow exchanger would go on with the partition tables,
schedules and thresholds built for the old world size, and a new worker's first exchange runs
the configuration check and shared-state agreement that the surviving workers, whose variable
lists were set up before, never join: a hang. Horovod's ``TensorFlowKerasState`` and
``TensorFlowState`` offer no hook to bring the exchanger along, so every wrapper refuses to be
built inside an elastic job, on every rank (no collective has run yet, so no rank hangs).
"""
from __future__ import annotations

from horovod_sparse.common.horovod_job import in_elastic_job


def refuse_elastic(wrapper: str) -> None:
    """Raise ``NotImplementedError`` naming ``wrapper``, the problem and the alternatives when
    this process is a worker of a Horovod elastic job (``HOROVOD_ELASTIC=1``, which
    ``horovodrun`` sets with ``--min-np`` / ``--max-np`` / ``--host-discovery-script``)."""
    if in_elastic_job():
        raise NotImplementedError(
            f"{wrapper}: horovod_sparse's TensorFlow front end does not support Horovod elastic "
            "(this worker runs with HOROVOD_ELASTIC=1): after a membership change its sparsifier "
            "state would stay built for the old number of workers, and a new worker's first "
            "exchange would wait on collectives the others never join. Run TensorFlow on a fixed "
            "number of workers (horovodrun -np N without --min-np, --max-np or "
            "--host-discovery-script), or train elastically with horovod_sparse's PyTorch front end "
            "(hvd.elastic.TorchState), or with Horovod's own TensorFlow wrappers for dense gradients.")
