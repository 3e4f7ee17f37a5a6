"""Worker: horovod_sparse's TensorFlow wrappers inside a Horovod elastic job, where they must
refuse to be built (see ``horovod_sparse/tensorflow/elastic.py``) on every rank, each with the
same ``NotImplementedError``. Writes ``tf_elastic.rank{r}.json``: wrapper -> the error message
(None if it was built)."""
import argparse
import json
from pathlib import Path

import horovod.tensorflow as hvd
import tensorflow as tf

import horovod_sparse.tensorflow as hs
import horovod_sparse.tensorflow.keras as hs_keras
from tests.workers.cli import init_tensorflow_worker

WRAPPERS = {
    "tape_topk": lambda: hs.DistributedGradientTape(tf.GradientTape(), compression=hs.Compression.topk(density=0.05)),
    "tape_dense": lambda: hs.DistributedGradientTape(tf.GradientTape(), compression=hvd.Compression.none),
    "keras_micro": lambda: hs_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                        compression=hs.Compression.micro(density=0.05)),
    "keras_dense": lambda: hs.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_tensorflow_worker()
    variables = [tf.Variable(tf.zeros([4]))]

    @hvd.elastic.run
    def build(state: hvd.elastic.TensorFlowState) -> dict:
        errors = {}
        for label, make in WRAPPERS.items():
            try:
                make()
                errors[label] = None
            except NotImplementedError as err:
                errors[label] = str(err)
        return errors

    errors = build(hvd.elastic.TensorFlowState(variables))
    (Path(args.out) / f"tf_elastic.rank{hvd.rank()}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main()
