#!/usr/bin/env python
"""The mutation check: does the test suite still catch realistic breaks of the package?

Each entry of :data:`MUTATIONS` is one named, realistic break: a small textual patch (a file, a
piece of today's code that must occur exactly once in it, and its replacement) and the pytest
selection that should catch it (test files, node ids, ``-k`` filters: as small as the guarantee
allows, so the whole check runs in reasonable time). For each break in turn the script

1. copies the tree (``git archive HEAD`` by default, ``--source worktree`` for the working tree
   with its uncommitted and untracked files; ``.venv`` and ``.git`` are never copied: the tests
   run with this checkout's ``.venv/bin/python -m pytest``),
2. applies the patch to the copy (a break whose text is gone or repeated fails the whole run
   loudly: ``stale mutation NAME``; so does one that no longer compiles),
3. for breaks that hang a job (a rank skipping a collective), lowers the suite's hang guard
   (``tests/support/launch.py`` ``HANG_TIMEOUT``) in the copy, so the hang fails the test in bounded time,
4. runs its selection in the copy (``-x -q``, ``OMP_NUM_THREADS=1``, a time limit per break) and
   reports *caught* (some test failed: the first failing node id is named) or *survived*.

The workers of the multi-process tests import the copy's package (``tests/support/launch.py`` puts the
copy's root on ``PYTHONPATH``; the pytest process imports it from its root directory): the script
checks that once before the first break and prints where ``horovod_sparse`` is imported from.

    make mutations                                 # every break, results in results/mutations.json
    python scripts/mutations.py --list             # the breaks and their selections
    python scripts/mutations.py --only torch-pick-strict tf-average-scale-dropped
    python scripts/mutations.py --check            # only that every break still applies
    python scripts/mutations.py --baseline         # the selections must pass on the unbroken copy

Exit status: 0 when every break run was caught, 1 when one survived (or its run failed to
start, or ran past its time limit without a failure), 2 on a stale or broken mutation list.
``--jobs N`` runs N breaks at a time (each in its own copy); the default, 1, suits a 2-core
machine, where the multi-process tests already use both cores.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
#: The hang guard a break marked ``hang`` runs under (seconds; the suite's own is 900 s): above
#: what its selection's healthiest launch takes on a busy 2-core machine, far below 900.
HANG_TIMEOUT = 240
#: Seconds a break's whole pytest run may take before it is stopped (counted as not caught).
TIME_LIMIT = 1500


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One break: in ``path`` replace ``old`` (which must occur exactly once) by ``new``; the
    pytest arguments ``tests`` should then fail. ``hang``: the break makes a job hang, so the
    copy's hang guard is lowered to ``hang_timeout`` seconds. ``limit``: seconds the run may take."""

    name: str
    path: str
    old: str
    new: str
    tests: Tuple[str, ...]
    why: str
    hang: bool = False
    hang_timeout: int = HANG_TIMEOUT
    limit: int = TIME_LIMIT


def M(name: str, path: str, old: str, new: str, tests: Sequence[str], why: str, **extra: object) -> Mutation:
    return Mutation(name, path, old, new, tuple(tests), why, **extra)  # type: ignore[arg-type]


