"""horovod_sparse's wrappers with Horovod's own compressions (``hvd.Compression.none`` /
``hvd.Compression.fp16``) against the stock wrappers, one wrapper argument at a time: PyTorch's
``hvd.DistributedOptimizer``, TensorFlow's ``hvd.DistributedGradientTape`` and the Keras
``hvd.DistributedOptimizer``. Real horovodrun jobs (tests/workers/torch_stock.py,
tests/workers/tf_stock.py); bitwise everywhere.

Why bitwise holds: both wrappers issue, per gradient, the same Horovod allreduce (same op,
prescale and postscale factors, process set, compression), and a sum over two ranks is the same
float whichever rank's value comes first, however Horovod fused the tensors. The process-set
jobs run 3 workers with a set of ranks {0, 1}: again two values per sum, and rank 2 applies its
own gradient with both wrappers. (Over 3 ranks the order of a sum depends on how Horovod fused
the tensors that cycle, which two runs of the same wrapper need not repeat: see the 3-worker
``Compression.none`` case of tests/torch/test_dropin.py; so the global comparisons use 2.)

One argument is honoured where the stock PyTorch optimizer drops it: ``gradient_predivide_factor``
with ``groups`` (its grouped allreduce passes no pre/postscale factors, so its result is
``sum / size`` whatever the factor; TensorFlow's passes them). Ours applies the factor in every
group, so it equals the stock optimizer's *ungrouped* result bitwise. (Not the grouped one even
for a factor of 4 under ``Compression.fp16``: dividing a float16 subnormal by 4 rounds.)

``op=hvd.Adasum`` with a dense compression is Horovod's own (PyTorch: ours returns what
``hvd.DistributedOptimizer`` returns, its Adasum optimizer; the tape: Horovod's reduction);
under Gloo both wrappers fail alike at the first step ("No Adasum operation enabled": Horovod's
CPU Adasum needs its MPI controller). The Keras wrappers both refuse it.

Where the stock PyTorch optimizer fails, ours does not: with ``Compression.fp16`` it cannot
aggregate a sparse gradient (it decompresses the allgathered rows without a context); ours
aggregates the rows exactly whatever the compression, as with ``Compression.none``.

Also here, the bad inputs that need several ranks: a parameter of another shape (as many
elements) or dtype on one rank makes every rank raise the configuration ``ValueError``.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.launch import job_fixture, rank_records
from tests.support.mismatch import assert_every_rank_refused

#: Groups as lists: of parameter names (PyTorch), of positions in the variable list (TensorFlow).
LISTS = [["out.bias", "embedding.weight"], ["hidden.weight"]]
TF_LISTS = [[3, 0], [1]]
PAIR = [0, 1]


def compare(scenario, compression, stock=None, **wrapper):
    """A comparison of ours and the stock wrapper given the same ``wrapper`` arguments (``stock``:
    arguments of the stock wrapper that differ); ``sparse_embedding`` and ``traced`` are worker
    options, not arguments."""
    config = {"scenario": scenario, "compression": compression,
              "sparse_embedding": wrapper.pop("sparse_embedding", False), "traced": wrapper.pop("traced", False),
              "wrapper": wrapper}
    if stock is not None:
        config["stock"] = stock
    return config


def label(config):
    if "wrapper" not in config:
        return config.get("name", config["scenario"])
    options = ",".join(f"{k}={v}" for k, v in config["wrapper"].items())
    extra = (("-sparse" if config.get("sparse_embedding") else "") + ("-traced" if config.get("traced") else "")
             + (f"-stock{config['stock']}" if "stock" in config else ""))
    return f"{config['scenario']}-{config['compression']}-{options or 'default'}{extra}"


def torch_arguments(compression):
    """Every argument of hvd.DistributedOptimizer, alone and in the combinations that interact."""
    def torch(**wrapper):
        return compare("torch", compression, **wrapper)

    return [
        torch(), torch(op="Average"), torch(op="Sum"), torch(gradient_predivide_factor=3.0),
        torch(num_groups=2), torch(groups=2), torch(groups=LISTS),
        torch(stock={"groups": None}, groups=LISTS, gradient_predivide_factor=3.0),
        torch(backward_passes_per_step=2), torch(backward_passes_per_step=3, groups=LISTS),
        torch(backward_passes_per_step=2, groups=2, op="Sum"),
        torch(sparse_embedding=True), torch(sparse_embedding=True, op="Sum"),
        torch(sparse_embedding=True, sparse_as_dense=True),
        torch(sparse_embedding=True, sparse_as_dense=True, op="Sum"),
        torch(op="Adasum"),
    ]


def torch_process_set(compression):
    return [compare("torch", compression, process_set=PAIR),
            compare("torch", compression, process_set=PAIR, op="Sum"),
            compare("torch", compression, process_set=PAIR, gradient_predivide_factor=3.0),
            compare("torch", compression, process_set=PAIR, groups=LISTS, backward_passes_per_step=2),
            compare("torch", compression, process_set=PAIR, sparse_embedding=True, sparse_as_dense=True)]


def tf_arguments(compression):
    """Every argument of hvd.DistributedGradientTape and of the Keras hvd.DistributedOptimizer."""
    def tape(**wrapper):
        return compare("tape", compression, **wrapper)

    def keras(**wrapper):
        return compare("keras", compression, **wrapper)

    return [
        tape(), tape(op="Average"), tape(op="Sum"), tape(gradient_predivide_factor=3.0), tape(num_groups=2),
        tape(groups=2), tape(groups=TF_LISTS), tape(groups=TF_LISTS, gradient_predivide_factor=3.0),
        tape(sparse_embedding=True), tape(sparse_embedding=True, op="Sum"),
        tape(sparse_embedding=True, sparse_as_dense=True), tape(sparse_embedding=True, sparse_as_dense=True, op="Sum"),
        tape(op="Adasum"),
        tape(traced=True), tape(traced=True, op="Sum", groups=TF_LISTS),
        keras(), keras(op="Sum"), keras(gradient_predivide_factor=3.0), keras(num_groups=2), keras(groups=TF_LISTS),
        keras(backward_passes_per_step=2), keras(backward_passes_per_step=2, average_aggregated_gradients=True),
        keras(sparse_embedding=True), keras(sparse_embedding=True, sparse_as_dense=True), keras(op="Adasum"),
    ]


def tf_process_set(compression):
    return [compare("tape", compression, process_set=PAIR), compare("tape", compression, process_set=PAIR, op="Sum"),
            compare("tape", compression, process_set=PAIR, gradient_predivide_factor=3.0, groups=TF_LISTS),
            compare("keras", compression, process_set=PAIR),
            compare("keras", compression, process_set=PAIR, backward_passes_per_step=2)]


def mismatches(key, dtype, shapes):
    """Rank 1's ``scale`` parameter of another shape (as many elements) or dtype, with Horovod's
    dense path and with a sparsifier; ``key(compression)`` is the parameter's group in the
    message, ``dtype(name)`` a dtype's spelling, ``shapes`` rank 1's and rank 0's shapes."""
    return [{"scenario": "mismatch", "name": f"{kind}-{compression}", "compression": compression, "rank1": rank1,
             "expect": f"{field}.{key(compression)}={mine} (rank 0: {theirs})"}
            for compression in ("none", "topk")
            for kind, rank1, field, mine, theirs in (
                ("shape", {"shape": [8, 16]}, "shapes", *shapes),
                ("dtype", {"dtype": "float64"}, "groups",
                 f"'128 x {dtype('float64')}'", f"'128 x {dtype('float32')}'"))]


