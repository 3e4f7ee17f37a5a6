"""Worker: Keras ``model.fit`` on scikit-learn's digits through horovod_sparse's Keras optimizer
(the main job's TensorFlow side, ``benchmarks/main_job/digits_tf.py``), for every compressor spec given;
writes each rank's figures and final weights for the test."""
import argparse
import json

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

from benchmarks.main_job.digits_tf import fit
from tests.workers.cli import configs_and_out


def main():
    configs, out = configs_and_out()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for config in configs:
        training = argparse.Namespace(epochs=config["epochs"], batch_size=32, lr=0.02, hidden=64, seeds=[0])
        model, row = fit(config["spec"], training)
        name = f"{config['name']}.rank{hvd.rank()}"
        np.savez(out / f"{name}.npz", **{f"param_{i}": w for i, w in enumerate(model.get_weights())})
        (out / f"{name}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main()
