"""Ending a rank of a ``torch.distributed`` job over Gloo without an abort at exit.

A DDP job over Gloo can end in ``terminate called without an active exception`` (SIGABRT, so
``torchrun`` reports the job failed) after all its work is done. Seen with PyTorch 2.13 on CPU,
in a core dump: the interpreter is finalizing (``Py_FinalizeEx``) while a Gloo worker thread
(``ProcessGroupGloo::runLoop``) drops its last reference to a finished barrier, which holds the
collectives that were in flight when the barrier began; one of those holds a tensor created in
Python, whose release takes the GIL; a thread asking for the GIL during finalization is ended
with ``pthread_exit``, whose unwinding through a ``noexcept`` destructor calls
``std::terminate``. The worker threads are still alive then because a
``DistributedDataParallel`` keeps its process group alive past ``destroy_process_group()``
(constructing one is enough; deleting it and collecting garbage does not release the group). A
thread that runs late, as on a loaded machine, is all it takes. The remedy here: leave without
the interpreter's finalization, once every rank is done.
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def exit_job(code: int = 0) -> NoReturn:
    """End this rank: wait until every rank of the default group calls this (a barrier, so no
    rank leaves while a peer still exchanges with it), destroy every process group, flush
    ``sys.stdout`` and ``sys.stderr``, and leave with ``os._exit(code)``: no ``atexit`` handler
    runs and no Python object is finalized, so close files and write results before calling
    it. Without an initialized default group it only flushes and leaves."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
