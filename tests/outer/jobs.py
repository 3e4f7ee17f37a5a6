"""The outer-steps job shared by ``tests/outer``'s modules (one ``torchrun`` launch: the configs
of ``tests/workers/outer_steps.py``) and the written-out reference of the synchronous rounds.
"""
import subprocess
import sys

import numpy as np
import torch

import horovod_sparse.methods  # noqa: F401  (registers every method)
from horovod_sparse.common.registry import method_names
from tests.support.reference_grouping import group_exchange
from tests.torch.test_threshold_baselines import DENSITY as BASELINE_DENSITY
from tests.support.launch import HANG_TIMEOUT, worker_env
from tests.workers.given_gradients import make_params


SHAPES = [[30, 20], [20], [40, 30], [7]]
EVERY, STEPS, SEED = 3, 9, 5
#: The threshold baselines' references are written for their own density.
THRESHOLDS = ("threshold", "dgc", "gaussiank")


def options(method):
    base = {"density": BASELINE_DENSITY if method in THRESHOLDS else 0.05, "min_numel": 0}
    return {**base, "adaptive": False} if method == "lags" else base


def config(name, method, **extra):
    return {"name": name, "method": method, "options": {} if method == "none" else options(method),
            "every": EVERY, "steps": STEPS, "seed": SEED, "shapes": SHAPES, "outer": "sgd1", **extra}


METHODS = method_names()
EXACT = [config(m, m) for m in METHODS]
#: The default outer optimizer (DiLoCo's Nesterov SGD), dense and sparse, with a final sync after
#: a part round.
DILOCO = [config("diloco_none", "none", outer="diloco", steps=STEPS + 1, sync_at_end=True),
          config("diloco_topk", "topk", outer="diloco", steps=STEPS + 1, sync_at_end=True)]
#: Saved mid-round (after 4 inner steps: 1 into the second round) and resumed in fresh objects.
RESUME = [config(f"{m}_{via}_{part}", m, steps=STEPS + 3,
                 **({"resume_at": 4, "resume_via": via} if part == "resumed" else {}))
          for m in ("topk", "micro") for via in ("torch", "dcp") for part in ("whole", "resumed")]
#: Rank 1's gradient is NaN in the second round (inner step 4); plain SGD inside (a NaN in the inner
#: optimizer's momentum would stay there: the inner optimizer's state is the user's).
NONFINITE = [config(f"nan_{policy}", "topk", nan_at=[4, 1], nonfinite=policy, inner_momentum=0.0)
             for policy in ("skip", "raise")]
MISMATCH = [config("mismatch", "topk", every_of_rank={"1": EVERY + 1})]
#: SparseLoCo with error feedback with decay (Templar's e <- 0.95 e + g).
DECAY = config("sparseloco_decay", "sparseloco", options={**options("sparseloco"), "error_decay": 0.95})
#: SparseLoCo's 2-D blocks (4 x 4 here: the 30 x 20 parameter's edge blocks are 2 x 4) and runs of 16
#: of the 1-D parameters, at a density that keeps 2 of 16.
BLOCKS = config("sparseloco_blocks", "sparseloco", options={**options("sparseloco"), "blocks": True,
                                                            "chunk_size": 16, "density": 0.125})
#: Overlapped rounds (``overlap=True``) of every method; streamed fragments (2, overlapped) of every
#: method; 3 fragments of synchronous rounds. Each flushed at the end (after the last boundary).
OVERLAP = [config(f"overlap_{m}", m, overlap=True, flush_at_end=True) for m in METHODS]
STREAMED = ([config(f"streamed_{m}", m, overlap=True, fragments=2, flush_at_end=True) for m in METHODS]
            + [config("streamed_sync_topk", "topk", fragments=3, flush_at_end=True)])
#: Overlapped and streamed, saved one inner step after fragment 0's boundary at step 3 (its
#: exchange in flight) and resumed in fresh objects; the last with the outer state offloaded.
STREAMED_RESUME = [config(f"streamed_{m}_{via}{'_offload' if offload else ''}_{part}", m, overlap=True, fragments=2,
                          flush_at_end=True, steps=STEPS + 3, offload=offload,
                          **({"resume_at": 4, "resume_via": via} if part == "resumed" else {}))
                   for m, via, offload in (("topk", "torch", False), ("micro", "dcp", False), ("topk", "dcp", True))
                   for part in ("whole", "resumed")]
#: Overlapped rounds with rank 1's NaN in the second round (inner step 4): its exchange ends, and
#: is abandoned, at the third round's end.
NONFINITE_OVERLAP = [config(f"nan_overlap_{policy}", "topk", nan_at=[4, 1], nonfinite=policy, inner_momentum=0.0,
                            overlap=True, flush_at_end=True) for policy in ("skip", "raise")]