P = "horovod_sparse/"
MUTATIONS: List[Mutation] = [
    # -- common/ --------------------------------------------------------------------------------
    M("partition-bounds-off-by-one", P + "methods/micro/partitions.py",
      "return [p * size + min(p, extra) for p in range(parts + 1)]",
      "return [p * size + min(p + 1, extra) for p in range(parts + 1)]",
      ["tests/methods/micro/test_partitions.py"],
      "MiCRO's equal partitions start one element late when numel % n != 0 (a coordinate never scanned)"),
    M("exdyna-remainder-dropped", P + "methods/micro/partitions.py",
      "        bounds[-1] = self.numel\n",
      "",
      ["tests/methods/micro/test_partitions.py"],
      "ExDyna's last partition loses the remainder after the last block"),
    M("prefix-rebalance-direction", P + "methods/micro/partitions.py",
      "        if excess > BAND * share and blocks[j - 1] - 1 >= min_blocks:\n"
      "            blocks[j - 1] -= 1\n"
      "            blocks[j] += 1\n",
      "        if excess > BAND * share and blocks[j - 1] - 1 >= min_blocks:\n"
      "            blocks[j - 1] += 1\n"
      "            blocks[j] -= 1\n",
      ["tests/methods/micro/test_partitions.py"],
      "ExDyna's prefix balancer moves a boundary the wrong way (the heavy partition grows)"),
    M("pairwise-estimate-not-updated", P + "methods/micro/partitions.py",
      "            blocks[i] -= 1\n"
      "            blocks[i + 1] += 1\n"
      "            loads[i] -= moved\n"
      "            loads[i + 1] += moved\n",
      "            blocks[i] -= 1\n"
      "            blocks[i + 1] += 1\n",
      ["tests/methods/micro/test_partitions.py"],
      "the paper's pairwise balancer no longer moves the estimated loads before the next pair"),
    M("butterfly-fold-in-host-wrong", P + "methods/gtopk/butterfly.py",
      "from_extra = tuple(r + p if r + p < n else None for r in range(n))",
      "from_extra = tuple(r + p - 1 if r + p - 1 < n else None for r in range(n))",
      ["tests/methods/gtopk/test_butterfly.py"],
      "gTop-k's fold-in pairs a host with the wrong extra rank (the tree merge is inconsistent)"),
    M("lags-selection-does-not-delay-later-groups", P + "methods/lags/rule.py",
      "        shift += local.select_pair * (count - measured)\n",
      "",
      ["tests/methods/lags/test_rule.py"],
      "the LAGS count rule forgets that a group's extra selection delays the groups after it"),
    M("break-even-against-fp32-allreduce", P + "common/cost_model.py",
      "dense = per_byte.dense_allreduce(parameters, BF16_BYTES)",
      "dense = per_byte.dense_allreduce(parameters)",
      ["tests/common/test_cost_model.py"],
      "the break-even link compares against a float32 all-reduce, not a bf16 one (twice the dense bytes: "
      "compression looks to pay on links twice as fast)"),
    M("break-even-equal-bytes-win", P + "common/cost_model.py",
      "    if compressed >= dense:\n        return None\n",
      "    if compressed > dense:\n        return None\n",
      ["tests/common/test_cost_model.py"],
      "a compressed exchange of exactly the dense bytes is said to win on every link when its work is free"),
    M("gpu-check-break-even-whole-step", "benchmarks/gpu_check.py",
      'added = max(0.0, seconds[method] - seconds["dense"])',
      "added = seconds[method]",
      ["tests/benchmarks/test_gpu_check.py"],
      "gpu_check prices a method's whole step as its added cost, not its step minus the dense step"),
    M("lags-scatter-add-not-per-rank", P + "methods/lags/rule.py",
      "applied = local.apply_pair * model.workers * sum(counts)",
      "applied = local.apply_pair * sum(counts)",
      ["tests/methods/lags/test_rule.py"],
      "the LAGS count rule prices the scatter-add of one rank's pairs instead of every rank's"),
    M("lags-meter-counts-the-first-step", P + "methods/lags/rule.py",
      "        if self._seen > self.skip:\n",
      "        if self._seen >= self.skip:\n",
      ["tests/methods/lags/test_rule.py"],
      "LAGS's backward-time meter averages the first (one-off) step too"),
    M("merge-by-size-strict", P + "common/grouping.py",
      "        if total >= threshold:\n",
      "        if total > threshold:\n",
      ["tests/methods/lags/test_rule.py", "-k", "merge_by_size or size_strategy"],
      "size:N grouping closes a group only above N elements"),
    M("split-evenly-longer-last", P + "common/grouping.py",
      "runs = [list(items[i * size + min(i, extra):(i + 1) * size + min(i + 1, extra)]) for i in range(parts)]",
      "runs = [list(items[i * size + max(0, i + extra - parts):(i + 1) * size + max(0, i + 1 + extra - parts)])\n"
      "            for i in range(parts)]",
      ["tests/common/test_options.py"],
      "groups=N puts the longer runs last (Horovod puts them first)"),
    M("target-count-can-be-zero", P + "common/options.py",
      "    return max(1, int(density * numel))\n",
      "    return int(density * numel)\n",
      ["tests/common/test_options.py"],
      "a small group can target zero coordinates"),
    M("piecewise-schedule-off-by-one", P + "common/schedule.py",
      "            if step < until:\n",
      "            if step <= until:\n",
      ["tests/common/test_schedule.py"],
      "a piecewise density schedule keeps a stage one step too long"),
    M("gaussiank-corrections-swapped", P + "methods/gaussiank.py",
      "GAUSSIANK_LOWER, GAUSSIANK_RAISE)",
      "GAUSSIANK_RAISE, GAUSSIANK_LOWER)",
      ["tests/torch/test_threshold_baselines.py::test_baseline_matches_slow_reference[2-gaussiank]"],
      "Gaussian-k's corrections move the threshold the wrong way"),
    M("controller-budget-ignores-last-count", P + "methods/micro/controllers.py",
      "share = max(k / parts, last_counts[partition]) if len(last_counts) else 2.0 * k / parts",
      "share = k / parts if len(last_counts) else 2.0 * k / parts",
      ["tests/methods/micro/test_controllers.py"],
      "the histogram controller reads too few candidate blocks after a partition's count grew"),
    M("controller-interpolation-inverted", P + "methods/micro/controllers.py",
      "        fraction = math.log(above / target) / math.log(above / beyond)\n",
      "        fraction = math.log(target / beyond) / math.log(above / beyond)\n",
      ["tests/methods/micro/test_controllers.py"],
      "the histogram threshold is interpolated from the wrong end of its bin"),
    M("mergecomp-announces-every-candidate", P + "common/mergecomp_scheduler.py",
      "        self._splits = splits\n        return self._groups(splits)\n",
      "        return self._groups(splits)\n",
      ["tests/common/test_mergecomp.py"],
      "the MergeComp scheduler announces a regrouping even when the grouping does not change"),
    M("mergecomp-patience-one-late", P + "common/mergecomp.py",
      "            if misses >= self.options.patience:\n",
      "            if misses > self.options.patience:\n",
      ["tests/common/test_mergecomp.py"],
      "MergeComp's coarse scan times one candidate more than its patience"),
    M("mergecomp-mean-not-median", P + "common/mergecomp_scheduler.py",
      "(seconds,) = agree_seconds(self.B, [statistics.median(self._window)], self.process_set,",
      "(seconds,) = agree_seconds(self.B, [statistics.mean(self._window)], self.process_set,",
      ["tests/torch/test_mergecomp.py", "-k", "median"],
      "MergeComp times a candidate by the mean of its steps: an outlier step decides"),
    M("fingerprint-shapes-left-out", P + "engine/model_state.py",
      '                  "shapes": {key: shapes for key, _, _, shapes in groups},\n',
      "",
      ["tests/engine/test_stock.py", "-k", "test_shape_or_dtype_mismatch_raises_on_every_rank and torch2"],
      "the configuration fingerprint leaves parameter shapes out: another shape of as many elements "
      "goes unnoticed"),
    M("checkpoint-residual-not-restored", P + "engine/model_state.py",
      '            if entry.get("residual") is not None:\n                group.load_residual(entry["residual"])\n',
      "",
      ["tests/tensorflow/test_resume.py", "-k", "test_resumed_run_is_bitwise_the_continuous_run"],
      "a resumed run starts from empty residuals"),
    M("checkpoint-step-counter-dropped", P + "engine/model_state.py",
      '        return {"steps": steps, "groups": records,',
      '        return {"steps": 0, "groups": records,',
      ["tests/ddp/test_hook.py", "-k", "test_exact_resume"],
      "a checkpoint saves step 0 instead of the step counter (schedules and warm-up restart)"),
    M("agreement-not-adopted", P + "engine/model_state.py",
      "        if self.process_set.rank() != root_rank:\n            steps = self.restore(shared, groups, regroup)\n",
      "",
      ["tests/torch/test_dropin.py", "-k", "test_checkpoint_idiom_resumes_in_step_on_every_rank"],
      "the ranks other than the root keep their own step counter and shared state (Horovod's checkpoint "
      "idiom: only rank 0 resumes in step; the others' collectives then differ)", hang=True),
    M("grouping-mixes-dtypes", P + "common/grouping.py",
      "        if runs and params[runs[-1][-1]].kind == params[i].kind:\n",
      "        if runs:\n",
      ["tests/common/test_options.py"],
      "a group mixes dtypes or devices (one flat buffer cannot hold them)"),
    M("method-state-not-rebuilt-for-another-size", P + "engine/method_states.py",
      "        if built_for != (world_size, numel):\n",
      "        if built_for is None:\n",
      ["tests/torch/test_resume.py", "-k", "another_worker_count"],
      "a method state built for another world size is kept (partition tables, gTop-k's schedule)"),
    M("nonfinite-names-first-bad-rank-only", P + "common/nonfinite.py",
      'message = (f"non-finite (NaN/Inf) gradient on rank(s) {list(bad_ranks)} at step {step}; "',
      'message = (f"non-finite (NaN/Inf) gradient on rank(s) {list(bad_ranks)[:1]} at step {step}; "',
      ["tests/common/test_nonfinite.py", "-k", "test_torch"],
      "the NaN/Inf error names only the first bad rank"),

    M("target-count-never-the-whole-group", P + "common/options.py",
      "    return max(1, int(density * numel))\n",
      "    return max(1, min(int(density * numel), numel - 1))\n",
      ["tests/ddp/test_hook.py", "-k", "own_collectives and topk"],
      "a cap that never selects a whole group: density 1 no longer trains as the dense run beside a model's "
      "own collectives"),
    M("kept-dense-grouped-with-the-others", P + "common/grouping.py",
      "    kept = set(kept)\n",
      "    kept = set()\n",
      ["tests/common/test_options.py", "-k", "kept_parameters"],
      "the parameters dense= keeps dense share groups with the sparsified ones"),
    M("dense-name-matching-nothing-ignored", P + "common/dense_choice.py",
      "        if not matched:\n",
      "        if False:\n",
      ["tests/common/test_dense_choice.py", "-k", "near_misses"],
      "a misspelt dense= name silently sparsifies the layer it meant to keep dense"),
    # -- methods/ -------------------------------------------------------------------------------
    M("topk-ignores-density-schedule", P + "methods/topk.py",
      "        k = self.count(self.B.numel(x), step)\n",
      "        k = self.options.count(self.B.numel(x))\n",
      ["tests/torch/test_gtopk.py::test_matches_reference_of_the_same_schedule[2-topk_schedule]"],
      "Top-k sends the final density's k at every step (its density schedule ignored)"),
    M("threshold-from-numel-not-k", P + "methods/threshold.py",
      "hard_threshold(self.options.count(numel, s))",
      "hard_threshold(numel)",
      ["tests/torch/test_threshold_baselines.py::test_baseline_matches_slow_reference[2-threshold]"],
      "the hard threshold is 1/(2 sqrt(numel)) instead of 1/(2 sqrt(k))"),
    M("dgc-momentum-correction-off", P + "methods/dgc.py",
      "        return MomentumState() if self.options.momentum else None\n",
      "        return None\n",
      ["tests/torch/test_threshold_baselines.py::test_dgc_momentum_correction_matches_reference[2]"],
      "DGC's momentum correction is silently off"),
    M("dgc-velocity-not-saved", P + "methods/dgc.py",
      "        return MomentumState(self.B.saved(state.velocity), self.B.saved(state.accumulated))\n",
      "        return MomentumState()\n",
      ["tests/torch/test_resume.py", "-k", "test_resume_is_bitwise_the_continuous_run and dgc"],
      "a checkpoint drops DGC's velocity"),
    M("dgc-refinement-raises-the-threshold", P + "methods/dgc.py",
      "    thresholds = B.lowered_thresholds(B.kth_magnitude(x[offset::stride], count), DGC_LOWER, checks)\n",
      "    thresholds = B.lowered_thresholds(B.kth_magnitude(x[offset::stride], count), 1 / DGC_LOWER, checks)\n",
      ["tests/torch/test_threshold_baselines.py::test_baseline_matches_slow_reference[2-dgc]"],
      "DGC raises its threshold when it selected too few"),
    M("micro-partitions-do-not-rotate", P + "methods/micro/exchange.py",
      "        owned = owned_partition(step, comm.rank, comm.size)\n",
      "        owned = owned_partition(0, comm.rank, comm.size)\n",
      ["tests/torch/test_partitioned.py::test_matches_slow_reference_and_decisions_are_identical_on_every_rank"
       "[3-micro_histogram]"],
      "MiCRO's partitions do not rotate: each rank always scans the same one"),
    M("exdyna-never-rebalances", P + "methods/micro/exchange.py",
      "        self.partitions.observe(state, step, counts)\n",
      "",
      ["tests/torch/test_partitioned.py::test_matches_slow_reference_and_decisions_are_identical_on_every_rank"
       "[2-exdyna_default]"],
      "ExDyna's boundaries never move"),
    M("gtopk-merge-without-summing", P + "methods/gtopk/exchange.py",
      "    idx, summed = B.coalesce(B.concat([a.idx, b.idx]), B.concat([a.val, b.val]))\n",
      "    idx, summed = B.concat([a.idx, b.idx]), B.concat([a.val, b.val])\n",
      ["tests/torch/test_gtopk.py", "-k", "merge_is_symmetric"],
      "gTop-k's tree merge does not sum the two sets at common indices"),
    M("gtopk-residual-keeps-dropped-tracking", P + "methods/gtopk/exchange.py",
      "                tracked = {rank: carried(B, coordinates, held) for rank, coordinates in tracked.items()}\n",
      "",
      ["tests/torch/test_gtopk.py::test_nothing_lost_across_steps[3-model]"],
      "gTop-k's exact residual removes local values a merge dropped on the way (they are lost)"),
    M("lags-rule-never-applied", P + "methods/lags/exchange.py",
      "        k = self.group_count(group, numel, step, comm.size)\n",
      "        k = self.count(numel, step)\n",
      ["tests/torch/test_lags.py", "-k", "hand_computed"],
      "LAGS never applies its per-group densities"),
    M("lags-measurement-not-saved", P + "methods/lags/exchange.py",
      '                "meter": self._meter.state(per_rank)}\n',
      '                "meter": BackwardTimeMeter(self.options.measure_steps).state(per_rank)}\n',
      ["tests/torch/test_resume.py", "-k", "test_resume_is_bitwise_the_continuous_run and lags_measuring"],
      "a checkpoint taken in the middle of LAGS's measurement does not save it"),

    M("sparseloco-global-top-k", P + "methods/sparseloco.py",
      "idx = B.top_k_chunks(x, options.chunk_size, k, k_last)",
      "idx = B.top_k(x, m)",
      ["tests/methods/test_sparseloco.py"],
      "SparseLoCo ignores its chunks: the same count, chosen by one top-k over the whole group"),
    M("sparseloco-quantization-error-dropped", P + "methods/sparseloco.py",
      "residual = comm.remove_delivered(x, idx, delivered)",
      "residual = comm.remove_delivered(x, idx, B.gather(x, idx))",
      ["tests/methods/test_sparseloco.py"],
      "SparseLoCo zeroes the selected coordinates: the quantization error is lost, not kept in the residual"),
    M("sparseloco-host-keys-keep-the-sign", P + "torch_core/top_k.py",
      "    return out.copy_(values.view(bits)).bitwise_and_(sign_clear).bitwise_left_shift_(_INDEX_BITS)",
      "    return out.copy_(values.view(bits)).bitwise_left_shift_(_INDEX_BITS)",
      ["tests/methods/test_sparseloco.py", "-k", "slabs"],
      "SparseLoCo's host keys, formed from the signed values, keep the sign bit: a negative value ranks below "
      "every positive one"),
    M("sparseloco-host-slabs-restart-at-the-first-row", P + "torch_core/chunked.py",
      "        keys = ranked_keys_into(values[first:first + per], buffer[:min(per, full - first)])\n",
      "        keys = ranked_keys_into(values[:min(per, full - first)], buffer[:min(per, full - first)])\n",
      ["tests/methods/test_sparseloco.py", "-k", "slabs"],
      "SparseLoCo's host selection keys every slab of rows from the buffer's first rows"),
    M("sparseloco-lookup-not-bin-mean", P + "torch_core/chunked.py",
      "    return (sums / counts.clamp_min(1)).float()",
      "    return (sums / counts.sum()).float()",
      ["tests/methods/test_sparseloco.py"],
      "the quantizer's table divides each level's sum by every value's count, not by its own"),
    M("sparseloco-pack-wrong-shift", P + "torch_core/chunked.py",
      "_padded(codes, nbytes * per).view(nbytes, per) << _shifts(bits, codes))",
      "_padded(codes, nbytes * per).view(nbytes, per) << _shifts(bits, codes).flip(0))",
      ["tests/methods/test_sparseloco.py"],
      "codes are packed with the wrong shift (code i lands in another code's bits)"),
    M("sparseloco-pack-pads-with-ones", P + "torch_core/chunked.py",
      "(_padded(codes, nbytes * per).view(nbytes, per)",
      "(torch.nn.functional.pad(codes, (0, nbytes * per - codes.numel()), value=1).view(nbytes, per)",
      ["tests/methods/test_sparseloco.py", "-k", "packing"],
      "the last byte of packed codes carries code 1 in its unused places (bytes on the wire differ)"),
    M("sparseloco-chunk-ties-to-the-higher-index", P + "torch_core/chunked.py",
      "keep = above | (tied & (tied.cumsum(dim=1) <= k - above.sum(dim=1, keepdim=True)))",
      "keep = above | (tied & (tied.flip(1).cumsum(dim=1).flip(1) <= k - above.sum(dim=1, keepdim=True)))",
      ["tests/methods/test_sparseloco.py"],
      "within a chunk, magnitudes tied at the k-th go to the higher index (the ranks' rule is the lower)"),
    M("sparseloco-error-decay-ignored", P + "methods/sparseloco.py",
      "        return self.options.error_decay\n",
      "        return 1.0\n",
      ["tests/outer/test_rounds.py", "-k", "decay"],
      "SparseLoCo's error_decay is accepted and ignored (the residuals keep everything)"),
    M("sparseloco-blocks-whole-rows", P + "methods/sparseloco_blocks.py",
      "height, full = band.shape[0], cols // side * side",
      "height, full = band.shape[0], 0",
      ["tests/methods/test_sparseloco.py", "-k", "blocks"],
      "blocks=True cuts a matrix into bands of rows, not 2-D blocks (each band one chunk)"),
    M("sparseloco-blocks-offsets-without-their-block", P + "methods/sparseloco.py",
      "indices = B.gather(order, indices + starts)",
      "indices = B.gather(order, indices)",
      ["tests/methods/test_sparseloco.py", "-k", "blocks"],
      "a receiver places each offset from the group's start, not from its block's"),
    M("sparseloco-blocks-shapes-not-handed", P + "engine/step.py",
      "comm.shapes = group.shapes if plan.tiers is None else None",
      "comm.shapes = None",
      ["tests/outer/test_rounds.py", "-k", "blocks"],
      "the engine does not hand a group's shapes to the method: blocks=True cannot run in any front end"),
    M("sparseloco-blocks-tf-not-refused", P + "tensorflow/exchanger.py",
      "if self.sparse and compression.needs_shapes:",
      "if False:",
      ["tests/tensorflow/test_api.py", "-k", "blocks"],
      "TensorFlow accepts blocks=True, which its traced steps cannot run"),
    M("sparseloco-count-over-the-group", P + "methods/sparseloco.py",
      "        return full * k + k_last\n",
      "        return target_count(self.density, numel)\n",
      ["tests/methods/test_sparseloco.py"],
      "SparseLoCo's target (the engine's plan) counts the density over the whole group, not chunk by chunk"),
    M("sparseloco-bincount-host-read", P + "torch_core/chunked.py",
      "counts = wide.new_zeros(levels).index_add_(0, index, torch.ones_like(wide))",
      "counts = torch.bincount(index, minlength=levels).to(wide.dtype)",
      ["tests/torch_core/test_host_reads.py", "-k", "sparseloco"],
      "the quantizer's per-level counts by bincount, which reads the codes' maximum on the host on a GPU"),
    M("sparseloco-tf-traced-count-unknown", P + "tensorflow/backend.py",
      "return tf.reshape(tf.concat(parts, 0), [full * k + k_last]) if parts else tf.zeros([0], tf.int64)",
      "return tf.concat(parts, 0) if parts else tf.zeros([0], tf.int64)",
      ["tests/tensorflow/test_methods.py", "-k", "sparseloco"],
      "a traced TensorFlow step loses the selection's static count (the quantizer cannot be traced)"),
    M("sparseloco-tf-pack-wrong-shift", P + "tensorflow/backend.py",
      "tf.bitwise.left_shift(padded, tf.range(0, 8, bits))",
      "tf.bitwise.left_shift(padded, tf.range(0, 8 // bits))",
      ["tests/methods/test_sparseloco.py"],
      "TensorFlow packs codes shifted by their position, not by position times bits (codes overlap)"),
    M("sparseloco-moments-summed-in-float32-in-order", P + "torch_core/chunked.py",
      "return torch.sum(values, dim=0, keepdim=True, dtype=torch.float64)",
      "return values.new_zeros(1).index_add_(0, torch.zeros_like(values, dtype=torch.int64), values)",
      ["tests/methods/test_sparseloco.py", "-k", "16m"],
      "the quantizer's mean is added in float32 one value after another (off by 1e-4 at 16 M values)"),
    M("sparseloco-level-sums-in-float32", P + "torch_core/chunked.py",
      "index, wide = codes.long(), values.double()",
      "index, wide = codes.long(), values",
      ["tests/methods/test_sparseloco.py", "-k", "16m"],
      "the quantizer's per-level sums are added in float32 one value after another (percents off at 16 M)"),
    M("sparseloco-offsets-wrong-chunk-start", P + "torch_core/chunked.py",
      'lambda: steps(0, count, 1, torch.int64, packed.device).div(k, rounding_mode="floor").mul_(chunk))',
      'lambda: steps(0, count, 1, torch.int64, packed.device).div(k, rounding_mode="floor").mul_(k))',
      ["tests/methods/test_sparseloco.py"],
      "unpacked offsets are added to the wrong chunk's start (j // k * k, not j // k * chunk)"),
    M("shared-arange-changed-in-place", P + "torch_core/chunked.py",
      'lambda: steps(0, count, 1, torch.int64, packed.device).div(k, rounding_mode="floor")',
      'lambda: steps(0, count, 1, torch.int64, packed.device).div_(k, rounding_mode="floor")',
      ["tests/methods/test_sparseloco.py"],
      "unpacking offsets divides the arange made once in place, so what else takes that arange is wrong"),
    M("chunk-starts-kept-without-their-chunk", P + "torch_core/chunked.py",
      'starts = kept(("chunk starts", count, k, chunk, packed.device), count,',
      'starts = kept(("chunk starts", count, k, packed.device), count,',
      ["tests/methods/test_sparseloco.py", "-k", "own_chunks"],
      "a group's chunk starts are kept by its count and k alone: a group of another chunk length reuses them"),
    M("packed-shifts-made-at-every-call", P + "torch_core/chunked.py",
      "    return steps(0, 8, bits, torch.int32, like.device)\n",
      "    return torch.arange(0, 8, bits, dtype=torch.int32, device=like.device)\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and sparseloco"],
      "SparseLoCo's packing makes its bit shifts at every call: operations a GPU launches for nothing"),
    M("device-scan-forms-magnitudes-twice", P + "torch_core/selection.py",
      '    scanned.__dict__["magnitudes"] = magnitudes  # the cached property\'s value, formed here once\n',
      "",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and gaussiank"],
      "the accelerators' scan with moments forgets the |x| it formed: every count forms it again"),
    M("sparseloco-zero-scale-kept", P + "torch_core/chunked.py",
      "    usable = scale.nan_to_num(posinf=0.0) > 0\n",
      "    usable = scale.nan_to_num(posinf=0.0) >= 0\n",
      ["tests/methods/test_sparseloco.py", "-k", "reads_as_one"],
      "a quantizer's scale of 0 (one value, or all equal) is kept: every code divides by zero"),
    M("sparseloco-infinite-scale-kept", P + "torch_core/chunked.py",
      "    usable = scale.nan_to_num(posinf=0.0) > 0\n",
      "    usable = scale.nan_to_num() > 0\n",
      ["tests/methods/test_sparseloco.py", "-k", "reads_as_one"],
      "a quantizer's infinite scale is kept: every value's code is the middle level"),
    M("sparseloco-codes-multiplied-by-the-scale", P + "torch_core/chunked.py",
      "torch.addcdiv(half, centred, scale)",
      "torch.addcmul(half, centred, scale)",
      ["tests/methods/test_sparseloco.py", "-k", "quantizer_match"],
      "the quantizer's codes multiply the centred values by the scale instead of dividing by it"),
    M("sparseloco-unpacked-codes-cast-to-uint8", P + "torch_core/chunked.py",
      "    return codes.reshape(-1, nbytes * per)[:, :count].reshape(-1)\n",
      "    return codes.reshape(-1, nbytes * per)[:, :count].reshape(-1).to(torch.uint8)\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and sparseloco"],
      "SparseLoCo's unpacked codes are cast to uint8, and back to int64 to index the tables: two operations a group"),
    M("device-reading-columns-sliced-apart", P + "torch_core/histograms.py",
      "    above, beyond = counts.split(1, 1)\n",
      "    above, beyond = counts[:, :1], counts[:, 1:]\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and micro"],
      "MiCRO's device reading takes its counts' two columns apart by two slices: an operation more a reading"),
    M("sparseloco-norm-in-float32", P + "torch_core/chunked.py",
      "norm = torch.linalg.vector_norm(centred, dim=0, keepdim=True, dtype=torch.float64)",
      "norm = torch.linalg.vector_norm(centred, dim=0, keepdim=True).double()",
      ["tests/methods/test_sparseloco.py", "-k", "16m or quantizer_match"],
      "the quantizer's deviation is summed in float32 (its squares rounded, the sum too)"),
    M("whole-blocks-sliced-for-their-maxima", P + "torch_core/selection.py",
      "        body = self.magnitudes if whole else self.magnitudes[:full]",
      "        body = self.magnitudes[:full]",
      ["tests/benchmarks/test_exchange_cost.py"],
      "a device scan slices magnitudes that hold whole blocks only before taking their maxima (an operation a "
      "bucket for MiCRO and ExDyna)"),
    M("quantizer-centres-its-values-again", P + "methods/sparseloco.py",
      "    shift, std, centred = B.moments(values)\n",
      "    shift, std, _ = B.moments(values)\n    centred = values - shift\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and sparseloco"],
      "SparseLoCo's quantizer centres its values again after its deviation did (an operation and a pass a group)"),
    M("one-row-dequantized-from-its-first-level", P + "torch_core/chunked.py",
      "        return flat.take(codes.long()) + flat[-1:]\n",
      "        return flat.take(codes.long()) + flat[:1]\n",
      ["tests/methods/test_sparseloco.py"],
      "a rank's own SparseLoCo values are dequantized with its first level's mean for its shift: the residual "
      "keeps the wrong error"),
    M("unpacked-codes-keep-their-padding", P + "torch_core/chunked.py",
      "    if nbytes * per == count:  # no padding codes to cut\n",
      "    if True:\n",
      ["tests/methods/test_sparseloco.py"],
      "the padding codes of the last byte are unpacked as codes, past the count"),
    M("packed-codes-cast-to-bytes-after-their-sum", P + "torch_core/chunked.py",
      ".sum(1, dtype=torch.uint8)\n",
      ".sum(1).to(torch.uint8)\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and sparseloco"],
      "SparseLoCo's packed codes are summed as int64 and then cast to bytes (an operation a group)"),
    M("chunked-flat-buffer-reshaped", P + "torch_core/chunked.py",
      "    flat = x if x.dim() == 1 else x.reshape(-1)  # a flat buffer's reshape is an operation too\n",
      "    flat = x.reshape(-1)\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and sparseloco"],
      "SparseLoCo reshapes its flat buffer to select its chunks (an operation a group)"),
    M("chunk-starts-unsqueezed-at-each-call", P + "torch_core/chunked.py",
      "chosen.add_(_row_starts(rows, chunk, flat.device))",
      "chosen.add_(steps(0, rows * chunk, chunk, torch.int64, flat.device).unsqueeze(1))",
      ["tests/benchmarks/test_exchange_cost.py"],
      "SparseLoCo's padded chunks take their starts as a column made at each call (an operation a group)"),
    M("sparseloco-empty-level-mean-undefined", P + "torch_core/chunked.py",
      "(sums / counts.clamp_min(1))",
      "(sums / counts)",
      ["tests/methods/test_sparseloco.py", "-k", "quantizer_match"],
      "an empty level's mean is 0 / 0 (NaN) in the table that travels with the codes"),
    M("host-keys-shifted-one-bit-short", P + "torch_core/top_k.py",
      "return magnitudes.view(bits).long().bitwise_left_shift_(_INDEX_BITS).bitwise_or_(positions)",
      "return magnitudes.view(bits).long().bitwise_left_shift_(_INDEX_BITS - 1).bitwise_or_(positions)",
      ["tests/torch_core/test_top_k.py"],
      "the host's keys put a magnitude's bits one place too low: they overlap the positions and misorder"),
    M("sparseloco-offset-width-one-bit-short", P + "methods/sparseloco.py",
      "return max(1, (chunk_size - 1).bit_length())",
      "return max(1, (chunk_size - 1).bit_length() - 1)",
      ["tests/methods/test_sparseloco.py"],
      "offsets travel in one bit fewer than the chunk needs (the highest bit of the large ones is lost)"),
    M("sparseloco-offset-pieces-uncut", P + "torch_core/chunked.py",
      "taken.bitwise_right_shift_(right).bitwise_and_(mask).bitwise_left_shift_(left)",
      "taken.bitwise_right_shift_(right).bitwise_left_shift_(left)",
      ["tests/methods/test_sparseloco.py", "-k", "offsets"],
      "a packed offset's pieces are not cut to their bits: a byte takes an offset's bits beyond it"),
    M("sparseloco-unpacked-offsets-keep-the-padding", P + "torch_core/chunked.py",
      "(offsets if offsets.shape[1] == count else offsets[:, :count])",
      "offsets",
      ["tests/methods/test_sparseloco.py", "-k", "offsets"],
      "unpacked rows keep the zero offsets that pad their last period (indices that were never sent)"),
    M("sparseloco-tf-offsets-pack-wrong-shift", P + "tensorflow/backend.py",
      "tf.bitwise.left_shift(stream, tf.range(8))",
      "tf.bitwise.left_shift(stream, tf.range(7, -1, -1))",
      ["tests/methods/test_sparseloco.py"],
      "TensorFlow packs the offsets' bit stream highest bit first in each byte (its bytes differ from PyTorch's)"),
    # -- PyTorch optimizer, buffers, selection -------------------------------------------------
    M("torch-average-scale-dropped", P + "torch/exchanging.py",
      "Transport(Communicator, process_set, op == hvd.Average,",
      "Transport(Communicator, process_set, False,",
      ["tests/torch/test_topk.py::test_topk_matches_slow_reference_replicas_identical_and_nothing_lost[2-per_tensor]"],
      "the PyTorch optimizer sums the sparse aggregate instead of averaging it (1/size dropped)"),
    M("torch-dense-group-summed", P + "torch/dense.py",
      "DenseFlight(group, stats, self.compression, self.process_set, self.op,",
      "DenseFlight(group, stats, self.compression, self.process_set,\n"
      "                           hvd.Sum if self.compression is hvd.Compression.none else self.op,",
      ["tests/common/test_nonfinite.py", "-k", "test_torch"],
      "the dense groups of a sparse step (below min_numel, warm-up) are summed, not averaged"),
    M("engine-warmup-one-step-short", P + "engine/step.py",
      "        return isinstance(self.step, int) and self.step < self.dense_steps\n",
      "        return isinstance(self.step, int) and self.step + 1 < self.dense_steps\n",
      ["tests/torch/test_grouping.py::test_every_step_matches_the_reference[defaults-topk]"],
      "the engine's dense warm-up is one step short (the PyTorch front ends sparsify its last step)"),
    M("torch-nan-decided-per-rank", P + "torch/collectives.py",
      "    return [rank for rank, theirs in enumerate(counts.tolist()) if theirs]\n",
      "    return [rank for rank, theirs in enumerate(counts.tolist()) if theirs and rank == hvd.rank()]\n",
      ["tests/common/test_nonfinite.py", "-k", "test_torch"],
      "each rank decides alone whether to abandon a step (the agreement allgather skipped)"),
    M("torch-agreement-after-the-exchange", P + "torch/exchanging.py",
      "        self._report = self._early_report()\n",
      "        self._report = None\n",
      ["tests/torch/test_step_end.py"],
      "the agreement on non-finite gradients waits for the exchange to finish before it is launched (a Horovod "
      "cycle of its own every step: 1.5 ms of Top-k's 5.8 ms step on 2 CPU workers)"),
    M("torch-abandoned-aggregate-not-nan", P + "torch/abandoned.py",
      "            flight.group.zeroed_output().fill_(math.nan)\n",
      "            flight.group.zeroed_output()\n",
      ["tests/torch/test_amp.py", "-k", "test_horovod_amp_recipe_trains_like_stock"],
      "an abandoned step's sparse aggregates are zeros, not NaN: a loss scaler does not see the overflow"),
    M("torch-undo-deliveries-no-op", P + "torch_core/communicator.py",
      "        for x, idx, wire_values in reversed(self._deliveries):\n"
      "            if idx is None:\n"
      "                x.add_(wire_values.to(x.dtype))\n"
      "            else:\n"
      "                x.index_add_(0, idx, wire_values.to(x.dtype))\n",
      "",
      ["tests/common/test_nonfinite.py", "-k", "test_torch"],
      "an abandoned step does not put back what it took out of the residuals"),
    M("torch-residual-not-updated", P + "torch_core/communicator.py",
      "        return x.index_add_(0, idx, wire_values.to(x.dtype), alpha=-1)\n",
      "        return x\n",
      ["tests/torch/test_topk.py::test_topk_matches_slow_reference_replicas_identical_and_nothing_lost[2-per_tensor]"],
      "what a rank delivered stays in its residual (remove_delivered skipped): sent twice"),
    M("torch-fingerprint-without-backward-passes", P + "torch/shared_state.py",
      '             "backward_passes_per_step": self.backward_passes_per_step, "nonfinite": self.nonfinite,\n',
      '             "nonfinite": self.nonfinite,\n',
      ["tests/torch/test_reliability.py", "-k", "mismatch and backward_passes_per_step"],
      "the PyTorch configuration fingerprint leaves backward_passes_per_step out"),
    M("torch-elastic-no-agreement-after-shrink", P + "torch/shared_state.py",
      "        if self._agree_with is None and not self._size_checked and self._world_size != "
      "self.process_set.size():\n"
      "            self._agree_with = 0\n",
      "",
      ["tests/torch/test_elastic.py"],
      "after a worker left (no sync from Horovod) the optimizer does not agree again", hang=True,
      hang_timeout=300),
    M("torch-layout-ignored", P + "torch_core/buffers.py",
      "    return chunk.as_strided(param.shape, param.stride())\n",
      "    return chunk.view(param.shape)\n",
      ["tests/torch/test_amp.py", "-k", "test_gradients_keep_their_parameters_layout"],
      "a channels_last or transposed parameter gets a contiguous .grad (fused optimizers step the wrong "
      "elements)"),
    M("torch-loss-scale-not-divided-out", P + "torch_core/buffers.py",
      "    return buffer.add_(gradient) if inv_scale is None else buffer.addcmul_(gradient, inv_scale)\n",
      "    return buffer.add_(gradient)\n",
      ["tests/torch/test_amp.py", "-k", "residuals_in_unscaled_units"],
      "the loss scale is not divided out of the gradients (the Horovod optimizer's groups, DDP's buckets) "
      "entering the residual"),
    M("torch-top-k-ties-to-the-higher-index", P + "torch_core/top_k.py",
      "    keep[tied[:k - host_count(keep)]] = True\n",
      "    keep[tied[tied.numel() - (k - host_count(keep)):]] = True\n",
      ["tests/torch_core/test_top_k.py", "-k", "_torch"],
      "PyTorch's top-k breaks magnitude ties to the higher index"),
    M("torch-small-cpu-top-k-scans", P + "torch_core/top_k.py",
      "    if on_accelerator(flat) or numel < DEVICE_TOP_K_BELOW:\n",
      "    if on_accelerator(flat):\n",
      ["tests/torch_core/test_top_k.py", "-k", "below_the_bound"],
      "a small CPU buffer's top-k takes the block scan, several times slower there than the device path"),
    M("torch-pick-strict", P + "torch_core/selection.py",
      "    reaches = torch.gt if strict else torch.ge\n",
      "    reaches = torch.gt\n",
      ["tests/torch_core/test_selection.py"],
      "PyTorch's threshold pick selects |x| > t instead of |x| >= t"),
    M("torch-host-pass-kept-across-thresholds", P + "torch_core/selection.py",
      "    key = (threshold, reaches)\n",
      "    key = reaches\n",
      ["tests/torch_core/test_selection.py"],
      "a pick on the host reuses the pass of another threshold counted on the same scan"),
    M("host-pass-of-many-slabs-read-once", P + "torch_core/selection.py",
      "    read: Callable[[], Iterable[Slab]] = functools.partial(host_slabs, scanned, rows, threshold, reaches)\n",
      "    read: Callable[[], Iterable[Slab]] = functools.partial(iter, host_slabs(scanned, rows, threshold,"
      " reaches))\n",
      ["tests/torch_core/test_selection.py", "-k", "many_slabs"],
      "a host pass of many slabs reads its blocks once, and the pick after its count finds nothing"),
    M("host-slabs-restart-at-the-first-rows", P + "torch_core/selection.py",
      "        part = rows[first:first + per]\n",
      "        part = rows[:per]\n",
      ["tests/torch_core/test_selection.py", "-k", "many_slabs"],
      "every slab of a host pass re-reads the first slab's blocks"),
    M("host-capped-pick-counts-what-it-read", P + "torch_core/selection.py",
      "        return cut(idx, hits.count() if idx.numel() >= capacity else idx.numel(), capacity)\n",
      "        return cut(idx, idx.numel(), capacity)\n",
      ["tests/torch_core/test_selection.py", "-k", "capped_host_pick"],
      "a capped pick on the host that stops at its capacity counts only the slabs it read: the overflow is lost"),
    M("host-capped-pick-stops-after-one-slab", P + "torch_core/selection.py",
      "        if enough is not None and picked >= enough:\n",
      "        if enough is not None:\n",
      ["tests/torch_core/test_selection.py", "-k", "capped_host_pick"],
      "a capped pick on the host stops after its first slab, short of its capacity"),
    M("torch-host-count-misses-the-tail", P + "torch_core/selection.py",
      "            self.counted.append(found if self.tail_reached is None else found"
      " + host_count(self.tail_reached))\n",
      "            self.counted.append(found)\n",
      ["tests/methods/test_backends.py", "-k", "one_pass_counts_are"],
      "the host's count leaves out the partial last block, so DGC and Gaussian-k settle on wrong counts"),
    M("torch-candidate-filter-strict", P + "torch_core/tensor_backend.py",
      "    return t >= threshold\n",
      "    return t > threshold\n",
      ["tests/methods/test_backends.py", "-k", "candidates and torch"],
      "PyTorch's candidate filter (MiCRO/ExDyna) keeps |x| > t instead of |x| >= t"),
    M("torch-union-counts-duplicates", P + "torch_core/tensor_backend.py",
      "        return int(torch.unique(indices).numel())\n",
      "        return int(indices.numel())\n",
      ["tests/torch/test_backend.py", "tests/engine/test_parity.py", "-k",
       "test_scatter_chunks or test_same_statistics and topk_model_fp16"],
      "the union statistic counts an index sent by two ranks twice (below the marking threshold)"),

    M("waiting-quota-ignored", P + "torch/waiting.py",
      "    return affinity if quota is None else max(1, min(affinity, math.ceil(quota)))\n",
      "    return affinity\n",
      ["tests/benchmarks/test_clis.py", "-k", "waiting_counts_no_more_cores"],
      "a container's CPU quota is ignored: auto spins on cores it does not have, starving Horovod's threads"),
    M("torch-densified-gradient-left-dense", P + "torch/sparse_rows.py",
      "            p.grad = p.grad.to_sparse()\n",
      "            pass\n",
      ["tests/torch/test_dropin.py", "-k", "test_sparse_embedding_with_compression_none_is_stock_horovod"],
      "a torch.sparse gradient exchanged densely (sparse_as_dense) is handed back dense, not in the layout "
      "the optimizer expects"),
    M("torch-kept-dense-sparsified", P + "torch/exchanging.py",
      "        return flat_groups(ordered, spec, default, self._kept_dense)\n",
      "        return flat_groups(ordered, spec, default, set())\n",
      ["tests/torch/test_dropin.py", "-k", "kept_dense"],
      "the Horovod optimizer sparsifies the groups dense= keeps dense"),
    M("torch-dense-choice-not-compared", P + "torch/shared_state.py",
      '             "dense": sorted(self._kept_dense)},\n',
      "             },\n",
      ["tests/torch/test_dropin.py", "-k", "kept_dense"],
      "ranks keeping different parameters dense go unnoticed (per-tensor groups have the same names)"),
    # -- the two-tier exchange (common/tiers.py through the PyTorch optimizer) ---------------------
    M("two-tier-residual-kept-outside-the-slice", P + "engine/two_tier.py",
      "    x = B.embed(x, lo, node_sum)\n"
      "    update, residual = yield from method.exchange(x[lo:hi], cross, state, step)\n"
      "    (whole,) = yield [node.allgather(update, \"node.update\", NODE_KIND, rows=rows)]\n"
      "    return whole, B.embed(x, lo, residual)\n",
      "    x[lo:hi] = node_sum\n"
      "    update, residual = yield from method.exchange(x[lo:hi], cross, state, step)\n"
      "    (whole,) = yield [node.allgather(update, \"node.update\", NODE_KIND)]\n"
      "    return whole, x\n",
      ["tests/engine/test_two_tier.py", "-k", "flat_method_on_node_sums and topk"],
      "a rank keeps its g + e outside its slice after handing it to the slice's owner: counted twice"),
    M("two-tier-scale-per-node", P + "engine/topology.py",
      "        return (self.communicator(tiers.cross_set, name, stats, scale, tiers.cross_size,",
      "        return (self.communicator(tiers.cross_set, name, stats, 1 / tiers.cross_size, tiers.cross_size,",
      ["tests/engine/test_two_tier.py", "-k", "flat_method_on_node_sums and topk"],
      "the cross-node update averages over the nodes, not over every worker (the node sums are sums)"),
    M("two-tier-state-built-for-the-group", P + "engine/step.py",
      "        state = self.model.states.for_group(group, comm.size, plan.numel)\n",
      "        state = self.model.states.for_group(group, comm.size)\n",
      ["tests/engine/test_two_tier.py", "-k", "flat_method_on_node_sums and micro"],
      "the method's state (MiCRO's partitions) is built for the whole group, not for this rank's slice"),
    M("two-tier-slice-state-agreed-from-rank-0", P + "engine/model_state.py",
      "            mine[\"groups\"] = {name: {\"numel\": entry[\"numel\"]} "
      "for name, entry in mine[\"groups\"].items()}\n",
      "            pass\n",
      ["tests/engine/test_two_tier.py", "-k", "flat_method_on_node_sums and exdyna"],
      "every rank adopts rank 0's slice state (its thresholds and partitions) instead of its cross set's"),
    M("two-tier-collectives-not-leveled", P + "common/horovod_tiers.py",
      "    missing = max(launched) - launched[rank]\n",
      "    missing = 0\n",
      ["tests/engine/test_two_tier.py", "-k", "flat_method_on_node_sums and micro_large"],
      "issue 56's cause: the cross sets' own rounds leave the ranks with other counts of Horovod handles, so "
      "the loop's unnamed collectives get other names on each rank and hang", hang=True),
    M("stall-deadline-not-capped-on-gloo", P + "common/stall.py",
      "    return min(seconds, gloo_seconds / 2)\n",
      "    return seconds\n",
      ["tests/common/test_stall.py", "-k", "gloo"],
      "on Gloo the stall check waits past Gloo's own timeout, which aborts every rank with nothing said"),
    M("stall-deadline-ignores-horovods-gloo", P + "torch/collectives.py",
      "        return _gloo_enabled()\n",
      "        return False\n",
      ["tests/engine/test_two_tier.py", "-k", "gloos_timeout"],
      "the Horovod front end's waits take the stall-check time even where Horovod runs on Gloo"),
    M("stall-check-never-armed", P + "torch_core/communicator.py",
      "            pending.comm._under_way = True\n",
      "            pass\n",
      ["tests/engine/test_two_tier.py", "-k", "round_taken_by_one_rank"],
      "a collective inside an exchange waits without a deadline: a round taken by one rank hangs the job silently"),
    # -- TensorFlow tape, Keras, selection ----------------------------------------------------------
    M("tf-average-scale-dropped", P + "tensorflow/layout.py",
      "average=self.op == hvd.Average)",
      "average=False)",
      ["tests/tensorflow/test_topk.py::test_topk_matches_slow_reference_replicas_identical_and_nothing_lost"
       "[2-tape_per_tensor]"],
      "the TensorFlow exchange sums the sparse aggregate instead of averaging it"),
    M("tf-residual-not-updated", P + "tensorflow/collectives.py",
      "        return tf.tensor_scatter_nd_sub(x, tf.expand_dims(idx, 1), tf.cast(wire_values, x.dtype))\n",
      "        return x\n",
      ["tests/tensorflow/test_topk.py::test_topk_matches_slow_reference_replicas_identical_and_nothing_lost"
       "[2-tape_per_tensor]"],
      "TensorFlow's residual keeps what was delivered (remove_delivered skipped)"),
    M("tf-traced-warmup-one-step-long", P + "tensorflow/exchanger.py",
      "            return tf.cond(step < warmup, lambda: self._exchange_groups(kept, layout, step, ",
      "            return tf.cond(step <= warmup, lambda: self._exchange_groups(kept, layout, step, ",
      ["tests/tensorflow/test_topk.py::test_topk_matches_slow_reference_replicas_identical_and_nothing_lost"
       "[2-keras_function_warmup]"],
      "a traced step keeps the dense warm-up one step too long"),
    M("traced-density-schedule-ignored", P + "methods/base.py",
      "        return self.B.host_call(decide, [step], dtype)\n",
      "        return decide(None)\n",
      ["tests/tensorflow/test_topk.py::test_topk_matches_slow_reference_replicas_identical_and_nothing_lost"
       "[2-function_schedule]"],
      "inside a tf.function the density schedule is ignored (the final density from the first step)"),
    M("keras-aggregation-helper-keeps-horovods-allreduce", P + "tensorflow/keras.py",
      "        setattr(helper, attribute, exchanger)\n",
      "",
      ["tests/tensorflow/test_topk.py::test_topk_matches_slow_reference_replicas_identical_and_nothing_lost"
       "[2-keras_function_two_passes]"],
      "with backward_passes_per_step > 1 Keras still reduces through Horovod's dense allreduce"),
    M("keras-exchanger-not-installed", P + "tensorflow/keras.py",
      "    optimizer._allreduce_grads = exchanger\n",
      "",
      ["tests/tensorflow/test_topk.py::test_topk_matches_slow_reference_replicas_identical_and_nothing_lost"
       "[2-keras_two_groups]"],
      "the Keras wrapper keeps Horovod's dense allreduce: nothing is sparsified"),
    M("tf-abandon-drops-healthy-gradients", P + "tensorflow/nonfinite_steps.py",
      "            group.store_residual(tf.where(tf.logical_and(finite[group.index], tf.logical_not(warm)), "
      "x, before))\n",
      "            group.store_residual(before)\n",
      ["tests/common/test_nonfinite.py", "-k", "test_tensorflow"],
      "an abandoned TensorFlow step drops the healthy ranks' gradients instead of keeping them in the residual"),
    M("tf-fingerprint-without-sparse-as-dense", P + "tensorflow/shared_state.py",
      '"sparse_as_dense": self.sparse_as_dense,',
      "",
      ["tests/tensorflow/test_reliability.py", "-k", "mismatch and sparse_as_dense"],
      "the TensorFlow configuration fingerprint leaves sparse_as_dense out"),
    M("tf-restore-keeps-the-step-counter", P + "tensorflow/shared_state.py",
      "            layout.step_counter().assign(steps)\n        return \"\"\n",
      "        return \"\"\n",
      ["tests/tensorflow/test_resume.py", "-k", "test_resumed_run_is_bitwise_the_continuous_run"],
      "a TensorFlow checkpoint restores everything but the step counter"),
    M("tf-momentum-velocity-without-correction", P + "tensorflow/backend.py",
      "    velocity = velocity * momentum + (x - accumulated)\n",
      "    velocity = velocity * momentum + x\n",
      ["tests/tensorflow/test_methods.py::test_matches_slow_reference[2-dgc_momentum]"],
      "TensorFlow's DGC momentum takes g + v for the gradient (the accumulated velocity counted again)"),
    M("tf-threshold-strict", P + "tensorflow/selection.py",
      "    return tf.where(magnitude >= tf.cast(threshold, magnitude.dtype))[:, 0]\n",
      "    return tf.where(magnitude > tf.cast(threshold, magnitude.dtype))[:, 0]\n",
      ["tests/methods/test_backends.py", "-k", "hard_threshold and tensorflow"],
      "TensorFlow's threshold selects |x| > t instead of |x| >= t"),
    M("tf-top-k-ties-to-the-higher-index", P + "tensorflow/selection.py",
      "        return tf.where(above | ((tied > 0) & (tf.cumsum(tied) <= room)))[:, 0]\n",
      "        return tf.where(above | ((tied > 0) & (tf.cumsum(tied, reverse=True) <= room)))[:, 0]\n",
      ["tests/torch_core/test_top_k.py", "-k", "tensorflow"],
      "TensorFlow's top-k breaks magnitude ties to the higher index"),
    M("tf-nan-decided-per-rank", P + "tensorflow/nonfinite_steps.py",
      '        flags = hvd.allgather(local, name="hs.nonfinite", ignore_name_scope=True, '
      'process_set=self.process_set)\n',
      "        flags = tf.one_hot(self.process_set.rank(), self.process_set.size(), dtype=tf.int32) * local\n",
      ["tests/common/test_nonfinite.py", "-k", "test_tensorflow"],
      "each TensorFlow rank decides alone whether to abandon a step (the others wait in its exchange)",
      hang=True, hang_timeout=360),
    M("tf-host-step-on-one-inter-op-thread", P + "tensorflow/host_step.py",
      "    if threads < 2:\n",
      "    if threads < 1:\n",
      ["tests/tensorflow/test_reliability.py::test_a_host_step_is_refused_on_one_inter_op_thread_naming_the_fix"],
      "a traced host step is built with one inter-op thread, where its tf.py_function waits forever"),
    M("tf-keras3-exchange-skipped", P + "tensorflow/keras3.py",
      "            exchanged = exchanger(list(grads), sources)\n",
      "            exchanged = list(grads)\n",
      ["tests/tensorflow/test_keras3.py::test_matches_slow_reference_with_identical_replicas[k3_topk]"],
      "the Keras 3 wrapper applies each rank's own gradient (Keras 3 never calls get_gradients)"),
    M("tf-keras3-broadcast-skips-optimizer-variables", P + "tensorflow/keras3_callbacks.py",
      "            variables += list(optimizer.variables)\n",
      "",
      ["tests/tensorflow/test_keras3.py::test_broadcast_callback_sends_rank_0s_optimizer_state"],
      "the Keras 3 broadcast callback sends the model's variables but not the optimizer's state"),
    M("tf-keras-abandoned-step-applied", P + "tensorflow/nonfinite_steps.py",
      "            if abandoned:\n                self.report_abandoned()\n",
      "            if False:\n                self.report_abandoned()\n",
      ["tests/common/test_nonfinite.py", "-k", "test_tensorflow and keras"],
      "the Keras wrapper applies the NaN gradients of an abandoned step (the nonfinite policy ignored)"),
    M("tf-keras3-abandoned-step-applied", P + "tensorflow/keras3.py",
      "            abandoned = exchanger.take_abandoned()\n",
      "            abandoned = exchanger.take_abandoned() & False\n",
      ["tests/tensorflow/test_keras3.py::test_an_inf_on_one_rank_skips_the_step_on_every_rank[skip]"],
      "the Keras 3 wrapper applies the NaN gradients of an abandoned step (the nonfinite policy ignored)"),

    M("tf-kept-dense-sparsified", P + "engine/step.py",
      "        return (self.sparse and not dense_step and not kept_dense and ",
      "        return (self.sparse and not dense_step and ",
      ["tests/tensorflow/test_dropin.py", "-k", "kept_dense"],
      "the tape sparsifies the variables dense= keeps dense"),
    # -- DDP comm hook ---------------------------------------------------------------------------
    M("ddp-exit-job-finalizes", P + "distributed/job_exit.py",
      "    os._exit(code)\n",
      "    sys.exit(code)\n",
      ["tests/distributed/test_job_exit.py"],
      "exit_job leaves through the interpreter's finalization, where a late Gloo thread aborts the process"),
    M("ddp-exit-job-output-lost", P + "distributed/job_exit.py",
      "    sys.stdout.flush()\n",
      "",
      ["tests/distributed/test_job_exit.py"],
      "exit_job leaves without flushing stdout: what the rank printed last is lost"),
    M("ddp-state-needs-the-process-group", P + "distributed/process_group.py",
      "        self.group = group\n        self._device: Optional[torch.device] = None\n",
      "        self.group = group\n        self._device: Optional[torch.device] = None\n"
      "        self._device = self.device\n",
      ["tests/ddp/test_lightning.py"],
      "a DDP state asks torch.distributed for its group when built: trainers that build it first cannot"),
    M("ddp-average-scale-dropped", P + "distributed/stepping.py",
      "Transport(Communicator, process_group, read_scalars=read_scalars)",
      "Transport(Communicator, process_group, average=False, read_scalars=read_scalars)",
      ["tests/ddp/test_hook.py", "-k", "test_same_aggregate_as_the_horovod_front_end"],
      "the DDP hook (and FSDP2, the outer steps) sums the sparse aggregate instead of averaging it"),
    M("ddp-dense-bucket-summed", P + "distributed/dense.py",
      "    if finite is True:\n        return wire.div_(size)\n",
      "    if finite is True:\n        return wire\n",
      ["tests/ddp/test_hook.py", "-k", "test_same_aggregate_as_the_horovod_front_end"],
      "the DDP hook's dense buckets are summed, not averaged"),
    M("ddp-saved-groups-not-followed", P + "ddp/buckets.py",
      "        keys = self._cover(members, by_number) or self._split_kept_dense(members, by_number)\n",
      "        keys = self._split_kept_dense(members, by_number)\n",
      ["tests/ddp/test_hook.py", "-k", "test_exact_resume"],
      "after loading a checkpoint DDP's first bucket is exchanged as one new group, not as the saved ones"),
    M("ddp-residuals-not-carried-to-new-buckets", P + "ddp/buckets.py",
      "        carry_residuals(list(self._groups.values()), [group])\n",
      "",
      ["tests/ddp/test_hook.py", "-k", "test_residuals_follow_their_parameters_into_new_buckets"],
      "when DDP rebuilds its buckets the new groups start from empty residuals"),
    M("ddp-nan-decided-per-rank", P + "distributed/stepping.py",
      "else ranks_reporting(len(groups), process_group)\n",
      "else ([process_group.rank()] if groups else [])\n",
      ["tests/ddp/test_hook.py", "-k", "test_nonfinite_gradient_abandons_the_step_everywhere"],
      "each DDP rank decides alone whether to abandon a step"),
    M("topk-selection-copies-the-buffer", P + "methods/topk.py",
      "            idx = self.B.top_k(x, k, ascending=False)  # the exchange needs no order\n",
      "            idx = self.B.top_k(x.clone(), k, ascending=False)\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and topk"],
      "Top-k copies each group's buffer before selecting: one more buffer-sized pass and more launches per step"),
    M("ddp-hook-takes-python-reducer-pairs", P + "ddp/hook.py",
      "    if not isinstance(bucket, dist.GradBucket):\n",
      "    if False:\n",
      ["tests/torch/test_compile.py", "-k", "python_reducer"],
      "under Dynamo's Python reducer the DDP hook fails on a (grad, param) pair instead of refusing with the fix"),
    M("engine-delivers-before-agreeing", P + "engine/step.py",
      "        bad_ranks = agree(nonfinite_groups)\n        if bad_ranks:\n            self.abandon()\n"
      "        else:\n            self.decay_residuals()\n        deliver(bool(bad_ranks))\n",
      "        deliver(False)\n        bad_ranks = agree(nonfinite_groups)\n        if bad_ranks:\n"
      "            self.abandon()\n        else:\n            self.decay_residuals()\n",
      ["tests/engine/test_step.py"],
      "the engine lets the front end deliver a step before the ranks agree it is finite (an abandoned step applied)"),
    M("engine-undo-skipped", P + "engine/step.py",
      "                flight.comm.undo_deliveries()\n",
      "                pass\n",
      ["tests/ddp/test_hook.py", "tests/fsdp/test_replicas.py", "-k",
       "test_nonfinite_gradient_abandons_the_step_everywhere or (test_replicas and nan)"],
      "an abandoned DDP or FSDP2 step does not put back what it took out of the residuals"),
    M("union-counts-read-out-of-order", P + "torch_core/device_figures.py",
      "        for i in itertools.chain(*by_dtype.values()):\n",
      "        for i in [*itertools.chain(*by_dtype.values())][::-1]:\n",
      ["tests/torch_core/test_host_reads.py"],
      "the step's union counts, read from the device together, go to the wrong groups"),
    M("step-figures-read-apart-from-finiteness", P + "engine/step.py",
      "        return read_figures(self.stats, self.read_scalars or read_each, scalars)\n",
      "        return (self.read_scalars or read_each)(scalars)\n",
      ["tests/torch_core/test_host_reads.py", "-k", "budget"],
      "the end of a step reads the device twice: its finiteness flags, then its statistics figures"),
    M("threshold-band-decided-on-the-host", P + "torch_core/tensor_backend.py",
      "    if not isinstance(count, torch.Tensor):\n        return band_factor(",
      "    if isinstance(count, (int, torch.Tensor)):\n        return band_factor(",
      ["tests/torch_core/test_host_reads.py", "-k", "budget and gaussiank"],
      "a host read put back into an exchange: Gaussian-k's corrections read each count on the host"),
    M("dgc-settled-against-a-float32-bound", P + "torch_core/tensor_backend.py",
      "    first = (checked < math.ceil(low)).sum()\n",
      "    first = (checked < low).sum()\n",
      ["tests/methods/test_backends.py", "-k", "first_settled"],
      "on a GPU, DGC compares its float32 counts with 0.8 k rounded to float32: past 2**23 a count one below the "
      "bound settles"),
    M("dgc-cut-read-past-its-checks", P + "torch_core/tensor_backend.py",
      "checked.take(first.clamp_max(checks - 1)) > math.floor(high)\n",
      "counts.take(first) > math.floor(high)\n",
      ["tests/methods/test_backends.py", "-k", "first_settled"],
      "on a GPU, DGC cuts to the top-k when no checked threshold settles and the unchecked last one selects "
      "more than 1.3 k (the host never cuts there)"),
    M("dgc-cut-sorts-its-rows", P + "torch_core/tensor_backend.py",
      "    chosen = idx[top_k(rows, k, ascending=False)]\n",
      "    chosen = idx[top_k(rows, k)]\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and dgc"],
      "DGC's cut to the top-k sorts the rows it keeps, which the exchange needs in no order (an operation a group)"),
    M("dgc-lowered-thresholds-cast-apart", P + "torch_core/tensor_backend.py",
      "    return (threshold * powers).float().clamp_min(SMALLEST_THRESHOLD)\n",
      "    return (threshold.double() * powers).float().clamp_min(SMALLEST_THRESHOLD)\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and dgc"],
      "DGC's threshold is cast to float64 before its product with the powers, which widens it anyway "
      "(an operation a group)"),
    M("dgc-unchecked-threshold-cut", P + "torch_core/tensor_backend.py",
      "        return thresholds[0], constant(False, torch.bool, counts.device)\n",
      "        return thresholds[0], counts[0] > math.floor(high)\n",
      ["tests/methods/test_backends.py", "-k", "first_settled"],
      "on a GPU, DGC with max_adaptations=0 cuts its one threshold's selection to the top-k (the host never does)"),
    M("gaussiank-band-bound-rounded-down", P + "torch_core/tensor_backend.py",
      "    bounds = constant((math.ceil(low), math.floor(high) + 1)",
      "    bounds = constant((math.floor(low), math.floor(high) + 1)",
      ["tests/methods/test_backends.py", "-k", "band_on_the_device"],
      "on a GPU, Gaussian-k keeps a threshold whose count is one below the band's fractional lower bound"),
    M("gaussiank-band-upper-bound-inside", P + "torch_core/tensor_backend.py",
      "    bounds = constant((math.ceil(low), math.floor(high) + 1)",
      "    bounds = constant((math.ceil(low), math.floor(high))",
      ["tests/methods/test_backends.py", "-k", "band_on_the_device"],
      "on a GPU, Gaussian-k raises a threshold whose count equals the band's whole upper bound"),
    M("gtopk-delivered-count-read-per-group", P + "torch_core/tensor_backend.py",
      "    return keep.sum() if on_accelerator(keep) else host_count(keep)\n",
      "    return int(keep.sum())\n",
      ["tests/torch_core/test_host_reads.py", "-k", "budget and gtopk"],
      "a host read put back into an exchange: gTop-k reads how many of its coordinates it delivered"),
    M("dgc-capacity-unvalidated", P + "common/threshold_baselines.py",
      "        super()._validate()\n        object.__setattr__(self, \"sample_ratio\"",
      "        object.__setattr__(self, \"sample_ratio\"",
      ["tests/common/test_options.py", "-k", "capacity"],
      "DGC takes any capacity (zero, negative, a string) without a word"),
    M("capped-overflow-dropped", P + "torch_core/selection.py",
      "        return cut(idx, hits.count() if idx.numel() >= capacity else idx.numel(), capacity)\n",
      "        scanned.x.index_fill_(0, idx[capacity:], 0.0)\n"
      "        return cut(idx, hits.count() if idx.numel() >= capacity else idx.numel(), capacity)\n",
      ["tests/torch/test_threshold_baselines.py", "-k", "capped"],
      "what a threshold selects beyond the payload's capacity is dropped instead of kept in the residual"),
    M("capped-overflow-not-counted", P + "methods/base.py",
      '            comm.stats.note("overflow", capped.overflow)\n',
      '            comm.stats.note("overflow", 0)\n',
      ["tests/torch/test_threshold_baselines.py", "-k", "overflow"],
      "the statistics say nothing overflowed the capacity when something did"),
    M("padded-union-counts-the-padding", P + "torch_core/tensor_backend.py",
      "    marks.index_put_((indices,), constant(True, torch.bool, indices.device))\n",
      "    marks.index_put_((indices.clamp_min(0),), constant(True, torch.bool, indices.device))\n",
      ["tests/torch_core/test_host_reads.py", "-k", "budget"],
      "on an accelerator the union statistic counts a padded payload's rows as index 0"),
    M("union-worked-out-in-the-step", P + "methods/base.py",
      "        comm.stats.union = Deferred(count) if deferred else count()\n",
      "        comm.stats.union = count()\n",
      ["tests/engine/test_step.py", "-k", "deferred"],
      "the union of the gathered indices is counted in every step, whether or not its statistics are read"),
    M("union-deferred-for-many-indices", P + "methods/base.py",
      "        deferred = self.B.DEFERS_STATISTICS and self.B.numel(indices) * DEFERRED_UNION_SHARE <= numel\n",
      "        deferred = self.B.DEFERS_STATISTICS and self.B.numel(indices) * DEFERRED_UNION_SHARE > numel\n",
      ["tests/torch_core/test_host_reads.py", "-k", "union"],
      "the union is deferred where the gathered indices are many (kept alive until the next step closes)"),
    M("deferred-union-read-apart-from-the-logged-figures", P + "engine/step.py",
      "        if self._stats_log is not None:\n            work_out_deferred(self.stats)\n",
      "",
      ["tests/engine/test_step.py", "-k", "deferred"],
      "with a statistics log the deferred unions are read in a device read of their own, not with the step's"),
    M("last-stats-with-deferred-unions", P + "engine/step.py",
      "        return None if self._closed is None else read_deferred(self._closed, self.read_scalars or read_each)\n",
      "        return self._closed\n",
      ["tests/engine/test_step.py", "-k", "deferred"],
      "last_stats hands out unions that were never worked out"),
    M("deferred-unions-read-one-at-a-time", P + "common/stats.py",
      "    if work_out_deferred(stats):\n        read_figures(stats, read_scalars)\n",
      "    if work_out_deferred(stats):\n        for group in stats.groups:\n"
      "            read_figures(StepStats(stats.step, [group]), read_scalars)\n",
      ["tests/common/test_stats.py"],
      "reading a step's deferred unions takes a device read per group"),
    M("agreement-gathers-a-tensor-a-rank", P + "distributed/host_collectives.py",
      "    every = mine.new_empty(process_group.size())\n"
      "    _ALL_GATHER_SINGLE(every, mine, group=process_group.group)\n    return every.tolist()\n",
      "    every = [torch.empty_like(mine) for _ in range(process_group.size())]\n"
      "    dist.all_gather(every, mine, group=process_group.group)\n    return torch.cat(every).tolist()\n",
      ["tests/ddp/test_hook.py", "-k", "operations"],
      "torch.distributed's small agreements allocate a tensor a rank and join them: operations grow with the ranks"),
    M("union-read-per-group", P + "torch_core/tensor_backend.py",
      "    return marked.sum() if on_accelerator(indices) else host_count(marked)\n",
      "    return int(marked.sum())\n",
      ["tests/ddp/test_hook.py", "tests/fsdp/test_replicas.py", "-k", "host_reads"],
      "on an accelerator every bucket's or unit's union count is read on the host inside its exchange"),
    M("deferred-nonfinite-gradient-enters-the-residual", P + "torch_core/buffers.py",
      "            torch.where(finite, staged, self._nonfinite_fill(), out=staged)\n",
      "            pass\n",
      ["tests/torch_core/test_host_reads.py"],
      "on an accelerator a rank's non-finite gradient, decided on the device, still enters the residual"),
    M("deferred-nonfinite-decision-ignored", P + "torch_core/finiteness.py",
      "                 if not (next(values) if isinstance(finite, torch.Tensor) else finite) for name in names]\n",
      "                 if not (True if isinstance(finite, torch.Tensor) else finite) for name in names]\n",
      ["tests/torch_core/test_host_reads.py"],
      "on an accelerator the finiteness decided on the device is never read: a NaN step is not abandoned"),
    M("ddp-bucket-not-split-by-dense", P + "ddp/buckets.py",
      "        return [key for key in (others, kept) if key]\n",
      "        return [members]\n",
      ["tests/fsdp/test_replicas.py", "-k", "mixed_bucket"],
      "a DDP bucket mixing kept-dense and other parameters is sparsified whole"),
    # -- the accelerators' paths (PyTorch, run on CPU tensors by the tests) ------------------------
    M("device-coalesce-sums-unsorted-values", P + "torch_core/tensor_backend.py",
      "    return unique, torch.zeros_like(values).index_add_(0, place, values[order])\n",
      "    return unique, torch.zeros_like(values).index_add_(0, place, values)\n",
      ["tests/methods/test_backends.py", "-k", "merge"],
      "gTop-k's fixed-size merge on a GPU adds each value to the place of another index"),
    M("device-isin-a-bound-not-a-match", P + "torch_core/tensor_backend.py",
      "    return ascending.take(position) == values\n",
      "    return ascending.take(position) <= values\n",
      ["tests/methods/test_backends.py", "-k", "merge"],
      "the binary-search isin on a GPU finds indices that are not in the set"),
    M("device-histogram-edges-on-the-wrong-side", P + "torch_core/histograms.py",
      "    slots = torch.searchsorted(edges, scanned.magnitudes.float(), right=True, out_int32=True)\n",
      "    slots = torch.searchsorted(edges, scanned.magnitudes.float(), right=False, out_int32=True)\n",
      ["tests/methods/test_backends.py", "-k", "accelerators"],
      "MiCRO's histogram on a GPU counts a magnitude equal to an edge in the bin below it"),
    M("device-histograms-of-both-bars-in-one", P + "torch_core/histograms.py",
      "    placed = torch.where(bars.reaching, slots + starts, spare).view(-1)\n",
      "    placed = torch.where(bars.reaching, slots, spare).view(-1)\n",
      ["tests/methods/test_backends.py", "-k", "accelerators"],
      "on a GPU, MiCRO's histograms at its two bars are counted together into the first one's bins"),
    M("device-histogram-bars-compared-in-float32", P + "torch_core/histograms.py",
      "    return Bars(levels, magnitudes >= levels.to(magnitudes.dtype).unsqueeze(1))\n",
      "    return Bars(levels, magnitudes >= levels.unsqueeze(1))\n",
      ["tests/methods/test_backends.py", "-k", "accelerators"],
      "on a GPU, a bfloat16 buffer's histogram counts against its bar in float32 where the host rounds the bar "
      "to bfloat16 (the smallest bar, below bfloat16's range, then leaves the zeros out)"),
    M("micro-fine-window-around-the-first-reading", P + "methods/micro/device_rounds.py",
      '    centre, _ = B.settle(first, _places(((FIRST, "short"),)), (FIRST, WIDE))\n',
      '    centre, _ = B.settle(first, _places(((FIRST, "short"),)), (FIRST, FIRST))\n',
      ["tests/methods/test_backends.py", "-k", "rounds_settle"],
      "on a GPU, MiCRO's fine window is centred on the first reading where the host's is on the wide one"),
    M("device-rounds-flags-read-lowest-bit-first", P + "torch_core/histograms.py",
      "    number = (flags * constant(tuple(1 << bit for bit in reversed(range(len(places)))), torch.int32,\n",
      "    number = (flags * constant(tuple(1 << bit for bit in range(len(places))), torch.int32,\n",
      ["tests/methods/test_backends.py", "-k", "rounds_settle"],
      "on a GPU, MiCRO's rounds' flags index the table of settled readings in the wrong order"),
    M("chunk-tail-keeps-every-pick", P + "torch_core/chunked.py",
      "                        lambda: torch.arange(rows * k, device=flat.device).view(rows, k)"
      " >= (rows - 1) * k + k_last)\n",
      "                        lambda: torch.arange(rows * k, device=flat.device).view(rows, k) >= rows * k)\n",
      ["tests/methods/test_sparseloco.py", "-k", "chunk_selection_of_every_dtype"],
      "on a GPU, SparseLoCo's shorter last chunk keeps its lowest indices among its top k, not its top k_last"),
    M("chunk-tail-padded-above-its-values", P + "torch_core/chunked.py",
      "    magnitudes = torch.nn.functional.pad(flat.abs(), (0, rows * chunk - flat.numel())).view(rows, chunk)\n",
      "    magnitudes = torch.nn.functional.pad(flat.abs(), (0, rows * chunk - flat.numel()),"
      " value=1.0).view(rows, chunk)\n",
      ["tests/methods/test_sparseloco.py", "-k", "chunk_selection_of_every_dtype"],
      "on a GPU, the padding of SparseLoCo's last chunk outranks its small values and is selected"),
    M("chunk-tail-selected-apart", P + "torch_core/chunked.py",
      "    if on_accelerator(flat) and (chosen := _top_k_padded_rows(flat, chunk, k, k_last)) is not None:\n",
      "    if False:\n",
      ["tests/methods/test_sparseloco.py", "-k", "takes_one_topk"],
      "on a GPU, SparseLoCo's shorter last chunk takes a selection of its own (seven operations more)"),
    M("host-chunk-blocks-out-of-order", P + "torch_core/chunked.py",
      "    ranked = torch.topk(ranked_keys(maxima), k, dim=1, sorted=False).indices.sort(dim=1).values\n",
      "    ranked = torch.topk(ranked_keys(maxima), k, dim=1, sorted=True).indices\n",
      ["tests/methods/test_sparseloco.py", "-k", "rows_keeping_few"],
      "SparseLoCo's host reads a row's candidate blocks largest first, so a tie goes to the higher index"),
    M("host-chunk-blocks-one-short", P + "torch_core/chunked.py",
      "    ranked = torch.topk(ranked_keys(maxima), k, dim=1, sorted=False).indices.sort(dim=1).values\n",
      "    ranked = torch.topk(ranked_keys(maxima), k, dim=1, sorted=False).indices.sort(dim=1).values\n"
      "    ranked[:, -1] = ranked[:, 0]\n",
      ["tests/methods/test_sparseloco.py", "-k", "rows_keeping_few"],
      "SparseLoCo's host keeps k - 1 blocks' candidates a row (one read twice), missing a coordinate of the top-k"),
    M("host-chunk-blocks-keyed-by-sign", P + "torch_core/chunked.py",
      "    candidates = flat.view(-1, SUB_BLOCK).index_select(0, ranked.view(-1)).abs_().view(full, k * SUB_BLOCK)\n",
      "    candidates = flat.view(-1, SUB_BLOCK).index_select(0, ranked.view(-1)).view(full, k * SUB_BLOCK)\n",
      ["tests/methods/test_sparseloco.py", "-k", "rows_keeping_few"],
      "SparseLoCo's host ranks its candidates by signed value: a large negative one loses"),
    M("candidate-bars-in-the-order-of-their-places", P + "torch_core/histograms.py",
      "            both = top.as_strided((2,), (first - second,), second).flip(0)\n",
      "            both = top.as_strided((2,), (first - second,), second)\n",
      ["tests/methods/test_backends.py", "-k", "bar_and_histogram"],
      "on a GPU, MiCRO's two bars come back in the order of their places, the wide one first when its budget is "
      "the smaller"),
    M("candidate-bars-read-one-at-a-time", P + "torch_core/histograms.py",
      "    if max(budgets) < maxima.numel():\n",
      "    if False:\n",
      ["tests/methods/test_backends.py", "-k", "two_bars_come_from_one_topk"],
      "on a GPU, MiCRO's two bars take a kthvalue and a clamp each and a stack (two operations more a group)"),
    M("micro-union-cast-to-int64", P + "methods/micro/exchange.py",
      "        union, update, residual = gathered, comm.output(x), x\n",
      "        union, update, residual = B.as_index(gathered), comm.output(x), x\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and micro"],
      "on a GPU, MiCRO casts the gathered indices to int64 before its gathers and scatters take them as sent"),
    M("one-chunk-split-to-scatter", P + "torch_core/tensor_backend.py",
      "    if len(counts) == 1:\n",
      "    if False:\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and micro"],
      "one chunk of indices and values is split (two operations) before its one index_add_"),
    M("device-dgc-retry-in-single-precision", P + "torch_core/tensor_backend.py",
      "    return (threshold * powers).float().clamp_min(SMALLEST_THRESHOLD)\n",
      "    return (threshold * powers.float()).clamp_min(SMALLEST_THRESHOLD)\n",
      ["tests/methods/test_backends.py", "-k", "accelerators"],
      "DGC's lowered threshold on a GPU is rounded differently from the host's"),
    M("micro-threshold-decided-on-the-host", P + "methods/micro/exchange.py",
      "        if B.decides_on_device(scanned.x):\n",
      "        if False:\n",
      ["tests/torch_core/test_host_reads.py", "-k", "budget and micro"],
      "a host read put back into an exchange: MiCRO reads its summed histograms on the host on a GPU"),
    M("dgc-first-settled-indexed-by-a-device-index", P + "torch_core/tensor_backend.py",
      "checked.take(first.clamp_max(checks - 1)) > math.floor(high)\n",
      "checked[first.clamp_max(checks - 1)] > math.floor(high)\n",
      ["tests/torch_core/test_host_reads.py", "-k", "budget and dgc"],
      "a 0-dim tensor indexes DGC's counts: C++ reads it on the host (seen only at the dispatcher)"),
    M("dgc-cut-padded-with-index-zero", P + "torch_core/tensor_backend.py",
      "    chosen = torch.nn.functional.pad(chosen, (0, capacity - k), value=PAD)",
      "    chosen = torch.nn.functional.pad(chosen, (0, capacity - k), value=0)",
      ["tests/torch_core/test_host_reads.py", "-k", "dgc"],
      "DGC's cut to the top-k on a GPU pads its payload with index 0, not the padding mark"),
    M("device-pick-takes-the-last-count-whatever-its-threshold", P + "torch_core/selection.py",
      "    if kept and kept[0][0] is threshold:\n",
      "    if kept:\n",
      ["tests/torch_core/test_selection.py", "-k", "accelerators"],
      "a pick on the accelerators' paths reuses the mask of the last count at another threshold"),
    M("gaussiank-picks-at-its-first-threshold", P + "methods/gaussiank.py",
      "        bar = B.as_threshold(threshold)\n        found = B.count_reaching(scanned, bar)\n",
      "        found = B.count_reaching(scanned, B.as_threshold(threshold))\n",
      ["tests/torch/test_threshold_baselines.py", "-k", "gaussiank"],
      "Gaussian-k counts its corrected thresholds but picks at its first one"),
    M("dgc-counts-miss-a-magnitude-equal-to-a-threshold", P + "torch_core/tensor_backend.py",
      "    places = torch.bucketize(magnitudes, thresholds.flip(0).to(magnitudes.dtype), right=True, out_int32=True)\n",
      "    places = torch.bucketize(magnitudes, thresholds.flip(0).to(magnitudes.dtype), out_int32=True)\n",
      ["tests/methods/test_backends.py", "-k", "one_pass"],
      "DGC's one-pass counts on a GPU leave out the magnitudes equal to a threshold"),
    M("dgc-counts-in-single-precision", P + "torch_core/tensor_backend.py",
      "    return torch.float32 if magnitudes.numel() < 2 ** 24 else torch.float64\n",
      "    return torch.float32\n",
      ["tests/methods/test_backends.py", "-k", "one_pass"],
      "DGC's one-pass counts on a GPU stop at 2**24 (float32 counting) on a large buffer"),
    M("staged-gradients-copied-twice", P + "torch_core/buffers.py",
      "[gradient for _, gradient in copied])",
      "[gradient.clone() for _, gradient in copied])",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and topk"],
      "a per-tensor copy added to the staging of a group's gradients (issue 57: nothing per parameter)"),
    M("staging-copies-one-parameter-at-a-time", P + "torch_core/buffers.py",
      "            torch._foreach_copy_([view for view, _ in copied], [gradient for _, gradient in copied])\n",
      "            [view.copy_(gradient) for view, gradient in copied]\n",
      ["tests/torch_core/test_host_reads.py", "-k", "staged_in_one_operation"],
      "a group's gradients staged by one copy per parameter (an operation each) instead of one for the group"),
    M("ddp-update-in-a-buffer-of-its-own", P + "ddp/hook.py",
      "group.load_flat(gradient, self._scale.inverse, finite, hand_over=True)",
      "group.load_flat(gradient, self._scale.inverse, finite, hand_over=False)",
      ["tests/ddp/test_hook.py", "-k", "written_over"],
      "the DDP hook writes each bucket's aggregate into a buffer of its own (a second copy of the model's size "
      "beside the residuals) instead of over DDP's bucket"),
    M("fsdp-update-copied-into-the-shard", P + "fsdp/replicas.py",
      "group.load_flat(shard, self._scale.inverse, finite, hand_over=True)",
      "group.load_flat(shard, self._scale.inverse, finite, hand_over=False)",
      ["tests/fsdp/test_replicas.py", "-k", "operations"],
      "FSDP2's exchange writes each unit's update into a buffer of its own and copies it into the shard"),
    M("host-stages-gradients", P + "torch_core/buffers.py",
      "if self.adds_in_place and not on_accelerator(self.residual) and all(",
      "if self.adds_in_place and on_accelerator(self.residual) and all(",
      ["tests/torch_core/test_buffers.py"],
      "on the host a group's gradients are staged (copied into the output, read again) before they are added"),
    M("host-adds-small-parameters-in-place", P + "torch_core/buffers.py",
      "self.adds_in_place = bool(params) and self.numel >= ADD_IN_PLACE_FROM * len(params)",
      "self.adds_in_place = bool(params)",
      ["tests/torch_core/test_buffers.py", "-k", "large_parameters"],
      "a group of small parameters adds each gradient in place (a check and an addition per parameter cost "
      "more than staging them)"),
    M("host-adds-non-finite-gradients", P + "torch_core/buffers.py",
      "            if check(gradients):\n",
      "            if check(gradients) or True:\n",
      ["tests/torch_core/test_buffers.py"],
      "on the host a group's non-finite gradients enter the residual"),
    M("published-views-copied-again", P + "torch_core/buffers.py",
      "                  if gradient is not None and gradient is not view]\n",
      "                  if gradient is not None]\n",
      ["tests/torch_core/test_host_reads.py", "-k", "staged_in_one_operation"],
      "gradients backward wrote into the buffer's own views are copied onto themselves"),
    M("default-grouping-per-tensor", P + "methods/base.py",
      '    default_grouping: ClassVar[Any] = "buckets"\n',
      '    default_grouping: ClassVar[Any] = "tensor"\n',
      ["tests/torch/test_grouping.py", "-k", "groups_none"],
      "groups=None splits the buckets back into one group per tensor (issue 57: 161 exchanges a ResNet-50 step)"),
    M("whole-slice-capacity-clamps-its-count", P + "torch_core/selection.py",
      "    if capacity >= scanned.end - scanned.start:\n",
      "    if capacity > scanned.end - scanned.start:\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and gaussiank"],
      "a capacity that holds the whole scanned slice still clamps the count and subtracts the overflow on "
      "the device (two operations a group for nothing)"),
    M("capped-pick-never-overflows", P + "torch_core/selection.py",
      "    if capacity >= scanned.end - scanned.start:\n",
      "    if True:\n",
      ["tests/torch_core/test_host_reads.py", "-k", "overflows"],
      "on an accelerator a selection cut to its capacity counts everything found as sent and none as overflow"),
    M("whole-group-threshold-padded", P + "methods/threshold.py",
      "        masked = self.B.decides_on_device(x) and capacity >= numel\n",
      "        masked = False\n",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and threshold"],
      "on an accelerator the hard threshold's default capacity (the whole group) sends a payload padded to "
      "the group's length and its indices, not the masked group (24 operations a step of 3 groups)"),
    M("masked-chunks-summed-by-multiply-adds", P + "torch_core/tensor_backend.py",
      "        values.mul_(constant(scale, out.dtype, out.device))\n"
      "    for chunk in values.split(out.numel()) if size > 1 else (values,):\n"
      "        out.add_(chunk)\n",
      "        pass\n"
      "    for chunk in values.split(out.numel()) if size > 1 else (values,):\n"
      "        out.add_(chunk, alpha=scale)\n",
      ["tests/torch_core/test_masked_payload.py"],
      "a masked payload's chunks are scaled within the sum (a fused multiply-add), not scaled and then added "
      "as the indexed payload's index_add_ does"),
    M("masked-chunks-scaled-in-float32", P + "torch_core/tensor_backend.py",
      "        values.mul_(constant(scale, out.dtype, out.device))\n",
      "        values.mul_(scale)\n",
      ["tests/torch_core/test_masked_payload.py"],
      "a masked payload's chunks are scaled by the float32 scale, not the scale in their dtype as "
      "index_add_'s alpha is (bfloat16 groups differ)"),
    M("masked-union-counts-the-ranks-rows", P + "torch_core/tensor_backend.py",
      "    return (sent.view(size, -1).any(0) if size > 1 else sent).sum()\n",
      "    return sent.sum()\n",
      ["tests/torch_core/test_masked_payload.py"],
      "the union of the ranks' masked payloads counts a coordinate once per rank that sent it"),
    M("masked-residual-zeroes-what-was-sent", P + "torch_core/communicator.py",
      "            return x.sub_(wire_values.to(x.dtype))\n",
      "            return x.masked_fill_(wire_values != 0, 0)\n",
      ["tests/torch_core/test_host_reads.py", "-k", "float16_wire"],
      "a masked payload's residual zeroes what was sent, losing what a float16 wire rounded off"),
    M("masked-delivery-not-undone", P + "torch_core/communicator.py",
      "                x.add_(wire_values.to(x.dtype))\n",
      "                pass\n",
      ["tests/torch_core/test_host_reads.py", "-k", "nonfinite and threshold"],
      "an abandoned step leaves a masked payload subtracted from the residual"),
    M("ddp-bucket-copied-per-parameter", P + "ddp/buckets.py",
      "    return len(groups) == 1 and len(groups[0].params) == len(params) and all(\n",
      "    return False and len(groups) == 1 and len(groups[0].params) == len(params) and all(\n",
      ["tests/benchmarks/test_exchange_cost.py", "-k", "within_their_budget and ddp"],
      "the DDP hook copies each parameter's gradient out of its bucket and its update back in (issue 57: "
      "nothing per parameter; ResNet-50's 161)"),
    M("ddp-bucket-split-per-tensor", P + "ddp/buckets.py",
      "        return [key for key in (others, kept) if key]\n",
      "        return [(n,) for n in others] + [key for key in (kept,) if key]\n",
      ["tests/benchmarks/test_exchange_cost.py", "-k", "within_their_budget and ddp"],
      "the DDP hook exchanges a bucket as one group per tensor (issue 57: a bucket's budget, not one per tensor)"),
    M("device-top-k-ties-to-the-higher-index", P + "torch_core/top_k.py",
      "    positions = steps(_INDEX_SPAN - 1, _INDEX_SPAN - 1 - width, -1, torch.int64, magnitudes.device)\n",
      "    positions = steps(0, width, 1, torch.int64, magnitudes.device)\n",
      ["tests/torch_core/test_top_k.py", "-k", "device_top_k"],
      "the accelerators' one-topk selection keys break magnitude ties to the higher index"),
    M("host-finiteness-checks-the-first-tensor-only", P + "torch_core/tensor_backend.py",
      "               or bool(torch.isfinite(t).all()) for t in tensors)\n",
      "               or bool(torch.isfinite(t).all()) for t in tensors[:1])\n",
      ["tests/torch/test_reliability.py", "-k", "cheap_finiteness"],
      "the host's finiteness check of several tensors looks at the first only"),
    M("finite-flag-misses-infinities", P + "torch_core/tensor_backend.py",
      "    return (largest[0] if len(largest) == 1 else torch.stack(largest).amax()).lt(math.inf)\n",
      "    return (largest[0] if len(largest) == 1 else torch.stack(largest).amax()).le(math.inf)\n",
      ["tests/torch/test_reliability.py", "-k", "cheap_finiteness"],
      "the accelerators' finiteness flag sees NaN but not an infinity"),
    M("finite-flag-of-several-reads-the-first", P + "torch_core/tensor_backend.py",
      "    return (largest[0] if len(largest) == 1 else torch.stack(largest).amax()).lt(math.inf)\n",
      "    return largest[0].lt(math.inf)\n",
      ["tests/torch/test_reliability.py", "-k", "cheap_finiteness"],
      "the accelerators' finiteness flag of several tensors looks at the first only"),
    M("device-figures-read-out-of-order", P + "torch_core/device_figures.py",
      "        for i in itertools.chain(*by_dtype.values()):\n",
      "        for i in sorted(itertools.chain(*by_dtype.values())):\n",
      ["tests/methods/test_backends.py", "-k", "figures_left"],
      "figures gathered by dtype are handed back to the wrong tensors"),
    M("uneven-allgather-rows-kept-padded", P + "distributed/host_collectives.py",
      "    if all(n == longest for n in lengths):  # a fixed count (a capacity): the rows as they came\n",
      "    if True:\n",
      ["tests/ddp/test_hook.py", "-k", "replicas_identical"],
      "ranks' rows of unequal counts are taken with their padding (torch.distributed's allgather)"),
    M("device-scan-takes-block-maxima", P + "torch_core/selection.py",
      "    if on_accelerator(x):\n        return _device_scan(",
      "    if False:\n        return _device_scan(",
      ["tests/torch_core/test_host_reads.py", "-k", "operations and threshold"],
      "a scan on the device takes block maxima no device selection reads (a pass and a dozen operations)"),
    M("ddp-bucket-copied-before-its-exchange", P + "ddp/buckets.py",
      "        return [buffer]\n",
      "        return [buffer.clone()]\n",
      ["tests/ddp/test_hook.py", "-k", "operations and topk"],
      "a copy of each DDP bucket before its exchange (issue 57: the hook takes the bucket's own memory)"),
    M("chunk-ties-of-unkeyed-rows-all-kept", P + "torch_core/chunked.py",
      "    keep = above | (tied & (tied.cumsum(dim=1) <= k - above.sum(dim=1, keepdim=True)))\n",
      "    keep = above | tied\n",
      ["tests/methods/test_sparseloco.py", "-k", "chunk_selection_of_every_dtype"],
      "SparseLoCo's chunks of float64 (no ranked keys) keep every tie at the k-th magnitude, not the first"),
    M("fsdp-shard-copied-before-its-exchange", P + "fsdp/replicas.py",
      "lambda: group.load_flat(shard, self._scale.inverse, finite, hand_over=True)",
      "lambda: group.load_flat(shard.clone(), self._scale.inverse, finite, hand_over=True)",
      ["tests/fsdp/test_replicas.py", "-k", "operations and topk"],
      "a copy of each FSDP2 shard before its exchange (the replicas' hook takes the shard's own memory)"),
    M("count-filled-from-a-device-value", P + "torch_core/tensor_backend.py",
      "    if isinstance(n, torch.Tensor):  # a count left on the device: a fill would read it on the host\n",
      "    if False:\n",
      ["tests/torch_core/test_host_reads.py", "-k", "budget and micro"],
      "MiCRO's count left on the device becomes a fill value, which C++ reads on the host"),
    M("micro-device-state-never-settled", P + "methods/micro/exchange.py",
      "            comm.stats.when_read(lambda group: self._settle(state, step, group))\n",
      "",
      ["tests/torch_core/test_host_reads.py", "-k", "budget and exdyna"],
      "on a GPU, ExDyna's threshold controller and partition table never learn a step's counts"),
    M("micro-overflow-dropped", P + "methods/micro/exchange.py",
      "            return cut(idx, B.size(idx), capacity), {",
      "            scanned.x.index_fill_(0, idx[capacity:], 0.0)\n"
      "            return cut(idx, B.size(idx), capacity), {",
      ["tests/torch/test_partitioned.py", "-k", "nothing_lost and capped"],
      "what MiCRO's partition selects beyond its capacity is dropped instead of kept in the residual"),
    M("device-rounds-skip-the-fine-round-after-a-wide-one", P + "methods/micro/device_rounds.py",
      "        return FINE_WIDE if flags.wide_coarse else WIDE\n",
      "        return WIDE\n",
      ["tests/methods/test_backends.py", "-k", "rounds_settle"],
      "on a GPU, MiCRO's threshold after a wide round is not refined in a fine window where the host's is"),
    M("device-reading-short-at-the-first-edge", P + "torch_core/histograms.py",
      "    return torch.cat([threshold, outside, bounded > outside, coarse], 1)\n",
      "    return torch.cat([threshold, outside, bounded, coarse], 1)\n",
      ["tests/methods/test_backends.py", "-k", "reading"],
      "on a GPU, a reading stopped at the window's first edge counts as short of k, not as outside"),
    M("micro-capacity-unvalidated", P + "methods/micro/options.py",
      "        super()._validate()\n        check_choice(\"controller\"",
      "        check_choice(\"controller\"",
      ["tests/common/test_options.py", "-k", "capacity"],
      "MiCRO takes any capacity (zero, negative, a string) without a word"),
    M("candidates-always-filtered", P + "methods/micro/controllers.py",
      "    return mark < len(window) and threshold >= float(window.edges32()[mark])\n",
      "    return True\n",
      ["tests/methods/micro/test_controllers.py"],
      "MiCRO filters its candidates even when the threshold lies below its bar (coordinates lost)"),
    # -- FSDP2 front end -----------------------------------------------------------------------------
    M("transport-sums-instead-of-averaging", P + "engine/topology.py",
      "        return 1.0 / size if self.average else 1.0\n",
      "        return 1.0\n",
      ["tests/fsdp/test_replicas.py", "-k", "bitwise and topk"],
      "the transport sums the replicas' updates where its front end averages (FSDP2's shards summed)"),
    M("fsdp-checkpoint-residual-ignored", P + "fsdp/checkpoint.py",
      "    if saved.get(\"residual\") is not None:\n",
      "    if False:\n",
      ["tests/fsdp/test_replicas.py", "-k", "resumes and topk"],
      "a loaded FSDP2 state starts its units from empty residuals"),
    M("fsdp-checkpoint-key-shared-by-ranks", P + "distributed/rank_state.py",
      "    return f\"rank{dist.get_rank() if rank is None else rank}\"\n",
      "    return \"replicas\"\n",
      ["tests/fsdp/test_replicas.py", "-k", "resumes and topk"],
      "every rank saves its FSDP2 state under one key: torch.distributed.checkpoint keeps one rank's"),
    # -- outer steps (DiLoCo) ------------------------------------------------------------------------
    M("outer-step-not-from-the-anchor", P + "outer/rounds.py",
      "        if not self.offload:\n            self.anchor.reset(indices)\n        self._outer_step(",
      "        self._outer_step(",
      ["tests/outer/test_streamed.py", "-k", "reference_bitwise and streamed_topk"],
      "the outer step of a fragment's landed exchange applies the average to each replica's own parameters "
      "(moved by the inner steps since its boundary), not to the fragment's anchor"),
    M("outer-abandoned-round-keeps-local-steps", P + "outer/rounds.py",
      "        self.anchor.reset(indices)\n        self._start(",
      "        self._start(",
      ["tests/outer/test_rounds.py", "-k", "nonfinite"],
      "an abandoned round leaves every replica where its inner steps took it (replicas differ)"),
    M("outer-pseudo-gradient-reversed", P + "outer/anchor.py",
      "            view.sub_(p)\n",
      "            view.sub_(p).neg_()\n",
      ["tests/outer/test_rounds.py", "-k", "reference_bitwise and topk"],
      "the pseudo-gradient is θ - anchor: the outer step climbs"),
    M("outer-anchor-not-advanced", P + "outer/rounds.py",
      "            self.anchor.take(indices)\n",
      "            pass\n",
      ["tests/outer/test_rounds.py", "-k", "reference_bitwise and topk"],
      "after an outer step the next round's pseudo-gradient is still taken from the first anchor"),
    M("outer-parameters-not-agreed-at-start", P + "outer/replicas.py",
      "        for t in tensors:\n            dist.broadcast(t, source, group=group)\n",
      "",
      ["tests/outer/test_rounds.py", "-k", "identical_replicas and topk"],
      "each replica starts from its own initial parameters (they never agree: no replica is the average)"),
    M("outer-default-not-nesterov", P + "outer/outer_optimizer.py",
      'DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}',
      'DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": False}',
      ["tests/outer/test_rounds.py", "-k", "diloco"],
      "the default outer optimizer is heavy-ball momentum, not DiLoCo's Nesterov SGD"),
    M("outer-round-position-not-saved", P + "outer/checkpoint.py",
      '"position": self.position,',
      '"position": 0,',
      ["tests/outer/test_rounds.py", "-k", "resume and topk_torch"],
      "a checkpoint taken mid-round resumes at the start of a round (the outer steps fall out of step)"),
    M("outer-anchor-not-restored", P + "outer/checkpoint.py",
      '        self.anchor.load(saved["anchor"])\n',
      "",
      ["tests/outer/test_rounds.py", "-k", "resume and topk_dcp"],
      "a resumed round measures its pseudo-gradient from the fresh model's parameters, not the saved anchor"),
    M("outer-configuration-unchecked", P + "outer/rounds.py",
      "        if self.replicas.agree_at_construction:\n            self._require_same_configuration()\n",
      "        if self.replicas.agree_at_construction:\n",
      ["tests/outer/test_rounds.py", "-k", "differs_between_ranks"],
      "ranks with different every= start training (their outer steps' collectives then differ)", hang=True),
    M("outer-overlap-not-delayed", P + "outer/rounds.py",
      "        if not self.overlap:\n            self._land()\n",
      "        if True:\n            self._land()\n",
      ["tests/outer/test_streamed.py", "-k", "reference_bitwise and overlap_topk"],
      "overlap=True still waits for each round's exchange at the round's end (nothing overlaps)"),
    M("outer-overlap-progress-dropped", P + "outer/rounds.py",
      "if landed.fragment != boundary else []",
      "if False else []",
      ["tests/outer/test_streamed.py", "-k", "reference_bitwise and streamed_topk"],
      "a fragment's outer step, landing after its boundary, throws away what the inner steps did since"),
    M("outer-overlap-pseudo-gradient-after-landing", P + "outer/rounds.py",
      "        deltas = [self.anchor.pseudo_gradient(i) for i in indices]\n        self._land()\n"
      "        landed = [self._take_landed(boundary=fragment)]\n",
      "        self._land()\n        landed = [self._take_landed(boundary=fragment)]\n"
      "        deltas = [self.anchor.pseudo_gradient(i) for i in indices]\n",
      ["tests/outer/test_streamed.py", "-k", "reference_bitwise and overlap_topk"],
      "an overlapped round's pseudo-gradient is measured from the anchor its landing just moved "
      "(the previous round's outer step counted in it again)"),
    M("outer-fragment-offsets-shifted", P + "outer/fragments.py",
      "    return [((f + 1) * every // count) % every for f in range(count)]",
      "    return [(f * every // count) % every for f in range(count)]",
      ["tests/outer/test_streamed.py", "-k", "reference_bitwise and streamed_topk"],
      "the fragments' boundaries are not staggered as documented (fragment 0 ends with the cycle)"),
    M("outer-overlap-abandoned-exchange-applied", P + "outer/landing.py",
      "None if outcome.bad_ranks else updates",
      "updates",
      ["tests/outer/test_streamed.py", "-k", "nonfinite"],
      "an overlapped exchange abandoned for a NaN still takes its outer step"),
    M("outer-overlap-checkpoint-drops-landed", P + "outer/checkpoint.py",
      '"landed": None if self._landed is None else self._landed.record(),',
      '"landed": None,',
      ["tests/outer/test_rounds.py", "-k", "resume and streamed_topk"],
      "a checkpoint saved with an overlapped exchange in flight loses its average (its outer step never taken)"),
    M("front-end-takes-a-method-of-another-backend", P + "methods/base.py",
      "    if sparse and compression.B is not backend:\n",
      "    if False:\n",
      ["tests/ddp/test_hook.py", "-k", "refuses_a_sparsifier_built_for_horovod"],
      "a torch.distributed front end takes a method built for Horovod (its collectives are not its own)"),
    M("hvd-outer-dense-in-float16", P + "torch/outer_steps.py",
      "        wire = DenseWire.fp16 if compression is hvd.Compression.fp16 else DenseWire.none\n",
      "        wire = DenseWire.fp16\n",
      ["tests/outer/test_horovod.py", "-k", "torch_distributed_ones and diloco_none"],
      "Horovod's dense DiLoCo (Compression.none) averages in float16 on the wire"),
    M("hvd-outer-parameters-not-broadcast", P + "torch/outer_steps.py",
      "        for i, t in enumerate(tensors):\n",
      "        for i, t in enumerate(tensors[:0]):\n",
      ["tests/outer/test_horovod.py", "-k", "torch_distributed_ones and diloco_topk"],
      "under horovodrun every replica starts from its own parameters, not the first rank's"),
    M("hvd-outer-nonfinite-not-agreed", P + "torch/outer_steps.py",
      "        return lambda groups: agree_at_step_end(policy, groups,",
      "        return lambda groups: agree_at_step_end(None, groups,",
      ["tests/outer/test_horovod.py", "-k", "torch_distributed_ones and nan"],
      "under horovodrun a NaN round is not agreed: the rank that saw it abandons nothing, the others deliver"),
    M("hvd-outer-method-of-another-front-end-accepted", P + "torch/outer_steps.py",
      'return checked_sparse(compression, "torch", backend,',
      'return checked_sparse(compression, "torch", getattr(compression, "B", backend),',
      ["tests/outer/test_horovod.py", "-k", "refused_everywhere"],
      "Horovod's outer steps take a method built for torch.distributed (its collectives are not Horovod's)",
      hang=True),
    M("outer-offload-parameters-not-updated", P + "outer/rounds.py",
      "        if self.offload:\n            self.anchor.reset(indices)\n        else:\n",
      "        if not self.offload:\n",
      ["tests/outer/test_streamed.py", "-k", "offloaded and overlap"],
      "offloaded, the outer step moves the anchor in CPU memory but the parameters never take it"),
    M("outer-offload-steps-the-parameters", P + "outer/rounds.py",
      "self._use_outer_optimizer(outer_optimizer, self.anchor.masters or [[p] for _, p in named], named)",
      "self._use_outer_optimizer(outer_optimizer, [[p] for _, p in named], named)",
      ["tests/outer/test_streamed.py", "-k", "offloaded and overlap"],
      "offloaded, the outer optimizer still steps the parameters on the device (its state there, not in CPU memory)"),
    M("outer-tiers-never-made", P + "outer/rounds.py",
      "        self._engine.tiers = self.replicas.tiers(self.hierarchical, self.node_size)\n",
      "        self._engine.tiers = self.replicas.tiers(False, self.node_size)\n",
      ["tests/outer/test_two_tier.py", "-k", "reference_bitwise and tiers_topk"],
      "hierarchical=True is accepted but the outer exchange runs flat over every rank (no node sums: every "
      "rank's whole pseudo-gradient goes through the method across the nodes)"),
    M("outer-tiers-dense-average-flat", P + "distributed/stepping.py",
      "    if engine.tiers is not None and engine.tiers.splits(group.numel):\n",
      "    if False:\n",
      ["tests/outer/test_two_tier.py", "-k", "tiers_none"],
      "in two tiers DiLoCo's dense average stays one allreduce over every rank (every rank's whole "
      "pseudo-gradient crosses the nodes)"),
    M("outer-tiers-dense-share-of-the-nodes", P + "distributed/dense.py",
      "    wire = _share(buffer, compression, finite, node.size * cross.size)\n",
      "    wire = _share(buffer, compression, finite, cross.size)\n",
      ["tests/outer/test_two_tier.py", "-k", "reference_bitwise and tiers_none"],
      "the two-tier dense average divides by the number of nodes, not of ranks (each node's workers "
      "counted in full: twice the average)"),
    M("outer-node-group-is-the-cross-set", P + "outer/replicas.py",
      "        return tiers.node_set.group\n",
      "        return tiers.cross_set.group\n",
      ["tests/outer/test_two_tier.py", "-k", "ddp_over_the_node_group"],
      "outer.node_group is the slice's group across the nodes: DDP averages the inner steps across nodes, "
      "not inside the node"),
    M("hvd-outer-tiers-not-leveled", P + "torch/outer_steps.py",
      "                                                engine.tiers, engine.stats)\n",
      "                                                None, engine.stats)\n",
      ["tests/outer/test_horovod_tiers.py", "-k", "tiers_micro_burst"],
      "Horovod's two-tier outer steps leave each cross set's data-dependent collectives unleveled: the "
      "loop's own unnamed collective after a round gets another name on each rank and Horovod waits for ever",
      hang=True),
    M("hvd-outer-tiers-dense-flat", P + "torch/outer_steps.py",
      "from horovod_sparse.distributed.stepping import replicas_dense_average\n",
      "from horovod_sparse.distributed.stepping import dense_average as replicas_dense_average\n",
      ["tests/outer/test_horovod_tiers.py", "-k", "tiers_none"],
      "Horovod's two-tier DiLoCo averages in one allreduce over every rank (every rank's whole "
      "pseudo-gradient across the hosts, summed in another order than the tiers')"),
    M("hvd-node-process-set-is-the-job", P + "common/horovod_tiers.py",
      "    return next(found for found, node in zip(sets, layout.nodes) if hvd.rank() in node)\n",
      "    return hvd.global_process_set\n",
      ["tests/outer/test_horovod_tiers.py", "-k", "tiers_ddp_topk"],
      "node_process_set() is the whole job: Horovod's inner optimizer averages across the hosts, not in the host"),
    M("hvd-outer-node-size-taken", P + "torch/outer_steps.py",
      "        if node_size is not None:\n            raise ValueError(f\"horovod_sparse.torch.OuterSteps takes",
      "        if False:\n            raise ValueError(f\"horovod_sparse.torch.OuterSteps takes",
      ["tests/outer/test_horovod_tiers.py", "-k", "node_size_is_refused"],
      "Horovod's two tiers take a node_size that its hosts may contradict (nodes of node_size ranks are "
      "not the hosts Horovod's process sets follow)"),
    M("outer-tiers-hierarchical-unagreed", P + "outer/rounds.py",
      '"offload": self.offload, "hierarchical": self.hierarchical,',
      '"offload": self.offload,',
      ["tests/outer/test_two_tier.py", "-k", "refused_on_every_rank and hierarchical_differs"],
      "a rank built with hierarchical=False while the others make the tiers: it skips their collectives "
      "(the job hangs instead of every rank raising)", hang=True),
    M("outer-checkpoint-tiers-not-saved", P + "outer/checkpoint.py",
      '"tiers": self.node_size_in_tiers(),',
      '"tiers": None,',
      ["tests/outer/test_two_tier.py", "-k", "resume_mid_round_in_two_tiers"],
      "a two-tier state is saved as a flat one: resuming it in the same two tiers is refused"),
    M("outer-checkpoint-tiers-unchecked", P + "outer/checkpoint.py",
      "        if tiers != mine:\n",
      "        if False:\n",
      ["tests/outer/test_two_tier.py", "-k", "layouts"],
      "a two-tier state (residuals and method states by slice) loads into flat outer steps, and a flat one "
      "into two tiers, without a word"),
    M("fsdp-configuration-on-the-replicas-only", P + "fsdp/replicas.py",
      "                                          model_state=functools.partial(ShardedModelState, whole=[]))\n",
      "                                          model_state=ShardedModelState.__mro__[1])\n",
      ["tests/fsdp/test_replicas.py", "-k", "differing_on_one_rank"],
      "FSDP2's configuration is agreed within each replicate group only: a rank differing outside rank 0's "
      "group stops its group alone, the others go on and wait for it (a hang, not an error on every rank)",
      hang=True),
    M("outer-fsdp-shard-copied", P + "outer/sharded.py",
      "        return p.to_local().detach()\n",
      "        return p.to_local().detach().clone()\n",
      ["tests/outer/test_fsdp.py", "-k", "written_out_rounds_bitwise and fsdp_topk"],
      "an FSDP2 model's groups hold copies of its local shards: the parameters are never reset to the anchor "
      "nor given the outer step (each replica drifts on its own)"),
    M("outer-fsdp-abandoned-on-the-replicas-only", P + "outer/sharded.py",
      "        return nonfinite_agreement(policy, ProcessGroup(None))\n",
      "        return nonfinite_agreement(policy, self.process_group)\n",
      ["tests/outer/test_fsdp.py", "-k", "nonfinite_shard and skip"],
      "a NaN in one shard abandons the round on its replicate group only: the other shard position takes its "
      "outer step, and the model's shards are of different rounds"),
    M("outer-fsdp-configuration-on-the-replicas-only", P + "fsdp/agreement.py",
      "            super().require_same_configuration(settings, self.whole)\n",
      "            pass\n",
      ["tests/outer/test_fsdp.py", "-k", "refused and every_differs"],
      "a configuration differing on a rank outside rank 0's replicate group is refused by that group alone: the "
      "other shard position trains on (and waits for it at the round's end)"),
    M("outer-fsdp-hsdp-accepted", P + "outer/sharded.py",
      '        require_one_dimensional_meshes(model, "process_group")\n',
      "",
      ["tests/outer/test_fsdp.py", "-k", "refused and hsdp"],
      "an FSDP2 model sharded over the 2-D mesh (FSDP's HSDP, averaging across replicas at every backward pass) "
      "is not refused with the fix"),
    M("outer-fsdp-any-group-accepted", P + "outer/sharded.py",
      "        require_replicas_of_one_shard(model, process_group)\n",
      "",
      ["tests/outer/test_fsdp.py", "-k", "refused and (world or shard_group)"],
      "outer steps of an FSDP2 model over a group that is not the replicas of one shard position (every rank, "
      "or the shard group) are not refused with the fix: different shards would be averaged together"),
    M("engine-empty-group-sparse", P + "engine/step.py",
      "                and numel > 0 and (self.tiers is None",
      "                and (self.tiers is None",
      ["tests/outer/test_fsdp.py", "-k", "empty_shard"],
      "an empty group (an FSDP2 shard of a parameter with fewer rows than shard ranks) goes through the sparse "
      "method, which indexes an empty buffer: the outer steps crash"),
    M("ddp-rebuilt-bucket-copied-per-parameter", P + "ddp/buckets.py",
      "        owner = {n: key for key in self._saved_groups for n in key}\n",
      "        owner = {n: key for key in [*self._groups, *self._saved_groups] for n in key}\n",
      ["tests/ddp/test_hook.py", "-k", "rebuilt_in_another_order"],
      "a bucket DDP rebuilt in another order is exchanged as the groups of its first layout: every step "
      "copies each parameter's gradient out of the bucket and back (operations per parameter)"),
    M("hvd-outer-tiers-in-elastic-accepted", P + "torch/outer_steps.py",
      "        if not self.agree_at_construction:  # an elastic job\n",
      "        if False:  # an elastic job\n",
      ["tests/outer/test_two_tier.py", "-k", "one_process"],
      "Horovod's two tiers are made in an elastic job, whose hosts (the nodes) change under them"),
    M("hvd-outer-elastic-no-roll-back", P + "torch/outer_steps.py",
      "        self._continue_from(copy.deepcopy(snapshot))\n",
      "        del snapshot\n",
      ["tests/outer/test_elastic.py"],
      "after a worker was lost mid-round the survivors go on from where the failed exchange left them, not "
      "from the last commit (the round's inner steps and half an exchange kept, the round trained again on top)",
      hang=True),
    M("hvd-outer-elastic-snapshot-not-copied", P + "torch/outer_steps.py",
      "        return copy.deepcopy(self._whole_state())\n",
      "        return self._whole_state()\n",
      ["tests/outer/test_elastic.py"],
      "a commit keeps references to the live parameters, anchor and residuals: the roll-back after a loss "
      "restores what the lost round made of them", hang=True),
    M("hvd-outer-elastic-joiner-keeps-its-parameters", P + "torch/outer_steps.py",
      "        if new:\n            self.anchor.reset()\n",
      "",
      ["tests/outer/test_elastic.py", "-k", "replicas_identical"],
      "a worker joining (or starting) an elastic job trains from its own parameters, not the anchor every "
      "other replica holds"),
    M("hvd-outer-elastic-outer-state-not-taken", P + "torch/outer_steps.py",
      '        self.outer_optimizer.load_state_dict(first["outer"])\n',
      "",
      ["tests/outer/test_elastic.py", "-k", "replicas_identical"],
      "a joining worker's outer optimizer starts without rank 0's state (DiLoCo's momentum): its outer steps "
      "differ from the others'"),
    M("hvd-outer-elastic-configuration-unchecked", P + "torch/outer_steps.py",
      "        self._engine.restart_at(int(first[\"steps\"]))\n        self._require_same_configuration()\n",
      "        self._engine.restart_at(int(first[\"steps\"]))\n",
      ["tests/outer/test_elastic.py", "-k", "refused"],
      "a worker joining with another configuration (every) is taken into the job without a word", hang=True),
    M("hvd-outer-elastic-job-size-kept", P + "torch/outer_steps.py",
      "    @property\n    def job_size(self) -> int:\n",
      '    @__import__("functools").cached_property\n    def job_size(self) -> int:\n',
      ["tests/outer/test_elastic.py", "-k", "keyed"],
      "the replicas' job size is read once: after a membership change state_dict() is saved for the old world "
      "(a checkpoint then refused, or resumed as another size's)"),
    M("hvd-outer-elastic-construction-collective", P + "torch/outer_steps.py",
      "        self.agree_at_construction = not in_elastic_job()\n",
      "        self.agree_at_construction = True\n",
      ["tests/outer/test_elastic.py"],
      "a worker joining an elastic job runs the construction's collectives while the others run the sync's: "
      "the job hangs or fails", hang=True),
    M("engine-step-counted-from-one", P + "engine/step.py",
      "plan.tiers, state, self.step)\n",
      "plan.tiers, state, self.step + 1)\n",
      # The slow reference, not the DDP hook: every PyTorch front end runs this line.
      ["tests/torch/test_grouping.py::test_every_step_matches_the_reference[defaults-micro]"],
      "the step engine hands the method the next step's number (partitions and samples shift)"),
    M("fsdp-loss-scale-kept-in-the-residual", P + "fsdp/replicas.py",
      "lambda: group.load_flat(shard, self._scale.inverse, finite, hand_over=True),\n",
      "lambda: group.load_flat(shard, None, finite, hand_over=True),\n",
      ["tests/fsdp/test_replicas.py", "-k", "loss_scaler and topk"],
      "the FSDP2 front end keeps the loss scale in the residuals (a scale change mixes units)"),
    M("fsdp-scaled-overflow-zeroed", P + "fsdp/replicas.py",
      "            fill_gradients(self._params, math.nan if self._loss_scale is not None else 0.0)\n",
      "            fill_gradients(self._params, 0.0)\n",
      ["tests/fsdp/test_replicas.py", "-k", "loss_scaler and nan"],
      "an abandoned FSDP2 step under a loss scaler hands the scaler zeros: it never backs off"),
    M("fsdp-replicas-of-different-shards-accepted", P + "fsdp/units.py",
      "    if any(other != layout for other in everyone):\n",
      "    if False:\n",
      ["tests/fsdp/test_replicas.py", "-k", "refused_on_every_rank"],
      "a replicate group whose ranks hold different shards is accepted (slices averaged together)"),
    M("ddp-known-rows-wrong", P + "methods/base.py",
      "        rows = \"selected\" if fixed_count is None else [fixed_count] * comm.size\n",
      "        rows = \"selected\" if fixed_count is None else [fixed_count - 1] * comm.size\n",
      ["tests/ddp/test_hook.py", "-k", "test_same_aggregate_as_the_horovod_front_end"],
      "the DDP allgather trusts a wrong row count for Top-k's fixed-size payloads"),
    M("ddp-gtopk-received-rows-wrong", P + "methods/gtopk/exchange.py",
      "        received = [B.size(held.idx) if rank == source else 0 for rank in range(comm.size)]\n",
      "        received = [B.size(held.idx) // 2 if rank == source else 0 for rank in range(comm.size)]\n",
      ["tests/ddp/test_hook.py", "-k", "test_same_aggregate_as_the_horovod_front_end"],
      "the DDP alltoall of a gTop-k round expects half of what the schedule sends"),
    M("fsdp-unit-kept-dense-sparsified", P + "fsdp/replicas.py",
      "unit_group(len(self._groups), name, shard, name in self._kept_units,",
      "unit_group(len(self._groups), name, shard, False,",
      ["tests/fsdp/test_replicas.py", "-k", "unit_kept_dense"],
      "an FSDP unit dense= keeps dense is sparsified"),
    # -- packaging ---------------------------------------------------------------------------------
    M("wheel-without-subpackages", "pyproject.toml",
      'include = ["horovod_sparse", "horovod_sparse.*"]',
      'include = ["horovod_sparse"]',
      ["tests/project/test_packaging.py"],
      "the wheel ships the top-level package without its front ends and methods"),
    # -- the main job's report ----------------------------------------------------------------------
    M("digits-one-node-projected-two-tier", "benchmarks/main_job/digits_report.py",
      'if row.get("two_tier") and per_node > 1 and nodes > 1:',
      'if row.get("two_tier") and per_node > 1 and nodes >= 1:',
      ["tests/benchmarks/test_digits.py", "-k", "says_when_to_turn_it_on"],
      "a two-tier row on a cluster of one node is projected with the two-tier model, which the exchange "
      "does not run there (it runs flat)"),
    M("digits-outer-rows-without-two-tier-twin", "benchmarks/main_job/digits.py",
      "for tier in ([c, c + TWO_TIER] if two_tier_hosts(args) or c in asked else [c]))]",
      "for tier in ([c, c + TWO_TIER] if (two_tier_hosts(args) or c in asked) and OUTER not in c else [c]))]",
      ["tests/benchmarks/test_digits.py", "-k", "come_with_their_flat_twins"],
      "on several hosts the main job's outer rows train flat only: no outer steps across the hosts"),
    M("digits-outer-inner-exchange-not-counted", "benchmarks/main_job/digits_training.py",
      '    kinds["node"] = kinds.get("node", 0.0) + inner["bytes_sent"]\n',
      '    kinds["node"] = kinds.get("node", 0.0)\n',
      ["tests/benchmarks/test_digits.py", "-k", "two_hosts_add_two_tier_rows"],
      "a two-tier outer row's host bytes leave out its inner steps' allreduce in the host (projected as if "
      "the host's replica trained without exchanging)"),
    M("digits-node-link-not-shared", "benchmarks/main_job/digits_report.py",
      "return scaling.predict_step(flat, compute, links.with_workers(workers), per_node=per_node)",
      "return scaling.predict_step(flat, compute, links.with_workers(workers))",
      ["tests/benchmarks/test_digits.py", "-k", "says_when_to_turn_it_on"],
      "--gpus-per-node leaves flat rows projected as if every worker had a link of its own"),
    M("digits-outer-round-bytes-per-step", "benchmarks/main_job/digits_training.py",
      '"bytes_sent": summary["bytes_sent"] / every,',
      '"bytes_sent": summary["bytes_sent"],',
      ["tests/benchmarks/test_digits.py", "-k", "bytes_follow"],
      "an outer row's kB/step is a whole round's: the table and projection charge every step a round's exchange"),
    M("bench-outer-torchft-fragments-not-cut", "benchmarks/outer/outer_training.py",
      "    for run in cut([p.numel() for p in params], count):",
      "    for run in cut([p.numel() for p in params], 1) * count:",
      ["tests/benchmarks/test_clis.py", "-k", "torchft_rows"],
      "torchft's streamed rows hand it the whole model as every fragment (its exchange no smaller than a round's)"),
    M("bench-exchange-cost-without-baselines", "benchmarks/costs/exchange_cost.py",
      '            found += [ddp_row(model, exchange, args) '
      'for exchange in ["dense", *baselines(args.device), *methods]]',
      '            found += [ddp_row(model, exchange, args) for exchange in ["dense", *methods]]',
      ["tests/benchmarks/test_exchange_cost.py", "-k", "beside_its_dense"],
      "issue 57's exchange cost leaves out what users would pick instead (PowerSGD, the bf16 hook)"),
    M("bench-powersgd-stock-on-gloo", "benchmarks/shared/ddp_baselines.py",
      '    if device.startswith("cuda"):\n        return (powerSGD_hook.PowerSGDState(',
      '    if True:\n        return (powerSGD_hook.PowerSGDState(',
      ["tests/benchmarks/test_ddp.py", "-k", "powersgd_baseline"],
      "the benchmarks' PowerSGD on Gloo is PyTorch's hook as it comes (its callbacks can take every Gloo "
      "thread: backward() hangs)"),
    M("bench-exchange-cost-whole-step-uncounted", "benchmarks/costs/exchange_cost.py",
      "    return measured(step, ops, args)\n",
      "    return measured(step, DispatchedOps(), args)\n",
      ["tests/benchmarks/test_exchange_cost.py", "-k", "beside_its_dense"],
      "the FSDP2 and Horovod rows of issue 57's exchange cost count none of the step's operations"),
]


