"""The FSDP2 outer-steps job of ``tests/outer/test_fsdp.py`` (one ``torchrun`` launch of 4 ranks as
a 2 x 2 mesh, ``replicate`` x ``shard``: the ``fsdp`` configs of ``tests/workers/outer_steps.py``)
and the written-out reference of its rounds per shard.

Each replica's 2 ranks hold a shard each of every parameter (``fully_shard`` over
``mesh["shard"]``: rows ``[0, ceil(n/2))`` on shard position 0, the rest on position 1), and the
outer steps run across ``mesh["replicate"]``: ranks ``[s, s + 2]`` hold shard position ``s`` in
replicas 0 and 1. The reference of position ``s`` is the flat written-out rounds
(:func:`tests.outer.jobs.reference_rounds`) over those 2 ranks' local shards, from the shard of
replica 0's initial parameters (what every replica takes at construction), with the method's
reference of each shard's size and shape: no package code.
"""
import math

from tests.outer.jobs import (SHAPES, assert_recorded_rounds, config, dense_average, nesterov_reference,
                              reference_rounds, start_params)

NP, POSITIONS = 4, 2
#: The ranks holding shard position ``s`` in replicas 0 and 1 (its replicate group).
REPLICAS_OF = [[s, s + POSITIONS] for s in range(POSITIONS)]


def fsdp_config(name, method, **extra):
    return config(name, method, fsdp=True, **extra)


FSDP_METHODS = ["topk", "micro", "gtopk", "sparseloco", "none"]
EXACT = [fsdp_config(f"fsdp_{m}", m) for m in FSDP_METHODS]
#: DiLoCo's default outer optimizer (Nesterov SGD) stepping the DTensor parameters, with a final sync.
DILOCO = fsdp_config("fsdp_diloco_topk", "topk", outer="diloco", steps=10, sync_at_end=True)
#: Overlapped rounds over 2 streamed fragments, flushed at the end.
STREAMED = fsdp_config("fsdp_streamed_micro", "micro", overlap=True, fragments=2, flush_at_end=True)
#: A parameter of one row: its shard on position 1 is empty (exchanged dense, nothing to select).
EMPTY_SHARD = fsdp_config("fsdp_empty_shard_micro", "micro", shapes=[[1, 4], [30, 20]])
#: The outer state offloaded to CPU memory: the twin of ``fsdp_topk``.
OFFLOADED = fsdp_config("fsdp_offload_topk", "topk", offload=True)
#: Saved mid-round (after 4 inner steps: 1 into the second round) through ``torch.distributed.checkpoint``
#: and resumed in a fresh model, inner optimizer and outer steps; the uninterrupted run is ``fsdp_topk``.
RESUMED = fsdp_config("fsdp_topk_resumed", "topk", resume_at=4, resume_via="dcp")
#: The same for the streamed run, saved with fragment 0's exchange (ended at step 3) in flight.
STREAMED_RESUMED = {**STREAMED, "name": "fsdp_streamed_micro_resumed", "resume_at": 4, "resume_via": "dcp"}
#: Rank 1's gradient has a NaN in its first element in the second round (inner step 4): FSDP's
#: reduce-scatter hands it to rank 0 (shard position 0) alone; plain SGD inside.
NONFINITE = [fsdp_config(f"fsdp_nan_{policy}", "topk", nan_at=[4, 1], nonfinite=policy, inner_momentum=0.0)
             for policy in ("skip", "raise")]
#: What cannot work, refused at construction on every rank (no training): every rank as the process
#: group, the shard group, the model sharded over the 2-D mesh (FSDP's HSDP), ``every`` differing on
#: one rank (whose replicate group does not hold rank 0), two tiers.
REFUSED = {
    "fsdp_world": fsdp_config("fsdp_world", "topk", fsdp_group="world", steps=0),
    "fsdp_shard_group": fsdp_config("fsdp_shard_group", "topk", fsdp_group="shard", steps=0),
    "fsdp_hsdp": fsdp_config("fsdp_hsdp", "topk", fsdp_group="hsdp", steps=0),
    "fsdp_every_differs": fsdp_config("fsdp_every_differs", "topk", every_of_rank={"3": 4}, steps=0),
    "fsdp_hierarchical": fsdp_config("fsdp_hierarchical", "topk", hierarchical=True, node_size=2, steps=0),
}
CONFIGS = (EXACT + [DILOCO, STREAMED, EMPTY_SHARD, OFFLOADED, RESUMED, STREAMED_RESUMED] + NONFINITE
           + list(REFUSED.values()))


def local_shapes(s):
    """Shard position ``s``'s local shape of every parameter (``torch.chunk`` of the rows in 2)."""
    shapes = []
    for shape in SHAPES:
        rows = math.ceil(shape[0] / POSITIONS)
        shapes.append([min(rows, shape[0] - s * rows)] + shape[1:])
    return shapes


def start_shards(s):
    """Shard position ``s`` of replica 0's initial parameters, flat float32."""
    rows = [math.ceil(shape[0] / POSITIONS) for shape in SHAPES]
    return [a.reshape(shape)[s * n:(s + 1) * n].reshape(-1).copy()
            for a, shape, n in zip(start_params(), SHAPES, rows)]


class Position:
    """The records of shard position ``s``'s 2 ranks, as a 2-rank flat job's (``Observed``'s fields)."""

    def __init__(self, obs, s):
        self.arrays = [obs.arrays[r] for r in REPLICAS_OF[s]]
        self.meta = [obs.meta[r] for r in REPLICAS_OF[s]]
        self.size = len(REPLICAS_OF[s])


def reference_position(cfg, obs, s, abandoned=(), nan=None):
    """Position ``s``'s written-out rounds (:func:`tests.outer.jobs.reference_rounds`), SGD of lr 1
    outside (DiLoCo's Nesterov SGD in float64 for ``outer="diloco"``), the dense average for
    ``Compression.none``; ``nan = (rank, parameter)`` in the job's ranks."""
    outer_step = nesterov_reference() if cfg["outer"] == "diloco" else (lambda anchor, update, i: anchor - update)
    in_position = None if nan is None or nan[0] not in REPLICAS_OF[s] else (REPLICAS_OF[s].index(nan[0]), nan[1])
    return reference_rounds(cfg, Position(obs, s), outer_step, dense_average if cfg["method"] == "none" else None,
                            start=start_shards(s), shapes=local_shapes(s), abandoned=abandoned, nan=in_position)


def assert_fsdp_rounds(cfg, obs, **abandonment):
    """Every round's average (sparse groups, delivered rounds), every rank's local shards after it
    and the final residuals bitwise those of its shard position's written-out rounds."""
    for s in range(POSITIONS):
        expected, residuals = reference_position(cfg, obs, s, **abandonment)
        assert_recorded_rounds(cfg, obs, expected, residuals, REPLICAS_OF[s], abandonment.get("abandoned", ()))
