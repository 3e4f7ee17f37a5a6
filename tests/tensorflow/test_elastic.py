"""Horovod elastic with the TensorFlow front end: refused on every rank, with the reason and the
alternatives (``horovod_sparse/tensorflow/elastic.py``), in a real elastic job."""
from __future__ import annotations

import json

from tests.support.launch import horovodrun_elastic

NP = 2


def test_wrappers_refuse_to_be_built_in_an_elastic_job(tmp_path):
    horovodrun_elastic("tf_elastic.py", tmp_path / "hosts", f"localhost:{NP}\n", min_np=NP, max_np=NP,
                       args=["--out", str(tmp_path)])
    records = [json.loads((tmp_path / f"tf_elastic.rank{r}.json").read_text()) for r in range(NP)]
    assert records[0] == records[1], "every rank refuses with the same error"
    for wrapper, message in records[0].items():
        assert message is not None, f"{wrapper} was built in an elastic job"
        for part in ("does not support Horovod elastic", "HOROVOD_ELASTIC=1", "fixed number of workers",
                     "PyTorch front end (hvd.elastic.TorchState)", "Horovod's own TensorFlow wrappers"):
            assert part in message, f"{wrapper}: {message}"
    assert records[0]["tape_topk"].startswith("DistributedGradientTape: ")
    assert records[0]["keras_micro"].startswith("DistributedSGD: ")
