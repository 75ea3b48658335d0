"""Multi-host support: environment detection, TPU slice shapes, host-aware meshes,
per-process batch feeding, and a real 2-process run on CPU.

The 2-process test starts this file twice as a script (`--worker`), each with 4
fake CPU devices and the variables tpu_setup/launch.sh exports in explicit
mode, and checks two training steps on a (1, 4, 2) mesh over the 8 global
devices (fsdp split across the processes, tensor inside each) against the same
steps in this 8-device pytest process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from erpo_jax.runtime import distributed as D
from erpo_jax.model import model as M
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding, make_mesh
from workers import kill_workers, wait_for_workers

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8)
BATCH, LENGTH, STEPS, LR = 8, 12, 2, 0.5


# ----------------------------------------------------------------------------- detection


def test_detect_modes():
    assert D.detect({}).mode == "single"
    assert D.detect({"ERPO_MULTIHOST": "1"}).mode == "auto"
    assert D.detect({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}) == D.MultihostEnv(
        "auto", num_processes=4, reason="TPU_WORKER_HOSTNAMES")
    assert D.detect({"TPU_WORKER_HOSTNAMES": "only-one"}).mode == "single"
    assert D.detect({"MEGASCALE_NUM_SLICES": "2"}).num_slices == 2
    env = {"ERPO_MULTIHOST": "1", "JAX_COORDINATOR_ADDRESS": "10.0.0.2:8476",
           "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert D.detect(env) == D.MultihostEnv("explicit", "10.0.0.2:8476", 4, 3,
                                           reason="JAX_COORDINATOR_ADDRESS")
    # ERPO_MULTIHOST=0 wins over everything else.
    assert D.detect({**env, "ERPO_MULTIHOST": "0"}).mode == "single"


@pytest.mark.parametrize("env, words", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1"}, ["JAX_NUM_PROCESSES and JAX_PROCESS_ID are not"]),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, ["JAX_PROCESS_ID is not"]),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     ["JAX_PROCESS_ID=2", "[0, JAX_NUM_PROCESSES=2)"]),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     ["JAX_NUM_PROCESSES='two'"]),
    ({"ERPO_MULTIHOST": "maybe"}, ["ERPO_MULTIHOST='maybe'"]),
])
def test_detect_names_what_is_wrong(env, words):
    with pytest.raises(ValueError) as e:
        D.detect(env)
    for w in words:
        assert w in str(e.value)


def test_single_process_initialize_is_a_noop_and_primary():
    assert D.maybe_initialize({}).mode == "single"
    assert D.maybe_initialize({"ERPO_MULTIHOST": "0"}).mode == "single"
    assert not jax.distributed.is_initialized()
    assert D.is_primary()
    D.clean_shutdown()  # nothing to shut down: must not raise


def test_initialize_after_jax_was_used_says_so():
    jax.devices()  # the backend exists now, as in a trainer that forgot the call order
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "0"}
    with pytest.raises(RuntimeError, match="maybe_initialize"):
        D.maybe_initialize(env, timeout_s=1)
    assert not jax.distributed.is_initialized()


# ----------------------------------------------------------------------------- slices and meshes


@pytest.mark.parametrize("kind, chips, hosts, per_host", [
    ("v4-8", 4, 1, 4), ("v4-16", 8, 2, 4), ("v4-32", 16, 4, 4),
    ("v5litepod-4", 4, 1, 4), ("v5litepod-8", 8, 1, 8), ("v5litepod-16", 16, 4, 4),
    ("v5e-16", 16, 4, 4), ("v5litepod-256", 256, 64, 4),
    ("v5p-8", 4, 1, 4), ("v5p-32", 16, 4, 4),
    ("v6e-8", 8, 1, 8), ("v6e-16", 16, 4, 4), ("v3-8", 4, 1, 8), ("v3-32", 16, 4, 8),
])
def test_abstract_mesh_shape(kind, chips, hosts, per_host):
    s = D.abstract_mesh_shape(kind)
    assert (s.chips, s.hosts, s.devices_per_host) == (chips, hosts, per_host)


@pytest.mark.parametrize("kind", ["v4-4", "v4-12", "v7x-8", "tpu-8", "v5litepod-18", "v4"])
def test_abstract_mesh_shape_rejects(kind):
    with pytest.raises(ValueError, match="accelerator type"):
        D.abstract_mesh_shape(kind)


@pytest.mark.parametrize("kind, axes, shape, hosts", [
    ("v4-8", {}, (1, 4, 1), (1, 1, 1)),
    ("v5litepod-16", {}, (1, 16, 1), (1, 4, 1)),             # fsdp over the whole slice
    ("v5litepod-16", {"tensor": 4}, (1, 4, 4), (1, 4, 1)),   # tensor inside each host
    ("v5litepod-16", {"data": 4, "tensor": 2}, (4, 2, 2), (4, 1, 1)),
    ("v5litepod-16", {"data": 2, "tensor": 2}, (2, 4, 2), (2, 2, 1)),
    ("v5litepod-16", {"data": -1, "fsdp": 2, "tensor": 1}, (8, 2, 1), (4, 1, 1)),
    ("v6e-8", {"data": 2, "fsdp": 2, "tensor": 2}, (2, 2, 2), (1, 1, 1)),
])
def test_plan_mesh(kind, axes, shape, hosts):
    s = D.abstract_mesh_shape(kind)
    plan = D.plan_mesh(s.devices, s.devices_per_host, **axes)
    assert plan.shape == shape and plan.hosts == hosts
    assert tuple(h * p for h, p in zip(plan.hosts, plan.per_host)) == shape
    assert plan.per_host[2] == shape[2]


@pytest.mark.parametrize("axes, words", [
    ({"tensor": 8}, ["tensor=8", "4 devices", "within a host"]),
    ({"data": 3}, ["16 devices are not divisible", "3"]),
    ({"data": 2, "fsdp": 2, "tensor": 2}, ["has 8 devices but the slice has 16"]),
    ({"data": 2, "fsdp": 1, "tensor": 2}, ["has 4 devices"]),
    ({"data": 0}, ["data=0"]),
])
def test_plan_mesh_errors(axes, words):
    with pytest.raises(ValueError) as e:
        D.plan_mesh(16, 4, **axes)
    for w in words:
        assert w in str(e.value)


def test_plan_mesh_refuses_interleaved_hosts():
    # data=6 over 4 hosts of 6 would give a host two non-adjacent batch blocks.
    with pytest.raises(ValueError, match="contiguous block"):
        D.plan_mesh(24, 6, data=6, fsdp=4, tensor=1)


def test_plan_mesh_keeps_slices_on_the_data_axis():
    # Two v5litepod-16 slices: 8 hosts of 4.
    plan = D.plan_mesh(32, 4, data=2, num_slices=2)
    assert plan.shape == (2, 16, 1) and plan.hosts == (2, 4, 1)
    with pytest.raises(ValueError, match="not a multiple of the 2 slices"):
        D.plan_mesh(32, 4, num_slices=2)


def test_mesh_over_hosts_gives_each_host_a_contiguous_batch_block():
    host_of = lambda d: d.id // 4  # pretend the 8 devices are 2 hosts of 4
    for axes in ({"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 8}, {"data": 8},
                 {"data": 1, "fsdp": 4, "tensor": 2}):
        mesh = D.mesh_over_hosts(D.plan_mesh(8, 4, **axes), jax.devices(), host_of)
        assert mesh.axis_names == ("data", "fsdp", "tensor")
        s = NamedSharding(mesh, P(("data", "fsdp")))
        owner = {}
        for dev, idx in s.devices_indices_map((16,)).items():
            for row in range(16)[idx[0]]:
                owner.setdefault(row, set()).add(host_of(dev))
        assert [owner[r] for r in range(16)] == [{0}] * 8 + [{1}] * 8, axes


def test_mesh_for_checks_the_accelerator_type():
    assert D.mesh_for("v6e-8").shape == {"data": 1, "fsdp": 8, "tensor": 1}
    assert D.mesh_for(None, 4, tensor=2).shape == {"data": 1, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="v5litepod-16 has 16 devices but this run sees 8"):
        D.mesh_for("v5litepod-16")


def test_feed_slice_and_global_batch_single_process():
    mesh = D.mesh_for(data=2, fsdp=2, tensor=2)
    s = NamedSharding(mesh, P(("data", "fsdp"), None))
    assert D.feed_slice(s, 8) == D.FeedSlice(0, 8, 0, 1)
    x = np.arange(24, dtype=np.int32).reshape(8, 3)
    got = D.global_batch({"x": x, "y": x[:, 0]}, {"x": s, "y": NamedSharding(mesh, P())}, 8)
    np.testing.assert_array_equal(np.asarray(got["x"]), x)
    assert got["x"].sharding == s
    with pytest.raises(ValueError, match="has 4 rows but it feeds rows \\[0, 8\\)"):
        D.global_batch(x[:4], s, 8)


# ----------------------------------------------------------------------------- the 2-process run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_inputs() -> tuple[np.ndarray, np.ndarray]:
    """tokens int32[B, T] and a left-padded mask int32[B, T], the same in every process."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (BATCH, LENGTH)).astype(np.int32)
    pad = rng.integers(0, 4, BATCH)
    mask = (np.arange(LENGTH)[None, :] >= pad[:, None]).astype(np.int32)
    return tokens, mask