#: Overlapped over 2 fragments, ended as the docs say: ``sync()`` after the last inner step (mid-cycle,
#: step 7 of 3-step rounds), then ``flush()``.
STREAMED_END = config("streamed_end_topk", "topk", overlap=True, fragments=2, steps=STEPS - 1, sync_at_end=True,
                      flush_at_end=True)
#: The outer state offloaded (``offload=True``), each the twin of a config above on the device:
#: overlapped Top-k, streamed MiCRO, DiLoCo's default Nesterov step with Top-k.
OFFLOAD = {"offload_overlap_topk": "overlap_topk", "offload_streamed_micro": "streamed_micro",
           "offload_diloco_topk": "diloco_topk"}
OFFLOADED = [{**next(c for c in OVERLAP + STREAMED + DILOCO if c["name"] == twin), "name": name, "offload": True}
             for name, twin in OFFLOAD.items()]
CONFIGS = (EXACT + DILOCO + RESUME + NONFINITE + MISMATCH + [DECAY, BLOCKS] + OVERLAP + STREAMED + STREAMED_RESUME
           + NONFINITE_OVERLAP + [STREAMED_END] + OFFLOADED)


def as32(array):
    return array.astype(np.float32)


def round_thetas(obs, j):
    """``thetas[r][i]``: rank r's parameter i (flat, float32) at the end of round j."""
    return [[as32(obs.arrays[r][f"theta_{j}_{i}"]).reshape(-1) for i in range(len(SHAPES))] for r in range(obs.size)]


def start_params():
    """Rank 0's initial parameters, flat float32 (what every rank takes at construction)."""
    return [p.detach().numpy().reshape(-1).copy() for p in make_params(SHAPES, SEED, torch.float32)]


def dense_average(numel, ranks):
    """DiLoCo's dense exchange: the mean of the ranks' pseudo-gradients, no residual kept."""
    def exchange(xs, step):
        mean = sum(xs) / np.float32(ranks)
        for x in xs:
            x[:] = 0
        return mean

    return exchange


def reference_rounds(cfg, obs, outer_step, exchange_of=None, start=None, shapes=SHAPES, abandoned=(), nan=None):
    """The written-out rounds: per round j the expected averaged pseudo-gradients and parameters
    after the outer step (``outer_step(anchor, update, i)`` of parameter i), and the final
    residuals ``[rank][i]``; each parameter's exchange from ``exchange_of(numel, ranks)``
    (default: the method's reference, ``tests.support.reference_grouping.group_exchange``), from
    the parameters ``start`` of ``shapes`` (default: rank 0's initial ones, :func:`start_params`).
    A round in ``abandoned`` delivers nothing (zeros, and no outer step) and leaves each residual
    ``residual + anchor - θ``, except where ``nan = (rank, parameter)`` was not finite (unchanged)."""
    ranks, rounds = obs.size, len(obs.meta[0]["rounds"])
    anchor = start_params() if start is None else start
    exchanges = ([exchange_of(a.size, ranks) for a in anchor] if exchange_of else
                 [group_exchange(cfg["method"], cfg["options"], a.size, ranks, [shape])
                  for a, shape in zip(anchor, shapes)])
    residuals = [[np.zeros_like(a) for a in anchor] for _ in range(ranks)]
    expected = []
    for j in range(rounds):
        thetas, updates = round_thetas(obs, j), []
        for i, exchange in enumerate(exchanges):
            xs = [residuals[r][i] + (np.float32(0) if j in abandoned and (r, i) == nan else anchor[i] - thetas[r][i])
                  for r in range(ranks)]
            updates.append(np.zeros_like(anchor[i]) if j in abandoned else exchange(xs, j))
            for r in range(ranks):
                residuals[r][i] = xs[r]
        if j not in abandoned:
            anchor = [outer_step(anchor[i], updates[i], i) for i in range(len(anchor))]
        expected.append((updates, anchor))
    return expected, residuals


def nesterov_reference():
    """DiLoCo's outer step (SGD, lr 0.7, momentum 0.9, Nesterov) in float64 per round, as torch
    defines it: ``b = 0.9 b + g`` (``b = g`` at first), ``θ = anchor - 0.7 (g + 0.9 b)``."""
    buffers = {}

    def step(anchor, update, i):
        b = buffers.get(i)
        b = update.astype(np.float64) if b is None else 0.9 * b + update
        buffers[i] = b
        return (anchor - 0.7 * (update + 0.9 * b)).astype(np.float32)

    return step