# -- copies of the tree ---------------------------------------------------------------------------
def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def make_source(kind: str, into: Path) -> str:
    """Fill ``into`` with the tree the breaks are applied to; returns a description of it."""
    into.mkdir(parents=True)
    if kind == "head":
        commit = git("rev-parse", "HEAD").strip()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        return f"HEAD {commit}"
    files = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for name in files:
        if not name or not (ROOT / name).is_file():
            continue  # deleted in the working tree, or a submodule
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return f"working tree of {git('rev-parse', 'HEAD').strip()} (uncommitted changes included)"


def patched(text: str, mutation: Mutation) -> str:
    """``text`` with ``mutation`` applied; raises ``ValueError`` naming it when it is stale."""
    count = text.count(mutation.old)
    if count != 1:
        raise ValueError(f"stale mutation {mutation.name}: its text occurs {count} times in {mutation.path} "
                         f"(exactly once expected):\n{mutation.old}")
    return text.replace(mutation.old, mutation.new)


def check_mutations(mutations: Sequence[Mutation], source: Path) -> List[str]:
    """Every problem of the list against ``source``: duplicate names, stale texts, breaks that do
    not compile, unknown test files."""
    problems, seen = [], set()
    for m in mutations:
        if m.name in seen:
            problems.append(f"duplicate mutation name {m.name}")
        seen.add(m.name)
        path = source / m.path
        if not path.is_file():
            problems.append(f"stale mutation {m.name}: {m.path} does not exist")
            continue
        try:
            text = patched(path.read_text(), m)
        except ValueError as error:
            problems.append(str(error))
            continue
        if text == path.read_text():
            problems.append(f"mutation {m.name} changes nothing")
        try:
            if path.suffix == ".toml":
                tomllib.loads(text)
            else:
                compile(text, str(path), "exec")
        except (SyntaxError, tomllib.TOMLDecodeError) as error:
            problems.append(f"mutation {m.name} does not parse: {error}")
        for arg in m.tests:
            if arg.startswith("tests/") and not (source / arg.split("::")[0]).exists():
                problems.append(f"mutation {m.name}: its test {arg} does not exist")
    return problems


