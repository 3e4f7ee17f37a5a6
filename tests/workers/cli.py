"""The command line every worker takes: ``--configs FILE --out DIR`` (see tests/support/launch.run_configs)."""
import argparse
import json
import os
import runpy
from pathlib import Path
from typing import Any, Dict, List, Tuple


def configs_and_out() -> Tuple[List[Dict[str, Any]], Path]:
    """The list of configs to run, one after another in this launch, and the output directory.
    A config's ``plugin`` (a Python file, such as the example method of docs/adding-a-method.md)
    is run first, once."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    configs = json.loads(Path(args.configs).read_text())
    for plugin in dict.fromkeys(c["plugin"] for c in configs if "plugin" in c):
        runpy.run_path(plugin)
    return configs, Path(args.out)


def write_record(out: Path, name: str, rank: int, arrays: Dict[str, Any], record: Any) -> None:
    """This rank's observations of config ``name``: ``{name}.rank{rank}.npz`` (the arrays) and
    ``{name}.rank{rank}.json`` (the record), as :class:`tests.support.checks.Observed` reads them."""
    import numpy as np

    np.savez(out / f"{name}.rank{rank}.npz", **arrays)
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(record))


def torchrun_main(run: Any) -> None:
    """A ``torchrun`` worker's main: ``run(config, out)`` for every config on a Gloo group of the
    job (one thread per rank), then :func:`horovod_sparse.ddp.exit_job`."""
    import torch
    import torch.distributed as dist

    from horovod_sparse.ddp import exit_job

    configs, out = configs_and_out()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for config in configs:
        run(config, out)
    exit_job()


def init_torch_worker(reproducible_sums: bool = False) -> None:
    """``hvd.init()`` for a PyTorch worker, one thread (several workers share the cores); with
    ``reproducible_sums`` Horovod's tensor fusion is off (a fused buffer's boundaries depend on
    timing and change the order in which a dense allreduce sums)."""
    import horovod.torch as hvd
    import torch

    if reproducible_sums:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"
    hvd.init()
    torch.set_num_threads(1)


def init_tensorflow_worker(process_sets: Any = None) -> None:
    """``hvd.init(process_sets)`` for a TensorFlow worker, with few threads (several workers share
    the cores)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init(process_sets=process_sets)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)


def compression(hvd: Any, hs: Any, name: str) -> Any:
    """Horovod's own ``none`` / ``fp16`` compression from ``hvd``, else the method ``name`` of
    horovod_sparse's front end ``hs`` at density 0.3 (the stock-comparison workers' setting)."""
    if name in ("none", "fp16"):
        return getattr(hvd.Compression, name)
    return hs.Compression.create(name, density=0.3, min_numel=0)
