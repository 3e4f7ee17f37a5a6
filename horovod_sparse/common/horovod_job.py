"""What the environment says of the Horovod job this process runs in."""
from __future__ import annotations

import os

#: The variable ``horovodrun`` sets to 1 in the workers of an elastic job (``--min-np``,
#: ``--max-np``, ``--host-discovery-script``).
ELASTIC_ENV = "HOROVOD_ELASTIC"


def in_elastic_job() -> bool:
    """Whether this process is a worker of a Horovod elastic job (``HOROVOD_ELASTIC=1``)."""
    return bool(int(os.environ.get(ELASTIC_ENV, "0")))
