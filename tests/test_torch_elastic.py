"""Horovod elastic with the sparse optimizer: one worker removed mid-run (host discovery)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from tests.launch import HANG_TIMEOUT, HOROVODRUN, WORKERS


def test_membership_change_rebuilds_state_and_keeps_replicas_identical(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:3\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=str(WORKERS.parent.parent))
    # --network-interface lo: without it the elastic driver's interface discovery stalls here.
    command = [HOROVODRUN, "--network-interface", "lo", "-np", "3", "--min-np", "2", "--max-np", "3",
               "--host-discovery-script", str(discover), "--gloo", sys.executable,
               str(WORKERS / "torch_elastic.py"), "--hosts-file", str(hosts), "--out", str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    survivors = [json.loads((tmp_path / f"elastic.rank{r}.json").read_text()) for r in range(2)]
    for record in survivors:
        assert record["size"] == 2
        assert record["sizes"][0] == 3 and record["sizes"][-1] == 2
        assert record["state_sizes"] == [2], "sparsifier state must be rebuilt for the new world size"
        assert all(np.isfinite(record["residual_norms"])) and max(record["residual_norms"]) > 0
    for a, b in zip(survivors[0]["params"], survivors[1]["params"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
