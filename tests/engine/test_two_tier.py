"""The two-tier exchange (``hierarchical=True``) of the PyTorch optimizer on a real horovodrun job
emulating 2 hosts x 2 workers (``-H localhost:2,127.0.0.1:2``), every method, and of the DDP comm
hook on a 4-process torchrun job split into 2 nodes of 2 (``node_size=2``), and of the TensorFlow
tape and Keras optimizer on the same emulated cluster.

Each rank checks every step against the definition of a two-tier step, written independently of
horovod_sparse.common.tiers in the worker (tests/workers/torch_two_tier.py): the flat method on
the 2 ranks owning the same slice, fed the node sums of ``g + e`` split as Horovod's
reduce-scatter splits, its updates gathered in the node. Bitwise: a node of 2 adds two numbers,
whose sum does not depend on the order. The test then checks identical replicas, conservation
(every finite gradient given is delivered or held in some rank's residual), the bytes of each
tier and, on the configs that ask, exact resume, a two-tier checkpoint loaded into a flat optimizer
(nothing lost) and the NaN policy. The DDP hook and the
TensorFlow front ends are compared with the Horovod optimizer on DDP's buckets, step by step
(TensorFlow up to float rounding, as tests/engine/test_parity.py compares the frameworks flat).
"""
import numpy as np
import pytest

from horovod_sparse.common.stall import TIME_ENV, stall_seconds
from tests.support.checks import Observed
from tests.support.launch import rank_records, run_configs

SHAPES = [[33, 7], [51], [1]]  # a group of 1 element cannot be split in 2: it goes dense
NP, NODE_SIZE = 4, 2


def config(name, method, steps=4, **options):
    return {"name": name, "method": method, "options": {"density": 0.1, "min_numel": 0, **options},
            "shapes": SHAPES, "steps": steps, "seed": 11}


CONFIGS = [
    {**config("topk", "topk"), "resume_at": 1, "flat_steps": 2},
    config("threshold", "threshold"),
    config("gaussiank", "gaussiank"),
    {**config("dgc", "dgc", momentum=0.9), "resume_at": 1},
    config("gtopk", "gtopk"),
    {**config("micro", "micro"), "groups": "model", "resume_at": 1, "flat_steps": 2},
    {**config("exdyna", "exdyna", num_blocks=4), "groups": "model", "resume_at": 1},
    config("lags", "lags", adaptive=False, group_size=100),
    config("sparseloco", "sparseloco", chunk_size=64),
    {**config("topk_nan", "topk", steps=4), "nan_at": [2, 1]},
    {**config("micro_nan", "micro", steps=4), "groups": "model", "nan_at": [1, 3]},
]
#: Issue 46's shape, smaller: every method on a larger model (3 x 20,000 elements) for 8 steps,
#: with a burst in the first parameter at step 5 (x100: within the histogram's window, beyond the
#: candidates). The burst lies in slice 0 of the node sums, so MiCRO's and ExDyna's cross sets
#: take different histogram rounds that step (slice 0's a wide one): the rounds of the two
#: tiers' sets diverge.
BURST_STEP = 5
LARGE = [{"name": f"{method}_large", "method": method, "shapes": [[20000]] * 3, "steps": 8, "seed": 5,
          "options": {"density": 0.005, "min_numel": 0, **options}, "burst": [BURST_STEP, 0, 100.0],
          **({"groups": "model"} if method in ("micro", "exdyna") else {})}
         for method, options in [("topk", {}), ("threshold", {}), ("gaussiank", {}), ("dgc", {"momentum": 0.9}),
                                 ("gtopk", {}), ("micro", {}), ("exdyna", {}), ("lags", {"adaptive": False}),
                                 ("sparseloco", {"chunk_size": 4096})]]
