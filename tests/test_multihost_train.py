"""Multi-host training on CPU: `erpo train` launched as 2 processes x 4 devices,
with the environment tpu_setup/launch.sh exports (localhost coordinator), must
give the same losses as one process with 8 devices, and only process 0 may
write the run's single files."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from erpo_jax.runtime.distributed import LAUNCH_ENV
from erpo_jax.train.config import load_config
from erpo_jax.train.loop import train
from workers import kill_workers, wait_for_workers

OVERRIDES = ["model.init=random", "model.preset=tiny", "data.n_train=64", "data.n_test=4",
             "rollout.group_size=2", "rollout.max_new_tokens=6", "train.batch_size=8",
             "train.steps=2", "train.eval_every=0", "train.drift_every=1", "train.drift_queries=8",
             "train.progress=false", "loss.beta_query=0.1", "algo.weight_scheme=likelihood",
             "optim.lr=1e-3", "mesh.shape=-1,1,1"]
COMPARED = ("loss", "pg_loss", "query_kl", "query_kl_k3", "grad_norm", "reward_mean",
            "response_len_mean", "drift/qkl_k3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_process_training_matches_one_process(tmp_path):
    multi = tmp_path / "multi"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("TPU_WORKER_HOSTNAMES",
                                                           "MEGASCALE_NUM_SLICES")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1", ERPO_MULTIHOST="1",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2")
    assert {"ERPO_MULTIHOST", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
            "JAX_PROCESS_ID"} <= set(LAUNCH_ENV)
    cmd = [sys.executable, "-m", "erpo_jax.cli", "train", *OVERRIDES,
           f"train.out_dir={multi}", f"train.ref_cache_dir={tmp_path / 'cache-multi'}"]
    procs, logs = [], []
    try:
        for pid in range(2):
            logs.append(tmp_path / f"worker{pid}.log")
            with open(logs[-1], "w") as f:
                procs.append(subprocess.Popen(cmd, env={**env, "JAX_PROCESS_ID": str(pid)},
                                              stdout=f, stderr=subprocess.STDOUT))
        single = tmp_path / "single"  # meanwhile, the same run on one 8-device process
        cfg = load_config(None, [*OVERRIDES, f"train.out_dir={single}",
                                 f"train.ref_cache_dir={tmp_path / 'cache-single'}"])
        assert train(cfg)["status"] == "done"
        wait_for_workers(procs, logs, timeout_s=240)
    finally:
        kill_workers(procs)

    got, want = _rows(multi), _rows(single)
    assert [r["step"] for r in got] == [1, 2]  # one writer: no duplicated rows
    for g, w in zip(got, want):
        for key in COMPARED:
            assert abs(g[key] - w[key]) <= 1e-6, (g["step"], key, g[key], w[key])
    # The single files exist once, written by process 0; checkpoints were saved.
    assert (multi / "config.json").is_file()
    assert len(list((tmp_path / "cache-multi").glob("refpass-*.npz"))) == 2
    assert (multi / "checkpoints" / "2").is_dir()
    assert want[1]["grad_norm"] > 0