TORCH_MISMATCHES = mismatches(lambda compression: "scale.weight", lambda name: f"torch.{name}",
                              ("[[16, 8]]", "[[8, 16]]"))
#: TensorFlow's dense path keys groups by position (its op names are Horovod's business).
TF_MISMATCHES = mismatches(lambda compression: "5" if compression == "none" else "m_scale:0", str,
                           ("[[8, 16]]", "[[16, 8]]"))
SET_PASSES = {"scenario": "set_passes", "values": [0, -2, True, 2.0, 3]}
TORCH_TWO = torch_arguments("none") + torch_arguments("fp16") + TORCH_MISMATCHES + [SET_PASSES]
TORCH_THREE = torch_process_set("none") + torch_process_set("fp16")
TF_TWO = tf_arguments("none") + tf_arguments("fp16") + TF_MISMATCHES
TF_THREE = tf_process_set("none") + tf_process_set("fp16")

torch2 = job_fixture("torch_stock.py", 2, TORCH_TWO)
torch3 = job_fixture("torch_stock.py", 3, TORCH_THREE)
tf2 = job_fixture("tf_stock.py", 2, TF_TWO)
tf3 = job_fixture("tf_stock.py", 3, TF_THREE)


def assert_same_run(ours, stock, what):
    """Same steps, bitwise the same aggregated gradients (when recorded) and parameters after
    every step."""
    assert "error" not in stock and "error" not in ours, f"{what}: {stock.get('error')} / {ours.get('error')}"
    assert len(ours["params"]) == len(stock["params"]) > 0
    for step, (mine, theirs) in enumerate(zip(ours.get("grads", []), stock.get("grads", []))):
        np.testing.assert_equal(mine, theirs, err_msg=f"{what}: gradients of step {step}")
    for step, (mine, theirs) in enumerate(zip(ours["params"], stock["params"])):
        np.testing.assert_equal(mine, theirs, err_msg=f"{what}: parameters after step {step}")


