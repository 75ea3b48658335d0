"""The paged decode attention (model/paged_attention.py): the dense path
against jax's own reference for the Pallas kernel and against attention over
the same entries laid out contiguously; sharded against unsharded; and the
Pallas kernel itself compiled for TPU through libtpu."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.model.sharding import Sharding, make_mesh
from erpo_jax.model import paged_attention as pa
from erpo_jax.tools import plan as plan_lib


def _case(seed=0, S=6, H=4, Nk=2, K=16, page_size=8, pages_per_slot=5, pages=40):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(S, H, K)).astype(np.float32)
    kv = rng.normal(size=(pages, page_size, 2 * Nk, K)).astype(np.float32)
    table = rng.permutation(pages)[:S * pages_per_slot].reshape(S, pages_per_slot)
    # Lengths at and around page boundaries, one full table, one empty slot.
    lens = np.array([1, page_size, page_size + 1, 2 * page_size - 1,
                     page_size * pages_per_slot, 0][:S], np.int32)
    return q, kv, table.astype(np.int32), lens


def _contiguous(q, kv, table, lens):
    """softmax(q k^T / sqrt(K)) v over each slot's entries, gathered in
    sequence order, in float64 with numpy."""
    S, H, K = q.shape
    Nk = kv.shape[2] // 2
    out = np.zeros((S, H, K))
    for s in range(S):
        seq = kv[table[s]].reshape(-1, 2 * Nk, K)[:lens[s]].astype(np.float64)
        for h in range(H):
            n = h // (H // Nk)
            z = seq[:, 2 * n] @ q[s, h] / np.sqrt(K)
            if lens[s]:
                p = np.exp(z - z.max())
                out[s, h] = (p / p.sum()) @ seq[:, 2 * n + 1]
    return out


def test_dense_path_is_attention_over_each_slots_entries_and_matches_jax_reference():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel
    q, kv, table, lens = _case()
    got = np.asarray(pa.attend(jnp.asarray(q), jnp.asarray(kv), table, lens, impl="dense"))
    np.testing.assert_allclose(got, _contiguous(q, kv, table, lens), rtol=2e-5, atol=2e-6)
    assert not got[lens == 0].any()          # an empty slot reads nothing
    live = lens > 0
    ref = kernel.ref_ragged_paged_attention(
        jnp.asarray(q[live]), jnp.asarray(kv), jnp.asarray(lens[live]),
        jnp.asarray(table[live]), jnp.arange(live.sum() + 1, dtype=jnp.int32),
        jnp.array([live.sum()], jnp.int32), sm_scale=q.shape[-1] ** -0.5)
    np.testing.assert_allclose(got[live], np.asarray(ref), rtol=2e-5, atol=2e-6)


def test_write_puts_each_slots_key_and_value_at_its_page_and_offset():
    _, kv, _, _ = _case()
    rng = np.random.default_rng(1)
    k, v = (rng.normal(size=(3, 2, 16)).astype(np.float32) for _ in range(2))
    page, offset = np.array([4, 9, kv.shape[0]]), np.array([0, 7, 3])   # the last is dropped
    out = np.asarray(pa.write(jnp.asarray(kv), jnp.asarray(k), jnp.asarray(v), page, offset))
    for s in range(2):
        np.testing.assert_array_equal(out[page[s], offset[s], 0::2], k[s])
        np.testing.assert_array_equal(out[page[s], offset[s], 1::2], v[s])
    changed = np.any(out != kv, axis=(2, 3))
    assert changed.sum() == 2 and changed[4, 0] and changed[9, 7]


@pytest.mark.parametrize("shape", [(8, 1, 1), (4, 1, 2)])
def test_sharded_attention_equals_the_unsharded_with_page_ids_local_to_each_shard(shape):
    """Slots and pages over the data axis (each shard's page table names its
    own pages), heads over the tensor axis where it divides the KV heads."""
    sharding = Sharding(make_mesh(shape))
    dp = sharding.data_size
    S, per = 2 * dp, 12                         # slots, pages per shard
    rng = np.random.default_rng(2)
    q = rng.normal(size=(S, 4, 16)).astype(np.float32)
    kv = rng.normal(size=(dp * per, 8, 4, 16)).astype(np.float32)
    local = np.stack([rng.permutation(per)[:3] for _ in range(S)]).astype(np.int32)
    lens = rng.integers(0, 3 * 8 + 1, size=S).astype(np.int32)
    sharded = jax.jit(lambda *a: pa.attend(*a, sharding=sharding))(q, kv, local, lens)
    glob = local + (np.arange(S) // (S // dp) * per)[:, None]       # the same pages, global ids
    want = pa.attend(jnp.asarray(q), jnp.asarray(kv), glob, lens, impl="dense")
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_an_unknown_implementation_is_named():
    with pytest.raises(ValueError, match="rollout.paged_attention is 'flash'"):
        pa.resolve_impl("flash", None)


@pytest.mark.skipif(plan_lib.libtpu_missing() is not None,
                    reason=str(plan_lib.libtpu_missing()))
@pytest.mark.parametrize("top", ["v5e-8", "v4-8"])
def test_the_pallas_kernel_serves_the_sharded_decode_attention_on_tpu(top):
    """Compiled ahead of time for the topology: 'auto' picks the kernel on a
    TPU mesh, one kernel call per data shard, its blocks given explicitly
    (the kernel's tuned lookup would ask this CPU host)."""
    devices = plan_lib.topology(top).devices()
    sharding = Sharding(make_mesh((len(devices), 1, 1), devices))
    S, pages, page_size, K = 8 * len(devices), 64 * len(devices), 16, 128
    args = (jax.ShapeDtypeStruct((S, 12, K), jnp.bfloat16),
            jax.ShapeDtypeStruct((pages, page_size, 4, K), jnp.bfloat16),
            jax.ShapeDtypeStruct((S, 32), jnp.int32), jax.ShapeDtypeStruct((S,), jnp.int32))
    assert pa.resolve_impl("auto", sharding) == "kernel"
    hlo = jax.jit(lambda *a: pa.attend(*a, sharding=sharding)).lower(*args).compile().as_text()
    calls = [l for l in hlo.splitlines() if "custom-call" in l and "ragged_paged_attention" in l]
    assert len(calls) == 1
    # The per-shard operands: 8 slots' queries and this shard's 64 pages.
    assert "bf16[8,12,128]" in calls[0] and "bf16[64,16,4,128]" in calls[0]