def reference_streamed(cfg, obs, abandoned=(), nan=None, start=None, shapes=SHAPES):
    """The written-out overlapped and streamed rounds, with SGD of lr 1 outside: per boundary
    ``j`` (fragment ``f`` of the worker's record) each rank's expected parameters after it, then
    after the final flush, and the final residuals ``[rank][i]``.

    At a boundary: ``d = anchor - θ`` of fragment ``f``'s parameters; the exchange in flight ends
    and its outer step is taken (``anchor' = anchor - average``; a parameter of another fragment
    keeps its progress, ``θ = anchor' - (anchor - θ)``); ``f``'s parameters go back to their
    anchor and the method's exchange of ``residual + d`` starts (the ``j``-th exchange); without
    ``overlap`` it ends at once. Exchanges ``abandoned`` deliver nothing and leave each
    residual ``residual + d``, except where ``nan = (rank, parameter)`` was not finite. From the
    parameters ``start`` of ``shapes`` (default: rank 0's initial ones, :func:`start_params`)."""
    ranks, meta = obs.size, obs.meta[0]
    fragments = meta["fragments"]
    anchor = start_params() if start is None else list(start)
    exchanges = [group_exchange(cfg["method"], cfg["options"], a.size, ranks, [shape])
                 for a, shape in zip(anchor, shapes)]
    residuals = [[np.zeros_like(a) for a in anchor] for _ in range(ranks)]
    landed, expected = None, []

    def take(params, boundary):
        fragment, updates = landed
        for i, update in zip(fragments[fragment], updates or []):
            new = anchor[i] - update
            for r in range(ranks):
                params[r][i] = new.copy() if fragment == boundary else new - (anchor[i] - params[r][i])
            anchor[i] = new

    for j, entry in enumerate(meta["rounds"]):
        f, thetas = entry["fragment"], round_thetas(obs, j)
        params = [[t.copy() for t in thetas[r]] for r in range(ranks)]
        deltas = {i: [anchor[i] - thetas[r][i] for r in range(ranks)] for i in fragments[f]}
        if landed is not None:
            take(params, f)
        updates = []
        for i in fragments[f]:
            xs = [residuals[r][i] + deltas[i][r] for r in range(ranks)]
            if j not in abandoned:
                updates.append(exchanges[i](xs, j))
            for r in range(ranks):
                residuals[r][i] = residuals[r][i] if j in abandoned and (r, i) == nan else xs[r]
                params[r][i] = anchor[i].copy()
        landed = (f, None if j in abandoned else updates)
        if not cfg.get("overlap"):
            take(params, f)
            landed = None
        expected.append(params)
    final = [[p.copy() for p in expected[-1][r]] for r in range(ranks)]
    if landed is not None:
        take(final, None)
    return expected, final, residuals


def assert_rounds(cfg, obs):
    """Every round of ``obs`` on both ranks, and the final residuals, bitwise those of
    :func:`reference_rounds` with plain SGD of lr 1 outside."""
    method = cfg["name"]
    expected, residuals = reference_rounds(cfg, obs, lambda anchor, update, i: anchor - update)
    for j, (updates, params) in enumerate(expected):
        for r in range(2):
            for i in range(len(SHAPES)):
                where = f"{method} round {j} rank {r} parameter {i}"
                np.testing.assert_array_equal(as32(obs.arrays[r][f"agg_{j}_{i}"]), updates[i], err_msg=where)
                np.testing.assert_array_equal(as32(obs.arrays[r][f"param_{j}_{i}"]).reshape(-1), params[i],
                                              err_msg=where)
    for r in range(2):
        for i in range(len(SHAPES)):
            np.testing.assert_array_equal(as32(obs.arrays[r][f"residual_{len(expected) - 1}_{i}"]), residuals[r][i],
                                          err_msg=f"{method} final residual rank {r} parameter {i}")


def assert_streamed(cfg, obs, **reference):
    """Every boundary's parameters on both ranks, the parameters after the flush and the final
    residuals, bitwise those of the written-out rounds (:func:`reference_streamed` given ``reference``)."""
    expected, final, residuals = reference_streamed(cfg, obs, **reference)
    for r in range(obs.size):
        for i in range(len(SHAPES)):
            where = f"{cfg['name']} rank {r} parameter {i}"
            for j, params in enumerate(expected):
                np.testing.assert_array_equal(as32(obs.arrays[r][f"param_{j}_{i}"]).reshape(-1), params[r][i],
                                              err_msg=f"{where} boundary {j}")
            np.testing.assert_array_equal(as32(obs.arrays[r][f"final_{i}"]).reshape(-1), final[r][i],
                                          err_msg=f"{where} after the flush")
            np.testing.assert_array_equal(as32(obs.arrays[r][f"final_residual_{i}"]), residuals[r][i],
                                          err_msg=f"{where} final residual")