def cases(job, np_, configs, keep):
    return [(job, np_, configs, i) for i, c in enumerate(configs) if keep(c)]


def comparable(config):
    """Configs where both wrappers run (not Adasum under Gloo; not the stock wrapper's fp16 crash)."""
    return (config["scenario"] in ("torch", "tape", "keras") and config["wrapper"].get("op") != "Adasum"
            and not (config["scenario"] == "torch" and config["compression"] == "fp16"
                     and config["sparse_embedding"] and not config["wrapper"].get("sparse_as_dense")))


COMPARED = (cases("torch2", 2, TORCH_TWO, comparable) + cases("torch3", 3, TORCH_THREE, comparable)
            + cases("tf2", 2, TF_TWO, comparable) + cases("tf3", 3, TF_THREE, comparable))


@pytest.mark.parametrize("job, np_, configs, index", COMPARED, ids=[f"n{n}-{label(c[i])}" for _, n, c, i in COMPARED])
def test_wrapper_is_stock_horovod_argument_by_argument(request, job, np_, configs, index):
    """Bitwise the stock wrapper's gradients and parameters after every step, on every rank."""
    for rank, record in enumerate(rank_records(request.getfixturevalue(job), index, np_)):
        assert_same_run(record["ours"], record["stock"], f"{label(configs[index])} rank {rank}")


def run_of(job, configs, np_, name, kind="stock", rank=0):
    """One wrapper's run (rank 0) in the config labelled ``name``."""
    return rank_records(job, [label(c) for c in configs].index(name), np_)[rank][kind]


def final_params(run):
    return np.concatenate([np.asarray(v).reshape(-1) for v in
                           (run["params"][-1].values() if isinstance(run["params"][-1], dict) else run["params"][-1])])


@pytest.mark.parametrize("compression", ["none", "fp16"])
@pytest.mark.parametrize("scenario", ["torch", "tape", "keras"])
def test_comparisons_see_each_argument(request, scenario, compression):
    """The arguments compared change the stock result, so ours ignoring one would fail above:
    op=Sum, the predivide factor (in the rounding), accumulation, the process set (rank 2 keeps
    its own gradient)."""
    job, configs, three, configs3 = (("torch2", TORCH_TWO, "torch3", TORCH_THREE) if scenario == "torch"
                                     else ("tf2", TF_TWO, "tf3", TF_THREE))
    job, three = request.getfixturevalue(job), request.getfixturevalue(three)
    default = final_params(run_of(job, configs, 2, f"{scenario}-{compression}-default"))
    changed = ["op=Sum", "gradient_predivide_factor=3.0"]
    if scenario != "tape":
        changed.append("backward_passes_per_step=2")
    for options in changed:
        assert not np.array_equal(final_params(run_of(job, configs, 2, f"{scenario}-{compression}-{options}")),
                                  default), options
    pair = [final_params(run_of(three, configs3, 3, f"{scenario}-{compression}-process_set=[0, 1]", rank=r))
            for r in range(3)]
    np.testing.assert_array_equal(pair[0], pair[1])
    assert not np.array_equal(pair[0], pair[2])


