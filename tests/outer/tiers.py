"""The two-tier outer-steps job of ``tests/outer/test_two_tier.py`` (one ``torchrun`` launch of 4
ranks split into 2 nodes of 2 by ``node_size=2``: the configs of ``tests/workers/outer_steps.py``)
and the written-out reference of its rounds.

The reference is written from the definition of a two-tier round, not from the package's code:
per parameter, the node sums of each rank's ``residual + anchor - θ`` (a node of 2 adds two
numbers: one result whatever the order), split into as many slices as a node has ranks (the
first ``numel % 2`` one element longer), each slice exchanged by the flat method's reference
(``tests.support.reference_grouping.group_exchange``) across the 2 ranks owning it, one per node,
its residual that of the slice's owner (zero elsewhere), the slices' averages put together; then
the outer step, SGD of lr 1 (an exact subtraction).
"""
import numpy as np

from tests.outer.jobs import assert_recorded_rounds, config, round_thetas, start_params
from tests.support.reference_grouping import group_exchange

NP, NODE_SIZE = 4, 2
NODES = [list(range(n * NODE_SIZE, (n + 1) * NODE_SIZE)) for n in range(NP // NODE_SIZE)]


def tiers_config(name, method, **extra):
    return config(name, method, hierarchical=True, node_size=NODE_SIZE, **extra)


TIER_METHODS = ["topk", "micro", "gtopk", "sparseloco", "none"]
EXACT = [tiers_config(f"tiers_{m}", m) for m in TIER_METHODS]
#: The model in DDP over the node's group (``outer.node_group``): the inner steps' gradients averaged
#: in the node, so a node's ranks hold the same parameters; outer steps across the 2 nodes.
DDP = tiers_config("tiers_ddp_topk", "topk", ddp=True)
#: Saved mid-round (after 4 inner steps: 1 into the second round) with ``torch.save``, resumed in fresh
#: objects (their tiers made anew); the uninterrupted run is ``tiers_topk``.
RESUMED = tiers_config("tiers_topk_resumed", "topk", resume_at=4, resume_via="torch")
#: Rank 1's gradient is NaN in the second round (inner step 4); plain SGD inside.
NONFINITE = [tiers_config(f"tiers_nan_{policy}", "topk", nan_at=[4, 1], nonfinite=policy, inner_momentum=0.0)
             for policy in ("skip", "raise")]
#: What cannot work, refused at construction on every rank (no training): another process group than
#: the default; hierarchical, or node_size (given or by LOCAL_WORLD_SIZE), differing between ranks;
#: nodes of 3 on 4 ranks.
#: And hierarchical=True without node_size on this one-node launch (LOCAL_WORLD_SIZE=4): flat; and
#: the states of two tiers and of flat outer steps loaded into each other: refused.
REFUSED = {
    "tiers_subgroup": tiers_config("tiers_subgroup", "topk", subgroup=True),
    "tiers_hierarchical_differs": tiers_config("tiers_hierarchical_differs", "topk", hierarchical_of_rank={"3": False}),
    "tiers_node_size_differs": tiers_config("tiers_node_size_differs", "topk", node_size_of_rank={"3": 4}),
    "tiers_local_world_size_differs": config("tiers_local_world_size_differs", "topk", hierarchical=True,
                                             local_world_size_of_rank={"1": 2}),
    "tiers_uneven": config("tiers_uneven", "topk", hierarchical=True, node_size=3),
}
#: MiCRO on two parameters of 20,000 with a x100 burst in slice 0 (the first halves) at inner step
#: 16 of 24 (rounds of 3): its cross sets take their own histogram rounds, so the ranks launch
#: different numbers of collectives in a round (Horovod's twin levels them: tests/outer/test_horovod_tiers.py).
BURST = tiers_config("tiers_micro_burst", "micro", shapes=[[20000], [20000]], steps=24, burst=[16, 0, 100.0],
                     options={"density": 0.005, "min_numel": 0})
ONE_NODE = config("tiers_one_node", "topk", hierarchical=True, steps=0)
LAYOUTS = tiers_config("tiers_other_layouts", "topk", other_layouts=True, steps=0)
CONFIGS = EXACT + [DDP, RESUMED, BURST] + NONFINITE + list(REFUSED.values()) + [ONE_NODE, LAYOUTS]


def slice_ranges(numel):
    """``[lo, hi)`` of each rank's slice of a node sum of ``numel`` elements, by node position."""
    lengths = [numel // NODE_SIZE + (1 if s < numel % NODE_SIZE else 0) for s in range(NODE_SIZE)]
    ends = np.cumsum([0] + lengths)
    return [(int(ends[s]), int(ends[s + 1])) for s in range(NODE_SIZE)]


def slice_exchange(cfg, numel):
    """One slice's exchange across the nodes: the method's flat reference on the 2 ranks owning
    the slice, its update scaled by ``1 / NP`` instead of ``1 / 2`` (the average is over every
    rank: halving a float32 is exact, so the flat reference's update halved is bitwise the
    two-tier one's); ``Compression.none``: each rank's share ``x / NP`` (exact: a power of 2)
    summed in the node, the node sums added."""
    if cfg["method"] == "none":
        def dense(parts, step):
            total = parts[0] + parts[1]
            for part in parts:
                part[:] = 0
            return total / np.float32(NP)
        return dense
    flat = group_exchange(cfg["method"], cfg["options"], numel, len(NODES))
    return lambda parts, step: flat(parts, step) * np.float32(len(NODES) / NP)


def reference_two_tier(cfg, obs, abandoned=(), nan=None):
    """Per round ``j`` the expected average and parameters after the outer step (the same on every
    rank), and the final residuals ``[rank][i]``. A round in ``abandoned`` delivers nothing: no
    outer step, and each rank's residual the node sum of its slice (what the exchange was given);
    ``nan = (rank, parameter)``: that rank's pseudo-gradient of that parameter never enters."""
    anchor = start_params()
    ranges = [slice_ranges(a.size) for a in anchor]
    exchanges = [[slice_exchange(cfg, hi - lo) for lo, hi in ranges[i]] for i in range(len(anchor))]
    residuals = [[np.zeros_like(a) for a in anchor] for _ in range(NP)]
    expected = []
    for j in range(len(obs.meta[0]["rounds"])):
        thetas, updates = round_thetas(obs, j), []
        for i, a in enumerate(anchor):
            xs = [residuals[r][i] + (np.float32(0) if (j in abandoned and (r, i) == nan) else a - thetas[r][i])
                  for r in range(NP)]
            sums = [xs[first] + xs[second] for first, second in NODES]
            update = np.zeros_like(a)
            for s, (lo, hi) in enumerate(ranges[i]):
                parts = [node_sum[lo:hi].copy() for node_sum in sums]
                if j not in abandoned:
                    update[lo:hi] = exchanges[i][s](parts, j)
                for node, part in zip(NODES, parts):
                    residuals[node[s]][i] = np.zeros_like(a)
                    residuals[node[s]][i][lo:hi] = part
            updates.append(update)
        if j not in abandoned:
            anchor = [a - u for a, u in zip(anchor, updates)]
        expected.append((updates, anchor))
    return expected, residuals


def assert_two_tier_rounds(cfg, obs, **abandonment):
    """Every round's average (sparse groups), parameters on every rank and the final residuals
    bitwise those of :func:`reference_two_tier`."""
    expected, residuals = reference_two_tier(cfg, obs, **abandonment)
    assert_recorded_rounds(cfg, obs, expected, residuals, range(NP), abandonment.get("abandoned", ()))