def _nll(params, tokens, mask, sh):
    """Masked mean next-token negative log-likelihood float32[], and the logits."""
    logits, _ = M.forward(params, CFG, tokens, attn_mask=mask, sharding=sh)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    tok = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    m = (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)
    return -(tok * m).sum() / m.sum(), logits


def _train(mesh, put_batch) -> dict[str, np.ndarray]:
    """STEPS plain-SGD steps on the NLL, returning the first step's logits, the
    losses and the final parameters, all gathered to numpy. `put_batch(arrays,
    sharding)` turns the global numpy inputs into sharded jax.Arrays
    (device_put here, per-process feeding in the workers). One jitted function,
    so each process compiles once."""
    sh = Sharding(mesh)
    params = M.init_params(CFG, jax.random.key(0), sh)
    tokens, mask = put_batch(_global_inputs(), sh.named(("batch", "length")))

    def step(p, t, m):
        (loss, logits), g = jax.value_and_grad(_nll, has_aux=True)(p, t, m, sh)
        return jax.tree_util.tree_map(lambda w, gw: w - LR * gw, p, g), loss, logits

    step = jax.jit(step, donate_argnums=0,
                   out_shardings=(M.param_shardings(CFG, sh), sh.replicated(),
                                  sh.named(("batch", "length", "act_vocab"))))
    losses = []
    for i in range(STEPS):
        params, loss, step_logits = step(params, tokens, mask)
        losses.append(loss)
        if i == 0:
            logits = step_logits
    gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
    out = {"logits": gather(logits), "losses": np.stack([gather(x) for x in losses])}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        out["param" + jax.tree_util.keystr(path)] = gather(leaf)
    return out