def lower_hang_guard(copy: Path, seconds: int) -> None:
    launch = copy / "tests" / "support" / "launch.py"
    text = launch.read_text()
    new, count = re.subn(r"^HANG_TIMEOUT = [0-9.]+$", f"HANG_TIMEOUT = {float(seconds)}", text, flags=re.M)
    if count != 1:
        raise ValueError("tests/support/launch.py no longer defines HANG_TIMEOUT = <seconds> on one line: "
                         "scripts/mutations.py cannot lower the hang guard")
    launch.write_text(new)


def environment() -> Dict[str, str]:
    # COLUMNS: pytest cuts the short summary's messages at the terminal's width.
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONDONTWRITEBYTECODE="1",
               PYTHONUNBUFFERED="1", COLUMNS="400")
    env.pop("PYTHONPATH", None)
    return env


def check_imports(copy: Path) -> str:
    """Where the pytest process and the workers of a copy import ``horovod_sparse`` from; raises
    unless both are the copy's."""
    probe = "import horovod_sparse, sys; print(horovod_sparse.__file__)"
    # A worker: tests/support/launch.py's environment (the copy's root on PYTHONPATH), run from its folder.
    worker = subprocess.run([str(PYTHON), "-c", probe], cwd=copy / "tests" / "workers", capture_output=True,
                            text=True, env=dict(environment(), PYTHONPATH=str(copy)), check=True).stdout.strip()
    # The pytest process: a throwaway test in the copy prints it.
    (copy / "tests" / "test_zz_mutation_probe.py").write_text(
        "import horovod_sparse\n\n\ndef test_probe():\n    print('PROBE', horovod_sparse.__file__)\n")
    result = subprocess.run([str(PYTHON), "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                             "tests/test_zz_mutation_probe.py"], cwd=copy, capture_output=True, text=True,
                            env=environment())
    (copy / "tests" / "test_zz_mutation_probe.py").unlink()
    found = re.search(r"^PROBE (.*)$", result.stdout, flags=re.M)
    tested = found.group(1).strip() if found else f"(probe failed: {result.stdout[-2000:]})"
    for where, path in (("workers", worker), ("pytest", tested)):
        if not Path(path).resolve().is_relative_to(copy.resolve()):
            raise RuntimeError(f"the {where} of a copy import horovod_sparse from {path}, not from the copy {copy}")
    return f"pytest: {tested}; workers: {worker}"


# -- running one break ----------------------------------------------------------------------------
#: A line of pytest's short summary (``-rfE``); node ids may hold spaces (parametrize ids).
FAILURE = re.compile(r"^(FAILED|ERROR) (.+?)(?: - (.*))?$", flags=re.M)


def kill_running_from(copy: Path) -> None:
    """Kill every process whose command line names ``copy``: workers a launcher started in sessions
    of their own (``torchrun``'s, ``horovodrun``'s), which outlive the run's session when a hang
    guard stopped the launcher."""
    marker = str(copy).encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc / "cmdline").read_bytes() and int(proc.name) != os.getpid():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def run_selection(copy: Path, tests: Sequence[str], limit: int) -> Dict[str, object]:
    """Run pytest on ``tests`` in ``copy``: returncode, seconds, the first failing node id and
    its message, whether the limit stopped it, and the tail of the output."""
    command = [str(PYTHON), "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider",
               f"--basetemp={copy / '.pytest_tmp'}", *tests]
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=copy, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timed_out = False
    try:
        output, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(process.pid, signal.SIGKILL)  # the run's own session: pytest, launchers, workers
        output, _ = process.communicate()
    try:  # workers a timed-out launch left behind (the hang guard stops the launcher only)
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    kill_running_from(copy)
    seconds = time.monotonic() - start
    failure = FAILURE.search(output or "")
    return {"returncode": process.returncode, "seconds": round(seconds, 1), "timed_out": timed_out,
            "test": failure.group(2) if failure else None,
            "message": (failure.group(3) or "").strip()[:300] if failure else None,
            "summary": last_line(output or ""), "tail": (output or "")[-4000:]}