def test_torch_sparse_as_dense_is_seen_under_fp16(torch2):
    """An embedding's rows travel as float16 only when densified (sparse_as_dense)."""
    assert not np.array_equal(final_params(run_of(torch2, TORCH_TWO, 2, "torch-fp16-sparse_as_dense=True-sparse")),
                              final_params(run_of(torch2, TORCH_TWO, 2, "torch-none-sparse_as_dense=True-sparse")))


def test_torch_fp16_sparse_rows_where_the_stock_optimizer_fails(torch2):
    """Horovod's optimizer with Compression.fp16 fails on a sparse gradient (it decompresses the
    allgathered rows with no context); ours aggregates the rows exactly, whatever the
    compression: the embedding's first aggregate is bitwise the stock one with Compression.none
    (the dense layers travel as float16, so later steps start from other parameters)."""
    for options in ("default", "op=Sum"):
        for rank in range(2):
            stock = run_of(torch2, TORCH_TWO, 2, f"torch-fp16-{options}-sparse", rank=rank)
            assert stock["error"].startswith("AttributeError"), stock
            ours = run_of(torch2, TORCH_TWO, 2, f"torch-fp16-{options}-sparse", kind="ours", rank=rank)
            assert "error" not in ours and len(ours["params"]) == 3
            exact = run_of(torch2, TORCH_TWO, 2, f"torch-none-{options}-sparse", rank=rank)
            np.testing.assert_array_equal(ours["grads"][0]["embedding.weight"], exact["grads"][0]["embedding.weight"])


@pytest.mark.parametrize("index", [i for i, c in enumerate(TORCH_TWO) if c["scenario"] == "torch"
                                   and {"groups", "num_groups"} & set(c["wrapper"]) and "stock" not in c],
                         ids=lambda i: label(TORCH_TWO[i]))
def test_torch_groups_formed_as_stock(torch2, index):
    """groups / num_groups (an int, lists of parameters): the same partition of the parameters
    as the stock optimizer's (whose grouping does not show in the values over two ranks)."""
    for record in rank_records(torch2, index, 2):
        assert record["ours"]["groups"] == record["stock"]["groups"] and len(record["stock"]["groups"]) >= 2


@pytest.mark.parametrize("scenario, job, configs", [("torch", "torch2", TORCH_TWO), ("tape", "tf2", TF_TWO),
                                                    ("keras", "tf2", TF_TWO)])
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_adasum_as_stock(request, scenario, job, configs, compression):
    """op=hvd.Adasum with a dense compression is Horovod's own: under Gloo both wrappers fail
    alike at the first step (Horovod's CPU Adasum needs MPI); both Keras wrappers refuse it."""
    index = [label(c) for c in configs].index(f"{scenario}-{compression}-op=Adasum")
    expected = "op currently only supports" if scenario == "keras" else "No Adasum operation enabled"
    for record in rank_records(request.getfixturevalue(job), index, 2):
        ours, stock = record["ours"]["error"], record["stock"]["error"]
        # The same error; in TensorFlow it names whichever gradient's allreduce failed first.
        assert ours.split(":")[0] == stock.split(":")[0] and expected in ours and expected in stock


@pytest.mark.parametrize("job, cases_", [("torch2", TORCH_MISMATCHES), ("tf2", TF_MISMATCHES)])
def test_shape_or_dtype_mismatch_raises_on_every_rank(request, job, cases_):
    """A parameter of another shape (as many elements) or dtype on rank 1: the configuration
    ValueError on every rank, naming the parameter, with Horovod's dense path and a sparsifier."""
    configs = TORCH_TWO if job == "torch2" else TF_TWO
    for case in cases_:
        assert_every_rank_refused(rank_records(request.getfixturevalue(job), configs.index(case), 2), case)


def test_torch_set_backward_passes_per_step_checks_like_the_constructor(torch2):
    for record in rank_records(torch2, TORCH_TWO.index(SET_PASSES), 2):
        assert record == {"0": ["ValueError: backward_passes_per_step must be > 0", 1],
                          "-2": ["ValueError: backward_passes_per_step must be > 0", 1],
                          "True": ["TypeError: backward_passes_per_step must be an integer > 0, got True", 1],
                          "2.0": ["TypeError: backward_passes_per_step must be an integer > 0, got 2.0", 1],
                          "3": [None, 3]}