def _worker(out_dir: str) -> None:
    """One process of the 2-process run; launched by `test_two_processes_match_one`."""
    jax.config.update("jax_default_matmul_precision", "highest")
    env = D.maybe_initialize(timeout_s=60)
    D.maybe_initialize(timeout_s=60)  # idempotent
    mesh = D.mesh_for(None, data=1, fsdp=4, tensor=2)
    feeds = []

    def put_batch(arrays, sharding):
        feed = D.feed_slice(sharding, BATCH)
        feeds.append(feed)
        local = tuple(a[feed.start:feed.stop] for a in arrays)
        return D.global_batch(local, sharding, BATCH)

    result = _train(mesh, put_batch)
    if D.is_primary():
        np.savez(Path(out_dir) / f"result.{jax.process_index()}.npz", **result)
    print(json.dumps({"mode": env.mode, "process_index": jax.process_index(),
                      "process_count": jax.process_count(),
                      "devices": jax.device_count(), "local": jax.local_device_count(),
                      "feed": [feeds[0].start, feeds[0].stop, feeds[0].index, feeds[0].count]}),
          flush=True)
    D.clean_shutdown()


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    port = _free_port()
    drop = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES", "JAX_LOCAL_DEVICE_IDS")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    base.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
                ERPO_MULTIHOST="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES="2", PYTHONUNBUFFERED="1")
    procs, logs = [], []
    try:
        for pid in range(2):
            log = tmp_path / f"worker{pid}.log"
            logs.append(log)
            with open(log, "w") as f:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", str(tmp_path)],
                    env={**base, "JAX_PROCESS_ID": str(pid)}, stdout=f,
                    stderr=subprocess.STDOUT))
        want = _train(make_mesh((1, 4, 2)), jax.device_put)  # meanwhile, the 8-device run
        wait_for_workers(procs, logs, timeout_s=150)
    finally:
        kill_workers(procs)

    reports = [json.loads(log.read_text().strip().splitlines()[-1]) for log in logs]
    for pid, r in enumerate(reports):
        assert r == {"mode": "explicit", "process_index": pid, "process_count": 2,
                     "devices": 8, "local": 4, "feed": [4 * pid, 4 * pid + 4, pid, 2]}
    # Only process 0 wrote its single file.
    assert sorted(p.name for p in tmp_path.glob("result.*")) == ["result.0.npz"]
    with np.load(tmp_path / "result.0.npz") as got:
        assert sorted(got.files) == sorted(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6,
                                       err_msg=name)
    # The steps did something, so matching parameters is not trivially true.
    assert want["losses"][1] < want["losses"][0]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2])
