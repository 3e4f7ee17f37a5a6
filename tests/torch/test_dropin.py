"""The PyTorch wrapper where Horovod users rely on Horovod's own behaviour: the checkpoint idiom
(rank 0 alone loads, then broadcasts), sparse embeddings, the GAN pattern, state broadcast of
every torch.optim optimizer, backward_passes_per_step, synchronize/clipping, unnamed parameters.
Real horovodrun jobs (tests/workers/torch_dropin.py); see that file for each scenario."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.checks import assert_trains_beside_own_collectives
from tests.support.launch import job_fixture, rank_records
from tests.workers.own_collectives import DELIVER_ALL

METHODS = ["topk", "threshold", "dgc", "gaussiank", "micro", "exdyna", "gtopk", "lags", "sparseloco"]
SPARSE = {"density": 0.1, "min_numel": 0}
FULL = {"density": 1.0, "min_numel": 0}


def checkpoint_configs():
    configs = []
    for i, method in enumerate(METHODS):
        options = dict(SPARSE)
        if method == "dgc":
            options["momentum"] = 0.9  # per-rank velocity: stays each rank's own
        if i % 3 == 0:
            options["warmup_steps"] = 2  # rank 0 resumes past warm-up: the others must follow
        configs.append({"scenario": "checkpoint", "method": method, "options": options, "steps": 4, "more": 3,
                        "broadcast": "hvd" if i % 2 == 0 else "hs"})
    configs.append({"scenario": "checkpoint", "method": "micro", "options": {"density": 0.1}, "steps": 4,
                    "more": 3, "broadcast": "hvd"})  # default min_numel: small groups dense
    configs.append({"scenario": "checkpoint", "method": "topk", "options": SPARSE, "groups": "mergecomp",
                    "steps": 2, "more": 3, "broadcast": "hvd"})
    configs.append({"scenario": "checkpoint", "method": "none", "steps": 4, "more": 3, "broadcast": "hvd"})
    return configs


#: A codebase migrated by ``hvd.DistributedOptimizer = hs.DistributedOptimizer`` at start-up.
SWAP = [{"scenario": "checkpoint", "method": method, "options": SPARSE, "steps": 4, "more": 3, "broadcast": "hvd",
         "swap": True} for method in ("topk", "dgc")]
TWO = checkpoint_configs() + SWAP + [
    {"scenario": "embedding", "method": "none"},
    {"scenario": "embedding", "method": "topk", "options": SPARSE},
    {"scenario": "dynamic_requires_grad", "method": "none"},
    {"scenario": "dynamic_requires_grad", "method": "topk", "options": FULL},
    {"scenario": "hooks", "method": "none"},
    {"scenario": "hooks", "method": "topk", "options": FULL},
    {"scenario": "optimizers", "method": "none"},
    {"scenario": "optimizers", "method": "topk", "options": FULL},
] + [{"scenario": "own_collectives", "method": method} for method in METHODS] + [
    {"scenario": "kept_dense", "method": "topk", "options": SPARSE, "groups": "tensor"},
    {"scenario": "kept_dense", "method": "micro", "options": SPARSE, "groups": "model"},
]
THREE = checkpoint_configs()

job2 = job_fixture("torch_dropin.py", 2, TWO)
job3 = job_fixture("torch_dropin.py", 3, THREE)



def label(config):
    options = config.get("options", "")
    return f"{config['method']}-{config.get('groups', '')}-{config['broadcast']}-{options}"


@pytest.mark.parametrize("np_, job_name", [(2, "job2"), (3, "job3")])
@pytest.mark.parametrize("index", range(len(THREE)), ids=[label(c) for c in THREE])
def test_checkpoint_idiom_resumes_in_step_on_every_rank(request, np_, job_name, index):
    """After rank 0 alone loaded and broadcast: every rank at rank 0's step, replicas bitwise
    identical after every step, and bitwise the original run's continuation with the other
    ranks' per-rank state emptied (the documented residual rule)."""
    assert_resumed(THREE[index], rank_records(request.getfixturevalue(job_name), index, np_), np_)