def assert_twins(horovod, twin, name):
    """``horovod``'s records (an :class:`~tests.support.checks.Observed` of a ``horovodrun`` job) those
    of its ``torch.distributed`` ``twin`` on every rank: every recorded array bitwise, every
    boundary's inner step, fragment, closed exchanges and abandonment, every error raised."""
    for r in range(twin.size):
        assert sorted(horovod.arrays[r]) == sorted(twin.arrays[r])
        for key, value in twin.arrays[r].items():
            np.testing.assert_array_equal(horovod.arrays[r][key], value, err_msg=f"{name} rank {r} {key}")
        assert boundaries(horovod, r) == boundaries(twin, r)
        assert horovod.meta[r]["errors"] == twin.meta[r]["errors"]
        assert horovod.meta[r]["horovod_imported"]


def boundaries(obs, r):
    """Rank ``r``'s boundaries: inner step, fragment, exchanges closed, whether the last was abandoned."""
    return [(x["step"], x["fragment"], x["steps"], x["stats"] and x["stats"]["abandoned"])
            for x in obs.meta[r]["rounds"]]


def assert_recorded_rounds(cfg, obs, expected, residuals, ranks, abandoned=()):
    """Each of ``ranks``' records in ``obs``, bitwise: every round's average (sparse groups, rounds
    not ``abandoned``) and parameters after it those of ``expected`` (per round ``(updates,
    params)``, the same for every one of ``ranks``), its final residuals ``residuals[k]`` (``k``: its
    place in ``ranks``; none for ``Compression.none``)."""
    for j, (updates, params) in enumerate(expected):
        for r in ranks:
            for i in range(len(SHAPES)):
                where = f"{cfg['name']} round {j} rank {r} parameter {i}"
                if f"agg_{j}_{i}" in obs.arrays[r] and j not in abandoned:
                    np.testing.assert_array_equal(as32(obs.arrays[r][f"agg_{j}_{i}"]), updates[i], err_msg=where)
                np.testing.assert_array_equal(as32(obs.arrays[r][f"param_{j}_{i}"]).reshape(-1), params[i],
                                              err_msg=where)
    last = len(expected) - 1
    for k, r in enumerate(ranks):
        for i in range(len(SHAPES)):
            if cfg["method"] != "none":
                np.testing.assert_array_equal(as32(obs.arrays[r][f"residual_{last}_{i}"]), residuals[k][i],
                                              err_msg=f"{cfg['name']} final residual rank {r} parameter {i}")


def assert_second_round_abandoned(obs, policy, bad_rank):
    """On every rank of ``obs``: the second of three rounds abandoned (its parameters the first
    round's: no outer step), ``"raise"`` raising at its end naming ``bad_rank`` (``"skip"``: no
    error), and every residual finite after the third."""
    for r in range(obs.size):
        assert [x["stats"]["abandoned"] for x in obs.meta[r]["rounds"]] == [False, True, False]
        errors = obs.meta[r]["errors"]
        if policy == "raise":
            assert [e[0] for e in errors] == [2 * EVERY - 1] and f"rank(s) [{bad_rank}]" in errors[0][1], errors
        else:
            assert errors == []
        for i in range(len(SHAPES)):
            np.testing.assert_array_equal(obs.arrays[r][f"param_1_{i}"], obs.arrays[r][f"param_0_{i}"])
            assert np.isfinite(obs.arrays[r][f"residual_2_{i}"]).all()


#: What every one-process refusal script (:func:`one_process_lines`) starts with: a one-rank
#: ``torch.distributed`` group and Horovod, a small model, its inner optimizer, and ``refused(make)``
#: printing the error ``make()`` raises (one line), or ``accepted``.
ONE_PROCESS = r"""
import os, io
import torch, torch.distributed as dist, horovod.torch as hvd
import horovod_sparse.outer as hso, horovod_sparse.torch as hs
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
hvd.init()
model = torch.nn.Linear(4, 2)
inner = torch.optim.SGD(model.parameters(), lr=0.1)
def refused(make):
    try:
        make()
    except (ValueError, TypeError) as error:
        print(str(error).replace("\n", " "))
    else:
        print("accepted")
"""


def one_process_lines(body, port, count):
    """The last ``count`` lines ``body`` printed after :data:`ONE_PROCESS` (``port``: the group's
    rendezvous), run in a fresh process that must exit 0."""
    script = ONE_PROCESS.replace("{port}", str(port)) + body + "\ndist.destroy_process_group()\n"
    result = subprocess.run([sys.executable, "-c", script], env=worker_env(), capture_output=True, text=True,
                            timeout=HANG_TIMEOUT)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-count:]
