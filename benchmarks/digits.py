"""The main job: train on real data (scikit-learn's digits) with dense Horovod and with sparse
methods side by side, on every worker of a ``horovodrun`` job, and print what each one buys.

    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.digits \
        --compressors none topk:density=0.01 [--framework tensorflow]

Prints, per method: test accuracy, training samples/s (all workers), payload bytes sent per
step per rank (values + indices + metadata) and the density that reached the model.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List

import horovod.torch as hvd
import numpy as np
import torch

import horovod_sparse.torch as hs
from benchmarks.digits_training import DigitsJob
from benchmarks.models import count_parameters


def train(spec: str, args: argparse.Namespace) -> Dict[str, Any]:
    """Train one model with compressor ``spec``; return rank 0's figures."""
    job = DigitsJob(spec, hidden=args.hidden, lr=args.lr, batch_size=args.batch_size, model_seed=args.seed,
                    split_seed=args.seed)
    sent: List[int] = []
    union: List[float] = []
    start = time.perf_counter()
    for _ in job.steps(args.epochs, order_seed=args.seed + hvd.rank()):
        sent.append(job.opt.last_stats.bytes_sent())
        union.append(job.opt.last_stats.union_density)
    elapsed = time.perf_counter() - start
    samples = args.epochs * job.steps_per_epoch * args.batch_size * hvd.size()
    return {"compressor": spec, "accuracy": job.test_accuracy(), "samples_per_s": samples / elapsed,
            "bytes_sent_per_step": float(np.mean(sent)), "union_density": float(np.mean(union)),
            "parameters": count_parameters(job.model), "workers": hvd.size()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compressors", nargs="+", default=["none", "topk:density=0.01"],
                        help="compressor specs, e.g. none topk:density=0.01 (names: "
                             f"{', '.join(hs.Compression.names())})")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.02, help="per worker; scaled by the worker count")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, help="write the table as JSON here (rank 0)")
    parser.add_argument("--framework", choices=("torch", "tensorflow"), default="torch",
                        help="torch: horovod_sparse.torch.DistributedOptimizer; tensorflow: Keras model.fit "
                             "with horovod_sparse.tensorflow.keras.DistributedOptimizer (benchmarks/digits_tf.py)")
    args = parser.parse_args()
    if args.framework == "tensorflow":
        from benchmarks import digits_tf

        rank, size, rows = digits_tf.run(args)
    else:
        hvd.init()
        torch.set_num_threads(1)
        rows = [train(spec, args) for spec in args.compressors]
        rank, size = hvd.rank(), hvd.size()
    if rank != 0:
        return
    framework = " (TensorFlow, Keras model.fit)" if args.framework == "tensorflow" else ""
    print(f"digits MLP ({rows[0]['parameters']} parameters), {size} workers, {args.epochs} epochs{framework}")
    print(f"{'compressor':34s} {'accuracy':>8s} {'samples/s':>10s} {'bytes sent/step':>16s} {'union density':>14s}")
    for row in rows:
        print(f"{row['compressor']:34s} {row['accuracy']:8.4f} {row['samples_per_s']:10.0f} "
              f"{row['bytes_sent_per_step']:16.0f} {row['union_density']:14.5f}")
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