@pytest.mark.parametrize("config", SWAP, ids=[c["method"] for c in SWAP])
def test_checkpoint_idiom_after_a_global_swap(job2, config):
    """With ``hvd.DistributedOptimizer = hs.DistributedOptimizer`` done at start-up, the idiom
    resumes as without the swap (Horovod's ``broadcast_optimizer_state`` still recognises the
    wrapper: no exchange started on the ranks that initialise their state, no hang)."""
    assert_resumed(config, rank_records(job2, TWO.index(config), 2), 2)


def assert_resumed(config, ranks, np_):
    """Every rank at rank 0's step, replicas bitwise identical, bitwise the documented
    continuation."""
    for rank, record in enumerate(ranks):
        assert record["steps"] == ranks[0]["steps"], "step counters differ across ranks"
        assert record["groups"] == record["expected_groups"]
        np.testing.assert_array_equal(np.asarray(record["resumed"]), np.asarray(ranks[0]["resumed"]),
                                      err_msg=f"rank {rank} is not a replica of rank 0")
        if config["method"] == "none" and np_ > 2:
            # Horovod's dense allreduce over 3 ranks sums in an order that depends on how its
            # tensors were fused this time: float32 rounding apart between two runs.
            np.testing.assert_allclose(np.asarray(record["resumed"]), np.asarray(record["expected"]),
                                       rtol=1e-5, atol=1e-7, err_msg=f"rank {rank} did not continue as documented")
        else:
            np.testing.assert_array_equal(np.asarray(record["resumed"]), np.asarray(record["expected"]),
                                          err_msg=f"rank {rank} did not continue as documented")
    if config["method"] != "none":
        assert max(ranks[0]["residual_norms"]) > 0, "no sparse step was taken: the test would prove nothing"


def test_sparse_embedding_with_compression_none_is_stock_horovod(job2):
    index = TWO.index({"scenario": "embedding", "method": "none"})
    for record in rank_records(job2, index, 2):
        for sparse_as_dense in ("False", "True"):
            stock, ours = record[sparse_as_dense]["stock"], record[sparse_as_dense]["ours"]
            for key in ("aggregated", "layout_sparse", "params"):
                np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(stock[key]), err_msg=key)
            assert ours["layout_sparse"] == [True] * 3  # SparseAdam gets sparse gradients back


def test_sparse_embedding_rows_exchanged_exactly_with_a_sparsifier(job2):
    """With a sparsifier the embedding's rows travel as they are: the aggregate is exactly the
    mean of the ranks' local sparse gradients (their rows are already a sparse payload)."""
    index = TWO.index({"scenario": "embedding", "method": "topk", "options": SPARSE})
    ranks = rank_records(job2, index, 2)
    for record in ranks:
        ours = record["False"]["ours"]
        assert ours["layout_sparse"] == [True] * 3
        for step in range(3):
            expected = np.mean([np.asarray(r["False"]["ours"]["local"][step], dtype=np.float64) for r in ranks], axis=0)
            np.testing.assert_allclose(np.asarray(ours["aggregated"][step]), expected, rtol=1e-6, atol=1e-7)
        assert not np.array_equal(np.asarray(ours["local"][0]), np.asarray(ours["aggregated"][0]))


@pytest.mark.parametrize("method", ["none", "topk"])
def test_dynamic_requires_grad_gan_pattern(job2, method):
    """Horovod's test_dynamic_requires_grad: after backward() a trained parameter's .grad holds a
    gradient and a frozen one's is None, and the result matches the stock optimizer."""
    config = next(c for c in TWO if c["scenario"] == "dynamic_requires_grad" and c["method"] == method)
    for record in rank_records(job2, TWO.index(config), 2):
        assert record["ours"]["violations"] == [] and record["stock"]["violations"] == []
        compare(record["ours"]["params"], record["stock"]["params"], method)


def compare(ours, stock, method):
    """Bitwise with Compression.none; with Top-k at density 1 the sum runs in another order
    (scatter-add of allgathered values instead of an allreduce): float32 rounding only."""
    if method == "none":
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(stock))
    else:
        np.testing.assert_allclose(np.asarray(ours), np.asarray(stock), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["none", "topk"])
