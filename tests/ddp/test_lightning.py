"""The DDP comm hook through PyTorch Lightning's Trainer, as Lightning documents it: the state is
built before the process group exists (``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``),
and the training equals the same training written out with plain DDP and the hook, bitwise
(tests/workers/lightning_ddp.py, one torchrun job of 2 processes)."""
import json

import pytest

from tests.support.launch import run_configs

NP = 2
CONFIG = {"method": "micro", "options": {"density": 0.1, "min_numel": 0}, "seed": 3, "lr": 0.1}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    run_configs("lightning_ddp.py", NP, out, [CONFIG], backend="torchrun")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(NP)]


def test_lightning_trains_with_the_hook_as_plain_ddp_does(records):
    for record in records:
        assert record["built_before_group"], "the state was built after init_process_group"
        assert record["lightning"] == record["plain"], "Lightning's training differs from plain DDP's"
        assert record["identical"], "the replicas differ"
        lightning, plain = record["union_density"]
        # 96 samples, 2 ranks, batches of 8: 6 steps; DDP's first is dense, the rest sparse at 10%.
        assert lightning == plain and len(lightning) == 6 and lightning[0] == 1.0
        assert all(0.09 < density < 0.11 for density in lightning[1:]), lightning
