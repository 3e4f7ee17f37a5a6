"""Where a benchmark row ran and what it sent over each tier: framework-free, so the drivers and
reports of torch and TensorFlow jobs (``benchmarks.main_job.digits``, ``benchmarks.emulated.cluster``) take it
without importing either."""
from __future__ import annotations

from typing import Any, Dict, Tuple


def placement(hvd: Any, tiers: Any) -> Dict[str, Any]:
    """Where a Horovod job's configuration ran: ``two_tier`` (whether the exchange runs two-tier:
    ``tiers``, the front end's, is not None; a job of one host runs flat), ``hosts`` and
    ``local_size`` (``hvd.cross_size()`` and ``hvd.local_size()``)."""
    return {"two_tier": tiers is not None, "hosts": hvd.cross_size(), "local_size": hvd.local_size()}


def tier_bytes(summary: Dict[str, Any]) -> Tuple[float, float]:
    """``(across, node)``: bytes sent per step per worker across hosts (the method's values,
    indices and metadata: the whole network in a flat exchange) and inside the host (the
    two-tier exchange's reduce-scatter and allgather), from
    :func:`benchmarks.emulated.synthetic_harness.summarize_stats`'s figures
    (0, 0 without statistics; summaries without bytes by kind, as the DDP job's own allreduce
    and PowerSGD rows, and results written before the ``node`` kind count 0 inside)."""
    if not summary:
        return 0.0, 0.0
    node = summary.get("bytes_sent_by_kind", {}).get("node", 0.0)
    return summary["bytes_sent"] - node, node