def test_backward_passes_clipping_and_names_as_stock(job2, method):
    config = next(c for c in TWO if c["scenario"] == "hooks" and c["method"] == method)
    for record in rank_records(job2, TWO.index(config), 2):
        stock, ours = record["stock"], record["ours"]
        for key in ("passes1", "passes2", "noname"):
            compare(ours[key], stock[key], method)
            assert ours[f"{key}_names"] == stock[f"{key}_names"]


@pytest.mark.parametrize("method", ["none", "topk"])
def test_every_optimizer_state_broadcast_after_rank0_load(job2, method):
    """Every torch.optim optimizer, options per rank as numbers and as tensors: after
    hvd.broadcast_optimizer_state every rank holds rank 0's state and options (as the stock
    optimizer does), and the next step keeps replicas identical — which the stock optimizer
    does not: its state initialisation applies weight decay to the non-root ranks' parameters
    after they were broadcast."""
    config = next(c for c in TWO if c["scenario"] == "optimizers" and c["method"] == method)
    ranks = rank_records(job2, TWO.index(config), 2)
    keys = sorted(k for k in ranks[0] if k.endswith("/ours"))
    assert len(keys) >= 2 * 9
    for key in keys:
        stock_key = key.replace("/ours", "/stock")
        for record in ranks:
            assert record[key]["state"] == ranks[0][key]["state"], key
            assert record[key]["options"] == ranks[0][key]["options"] == ranks[0][stock_key]["options"], key
            assert record[key]["option_types"] == ranks[0][stock_key]["option_types"], key
            if method == "none":
                assert record[key]["state"] == record[stock_key]["state"], key
            np.testing.assert_array_equal(np.asarray(record[key]["after"]), np.asarray(ranks[0][key]["after"]),
                                          err_msg=key)


@pytest.mark.parametrize("method", METHODS)
def test_beside_the_models_own_collectives(job2, method):
    """A model that makes Horovod collectives of its own in both passes (a synchronised batch
    norm, an allreduce in its forward): every method trains beside them without a hang or a
    mismatch, replicas identical, and at density 1 the methods that deliver everything give the
    dense run, bitwise (the Horovod collectives sum two ranks in one order)."""
    config = next(c for c in TWO if c["scenario"] == "own_collectives" and c["method"] == method)
    assert_trains_beside_own_collectives(rank_records(job2, TWO.index(config), 2), method, DELIVER_ALL)


@pytest.mark.parametrize("groups", ["tensor", "model"])
def test_kept_dense_parameters(job2, groups):
    """``dense="*.bias"`` beside a sparsifier at density 0.1 (per-tensor groups with Top-k, one
    group with MiCRO; the buckets of Top-k's default are tested as groups in
    tests/torch/test_grouping.py): at every step each bias's aggregated gradient is the ranks' average,
    bitwise (Horovod's allreduce of their own gradients), while the weights' are sparse; the
    biases form one group of their own, after the weights' groups as the strategy forms them,
    marked ``kept_dense`` and dense in the statistics; a misspelt name and ranks choosing
    differently raise on every rank, naming the near miss and what differs."""
    index = next(i for i, c in enumerate(TWO) if c["scenario"] == "kept_dense" and c.get("groups") == groups)
    for record in rank_records(job2, index, 2):
        for exact in record["exact"]:
            assert exact["0.bias"] and exact["2.bias"], exact
        assert not any(exact["0.weight"] or exact["2.weight"] for exact in record["exact"]), record["exact"]
        weights = [["0.weight", "2.weight"]] if groups == "model" else [["0.weight"], ["2.weight"]]  # per tensor
        assert record["groups"] == [*weights, ["0.bias", "2.bias"]]
        stats = record["stats"]
        assert [s["kept_dense"] for s in stats] == [False] * len(weights) + [True], stats
        assert [s["dense"] for s in stats] == [False] * len(weights) + [True], stats
        assert "dense='0.bais' matches no parameter" in record["typo"] and "'0.bias'" in record["typo"]
        assert "dense=['2.bias'] (rank 0: ['0.bias'])" in record["mismatch"], record["mismatch"]