CONFIGS += LARGE
NAMES = [c["name"] for c in CONFIGS]
DDP_METHODS = ["topk", "gtopk", "micro", "exdyna", "dgc", "gaussiank", "threshold", "lags", "sparseloco"]
#: DDP's first step is dense (its buckets are final after it): the Horovod side warms up as long.
DDP_OPTIONS = {"density": 0.05, "min_numel": 0, "warmup_steps": 1}
#: How the TensorFlow side runs each method: eagerly through the tape, and for some traced too
#: (a tape step in a tf.function, Keras' apply in one; MiCRO's exchange runs on the host there).
TF_APIS = {"topk": ["tape", "tape_function"], "micro": ["tape", "keras_function"], "gtopk": ["tape", "tape_function"]}
DDP_CONFIGS = [{"name": f"ddp_{m}", "method": m, "steps": 4, "seed": 11, "shapes": [[30, 20], [20], [40, 30], [7]],
                "bucket_cap_mb": 0.003, "hierarchical": True, "node_size": NODE_SIZE,
                "options": {**DDP_OPTIONS, **({"adaptive": False} if m == "lags" else {})}} for m in DDP_METHODS]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The DDP configs on torchrun first (their buckets become the Horovod side's groups), then
    one horovodrun job: the configs checked against the definition, and DDP's counterparts."""
    out = tmp_path_factory.mktemp("two_tier")
    run_configs("ddp_exchange.py", NP, out, DDP_CONFIGS, backend="torchrun")
    parity = [{**c, "name": "hvd_" + c["name"], "parity": True, "groups": Observed(out, c["name"], NP).groups}
              for c in DDP_CONFIGS]
    run_configs("torch_two_tier.py", NP, out, CONFIGS + parity, hosts="localhost:2,127.0.0.1:2")
    run_configs("tf_exchange.py", NP, out, [{**c, "name": f"tf_{api}_{c['name'][4:]}", "api": api}
                                            for c in parity for api in TF_APIS.get(c["method"], ["tape"])],
                hosts="localhost:2,127.0.0.1:2")
    return out


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=NAMES)
def test_two_tier_step_is_the_flat_method_on_node_sums(job, index):
    """Every step equals its definition, the replicas stay identical and nothing is lost, while the
    loop runs its own unnamed Horovod collectives on the global set between backward and step and
    after the step (issue 56: without leveling the ranks' collectives, a step whose cross sets
    took other rounds left them named apart, and the job hung until Gloo aborted it)."""
    records = rank_records(job, index, NP)
    for rank, record in enumerate(records):
        assert (record["node_size"], record["cross_size"]) == (NODE_SIZE, NP // NODE_SIZE)
        assert record["mismatches"] == [], f"rank {rank}: {record['mismatches']}"
        assert record["identical"], f"rank {rank}: replicas differ"
        if CONFIGS[index]["method"] != "dgc":  # DGC's momentum correction delivers more than was given
            assert record["lost"] < 1e-6, f"rank {rank}: {record['lost']} of the gradients lost"


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=NAMES)
def test_bytes_per_tier(job, index):
    """Inside the node each sparse group moves its whole buffer once (reduce-scatter out, the
    slices' updates in); across nodes only the method's payload of this rank's slice: a slice
    may select nothing (a threshold above all of it), never all of it, but for the hard
    threshold, which never adapts (on the large model it lets most of a slice through: at most
    a value and an index of each of its elements)."""
    for record in rank_records(job, index, NP):
        numels = record["numels"]
        for step, node in enumerate(record["node_bytes"]):
            assert node and all(sent == 4 * numels[name] for name, sent in node.items()), (step, node)
            cross = record["cross_bytes"][step]
            assert set(cross) == set(node)
            if CONFIGS[index]["method"] == "threshold":
                limits = {name: 8 * -(-numel // NODE_SIZE) + 1 for name, numel in numels.items()}
            else:
                limits = {name: 4 * numel for name, numel in numels.items()}
            assert sum(cross.values()) > 0 and all(sent < limits[name] for name, sent in cross.items()), cross


@pytest.mark.parametrize("method", ["micro", "exdyna"])
def test_the_cross_sets_take_their_own_histogram_rounds(job, method):
    """On the large model the controllers take their extra rounds in two tiers, each cross set
    its own: at the burst the owners of slice 0 (node position 0: ranks 0 and 2) read a wide
    budget and the owners of slice 1 do not; fine rounds come too. Replicas stay identical and
    every step equals its definition (test_two_tier_step_is_the_flat_method_on_node_sums)."""
    records = rank_records(job, NAMES.index(f"{method}_large"), NP)
    rounds = [[next(iter(step.values()))["rounds"] for step in record["selections"]] for record in records]
    assert rounds[0] == rounds[2] and rounds[1] == rounds[3], "the ranks of a cross set took other rounds"
    assert rounds[0][BURST_STEP][:2] == ["histogram", "histogram.wide"], rounds[0]
    assert "histogram.wide" not in rounds[1][BURST_STEP], rounds[1]
    assert any("histogram.fine" in r for r in rounds[0] + rounds[1]), rounds


#: The large configs whose union has a bound (the threshold baselines select what passes).
BOUNDED = [c for c in LARGE if c["method"] not in ("threshold", "gaussiank")]


@pytest.mark.parametrize("config", BOUNDED, ids=[c["method"] for c in BOUNDED])
def test_the_union_is_that_of_two_hosts(job, config):
    """The method runs among the 2 hosts, not the 4 workers: per slice, Top-k's union (and that of
    DGC and LAGS, which allgather like it) is at most 2 k, gTop-k's exactly k, and MiCRO's and
    ExDyna's the sum of 2 counts. (A DGC rank may send up to 1.3 k: above that it keeps the exact
    top-k.)"""
    for record in rank_records(job, NAMES.index(config["name"]), NP):
        for step in record["selections"]:
            for group in step.values():
                if config["method"] == "gtopk":
                    assert group["union"] == group["target"], group
                elif config["method"] in ("micro", "exdyna"):
                    assert len(group["counts"]) == NP // NODE_SIZE and group["union"] == sum(group["counts"]), group
                else:
                    per_rank = 1.3 * group["target"] if config["method"] == "dgc" else group["target"]
                    assert 0 < group["union"] <= (NP // NODE_SIZE) * per_rank, group


def test_nan_on_one_rank_abandons_the_step_everywhere(job):
    for name in ("topk_nan", "micro_nan"):
        index = NAMES.index(name)
        step = CONFIGS[index]["nan_at"][0]
        for record in rank_records(job, index, NP):
            assert [i for i, a in enumerate(record["abandoned"]) if a] == [step]


@pytest.mark.parametrize("config", DDP_CONFIGS, ids=DDP_METHODS)
def test_ddp_hook_two_tier_equals_the_horovod_optimizers(job, config):
    """The DDP hook's two-tier steps equal the Horovod optimizer's on the same groups, bitwise
    (nodes of 2 and 2 nodes: every sum has one order), residuals included; the first step is
    dense on both (not compared here: DDP and Horovod average in other orders)."""
    ddp, hvd = Observed(job, config["name"], NP), Observed(job, "hvd_" + config["name"], NP)
    assert hvd.groups == ddp.groups and len(ddp.groups) >= 2
    for rank in range(NP):
        assert all(not g["dense"] for g in ddp.stats(rank)[1]["groups"]), "the steps after the first are sparse"
        assert all(g["sent"]["node"] > 0 for g in ddp.stats(rank)[1]["groups"]), "no reduce-scatter in the node"
        for step in range(1, config["steps"]):
            for i in range(len(config["shapes"])):
                np.testing.assert_array_equal(ddp.arrays[rank][f"agg_{step}_{i}"], hvd.arrays[rank][f"agg_{step}_{i}"],
                                              err_msg=f"{config['name']}: step {step} parameter {i} rank {rank}")
        for g in range(len(ddp.groups)):
            np.testing.assert_array_equal(ddp.residual(rank, g), hvd.residual(rank, g))


TF_RUNS = [(c, api) for c in DDP_CONFIGS for api in TF_APIS.get(c["method"], ["tape"])]


@pytest.mark.parametrize("config,api", TF_RUNS, ids=[f"{c['method']}-{api}" for c, api in TF_RUNS])
def test_tensorflow_two_tier_equals_the_horovod_optimizers(job, config, api):
    """The TensorFlow tape's (and Keras optimizer's) two-tier steps give the PyTorch optimizer's
    selected coordinates, aggregates and residuals on the same groups (float rounding apart)."""
    pt, tf = Observed(job, "hvd_" + config["name"], NP), Observed(job, f"tf_{api}_{config['name']}", NP)
    assert pt.groups == tf.groups
    for rank in range(NP):
        assert all(g["sent"]["node"] > 0 for g in tf.stats(rank)[1]["groups"]), "no reduce-scatter in the node"
        for step in range(config["steps"]):
            for members in pt.groups:
                a, b = pt.aggregated(rank, step, members), tf.aggregated(rank, step, members)
                if step:  # the first step is dense on both
                    np.testing.assert_array_equal(np.flatnonzero(a), np.flatnonzero(b),
                                                  err_msg=f"step {step} rank {rank}: selected coordinates differ")
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(a).max())
        for group in range(len(pt.groups)):
            a, b = pt.residual(rank, group), tf.residual(rank, group)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(a).max())


#: Horovod's stall-check time of the diverging job, in seconds, and how much later than it an
#: error may come (the step's work before the wait, on a loaded 2-core machine).
STALL_SECONDS, STALL_SLACK = 3, 6
#: MiCRO on the model, rank 1 taking one round more than rank 3 (its cross set's other member)
#: after the first histogram round of step 2.
DIVERGING = {**config("micro_diverge", "micro", steps=4), "groups": "model", "diverge": [2, 1]}


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    """A 2 x 2 job whose rank 1 takes a round alone: every rank records the error that ends it
    (the launch's own limit turns a hang into a failure well before the suite's guard)."""
    out = tmp_path_factory.mktemp("two_tier_stalled")
    run_configs("torch_two_tier.py", NP, out, [DIVERGING], hosts="localhost:2,127.0.0.1:2",
                env={TIME_ENV: str(STALL_SECONDS)}, timeout=180)
    return out


def test_on_gloo_the_exchanges_stall_check_fires_before_gloos_timeout(job):
    """The job runs on Gloo: the Horovod front end's waits take at most half of Gloo's timeout, so
    a stall ends in ExchangeStalled, not in Gloo's abort from Horovod's thread."""
    for record in rank_records(job, 0, NP):
        assert record["stall_limit"] == stall_seconds(gloo=True), record["stall_limit"]


def test_a_round_taken_by_one_rank_stops_every_rank_with_the_group_step_and_ranks(stalled):
    """Rank 1 waits for its extra round in its cross set {1, 3}, rank 3 for the round that
    follows there, ranks 0 and 2 for the node's gather of the slices' updates (their partners
    never get there): each raises ExchangeStalled within the stall-check time of its wait,
    naming the group, the step, the collective and the set's ranks."""
    waits = {0: ([0, 1], ["node.update"]), 1: ([1, 3], ["extra"]), 2: ([2, 3], ["node.update"]),
             3: ([1, 3], ["indices", "counts"])}
    for rank, record in enumerate(rank_records(stalled, 0, NP)):
        error, (group,) = record["error"], record["groups"]
        assert record["steps_done"] == 2 and error is not None, record
        assert error["type"] == "ExchangeStalled", error
        ranks, tags = waits[rank]
        assert (error["group"], error["step"], error["rank"], error["ranks"]) == (group, 2, rank, ranks), error
        assert error["collective"] in [f"hs.{group}.{tag}" for tag in tags], error
        assert STALL_SECONDS <= error["seconds"] < STALL_SECONDS + STALL_SLACK, error
        for part in (repr(group), "step 2", f"rank {rank}", str(ranks), error["collective"]):
            assert part in error["message"], (part, error["message"])