def last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def verdict(result: Dict[str, object]) -> str:
    """caught: a test failed (or errored); survived: the selection passed; otherwise why not."""
    if result["timed_out"]:
        return "timeout"
    if result["returncode"] == 0:
        return "survived"
    if result["returncode"] in (1, 2) and result["test"]:  # 2: pytest stopped at a collection error
        return "caught"
    if result["returncode"] == 5:
        return "no-tests"
    return "error"


def run_break(mutation: Optional[Mutation], pristine: Path, work: Path, keep: bool,
              tests: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """Apply ``mutation`` (None: nothing, for the baseline) to a fresh copy of ``pristine`` and run
    its selection there."""
    name = mutation.name if mutation else "baseline"
    copy = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=work))
    shutil.rmtree(copy)
    shutil.copytree(pristine, copy, symlinks=True)
    try:
        limit = TIME_LIMIT
        if mutation is not None:
            target = copy / mutation.path
            target.write_text(patched(target.read_text(), mutation))
            if mutation.hang:
                lower_hang_guard(copy, mutation.hang_timeout)
            tests, limit = mutation.tests, mutation.limit
        assert tests is not None
        return run_selection(copy, tests, limit)
    finally:
        if not keep:
            shutil.rmtree(copy, ignore_errors=True)


# -- the command ----------------------------------------------------------------------------------
def describe(m: Mutation) -> str:
    flags = f" [hang guard {m.hang_timeout}s]" if m.hang else ""
    return f"{m.name}: {m.path}: {m.why}{flags}\n    tests: {' '.join(m.tests)}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these breaks only")
    parser.add_argument("--list", action="store_true", help="list the breaks and their test selections")
    parser.add_argument("--check", action="store_true", help="only check that every break applies and compiles")
    parser.add_argument("--baseline", action="store_true",
                        help="run each selection on the unbroken copy instead: every one must pass")
    parser.add_argument("--jobs", type=int, default=1, help="breaks run at the same time (default 1)")
    parser.add_argument("--results", type=Path, help="write the results as JSON here")
    parser.add_argument("--source", choices=("head", "worktree"), default="head",
                        help="break a copy of HEAD (default) or of the working tree")
    parser.add_argument("--keep", action="store_true", help="keep each break's copy (under the work folder)")
    parser.add_argument("--workdir", type=Path, help="where the copies go (default: a new temporary folder)")
    args = parser.parse_args(argv)

    mutations = MUTATIONS
    if args.only:
        known = {m.name: m for m in MUTATIONS}
        unknown = [name for name in args.only if name not in known]
        if unknown:
            parser.error(f"unknown break(s): {', '.join(unknown)} (see --list)")
        mutations = [known[name] for name in args.only]
    if args.list:
        for m in mutations:
            print(describe(m))
        print(f"{len(mutations)} breaks")
        return 0

    work = Path(tempfile.mkdtemp(prefix="hs-mutations.")) if args.workdir is None else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    pristine = work / "pristine"
    if pristine.exists():
        shutil.rmtree(pristine)
    source = make_source(args.source, pristine)
    problems = check_mutations(MUTATIONS, pristine)
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"{len(problems)} problem(s) in the mutation list of scripts/mutations.py", file=sys.stderr)
        return 2
    print(f"{len(MUTATIONS)} breaks apply to the {source}")
    if args.check:
        return 0
    print("horovod_sparse imported from the copy:", check_imports(pristine))

    start = time.monotonic()
    results: List[Dict[str, object]] = []
    lock = threading.Lock()
    if args.baseline:
        selections = list(dict.fromkeys(m.tests for m in mutations))
        jobs = [(None, tests) for tests in selections]
    else:
        jobs = [(m, None) for m in mutations]

    def one(index: int, mutation: Optional[Mutation], tests: Optional[Tuple[str, ...]]) -> Dict[str, object]:
        result = run_break(mutation, pristine, work, args.keep, tests)
        label = mutation.name if mutation else "baseline " + " ".join(tests or ())
        status = verdict(result)
        if mutation is None:
            status = "passed" if result["returncode"] == 0 else f"FAILED ({status})"
        record = {"name": label, "status": status, "test": result["test"], "message": result["message"],
                  "seconds": result["seconds"], "returncode": result["returncode"], "summary": result["summary"]}
        if mutation is not None:
            record.update(path=mutation.path, why=mutation.why, tests=list(mutation.tests), hang=mutation.hang)
        else:
            record["tests"] = list(tests or ())
        if status not in ("caught", "passed"):
            record["tail"] = result["tail"]
        with lock:
            results.append(record)
            by = f" by {result['test']}" if status == "caught" else ""
            print(f"[{len(results)}/{len(jobs)}] {label}: {status}{by} ({result['seconds']} s)"
                  + ("" if status in ("caught", "passed") else f"\n    {result['summary']}"), flush=True)
        return record

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(one, i, m, t) for i, (m, t) in enumerate(jobs)]
        for future in futures:
            future.result()
    order = {m.name: i for i, m in enumerate(mutations)}
    results.sort(key=lambda r: order.get(str(r["name"]), 0))
    total = time.monotonic() - start

    print()
    width = max(len(str(r["name"])) for r in results) if results else 10
    for r in results:
        print(f"{str(r['name']):{width}}  {str(r['status']):9}  {r['test'] or r['summary']}")
    bad = [r for r in results if r["status"] not in ("caught", "passed")]
    if args.baseline:
        print(f"\nbaseline: {len(results) - len(bad)} of {len(results)} selections passed in {total / 60:.1f} min")
    else:
        caught = sum(r["status"] == "caught" for r in results)
        print(f"\n{caught} of {len(results)} breaks caught in {total / 60:.1f} min"
              + (f"; not caught: {', '.join(str(r['name']) for r in bad)}" if bad else ""))
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "source": source, "baseline": args.baseline, "breaks": len(results),
            "caught": sum(r["status"] == "caught" for r in results), "seconds": round(total, 1),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}, indent=1) + "\n")
        print(f"results: {args.results}")
    if args.workdir is None and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
