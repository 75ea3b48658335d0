"""Decode-step attention over a paged KV cache: each slot reads only the pages
its page table names, up to its own length.

One layer's cache is one array `kv_pages[pages, page_size, 2 * Nk, K]`, keys
and values interleaved along the third axis (key head h at 2h, value head h
at 2h + 1): the layout of jax's Pallas TPU kernel
`ragged_paged_attention`, so the TPU path hands it over as it is. Slot s
holds `kv_lens[s]` entries: entry e of its sequence lies in page
`page_table[s, e // page_size]` at offset `e % page_size`. Pages are not
ordered: keys carry their positions in their RoPE rotation, so a slot's
attention does not depend on where its entries lie, only on which.

Two implementations of one function, `attend`:

  kernel  (TPU) the Pallas kernel, run per data shard under `shard_map`:
          it copies a slot's pages [0, ceil(kv_len / page_size)) from HBM
          and nothing else, so a decode step reads the KV the slots hold;
  dense   (CPU, GPU, and the reference) the slots' pages gathered into
          [S, pages_per_slot * page_size] and masked past kv_len, in
          float32 as the continuous engine's CPU decode step. It gathers
          every page a table names, filled or not: fine on a CPU, and the
          TPU path does not use it.

Both compute softmax(q k^T / sqrt(K)) v over entries [0, kv_len) of each
slot, for one query token per slot. A slot with kv_len 0 gets zeros (the
kernel is never called with one: `attend` gives empty slots one entry of
their first page and their output is dropped by the caller).

Sharding: slots, their page tables and the pages lie over the data axes
("rows"), page ids local to each shard; heads over the tensor axis where it
divides the KV heads, else replicated within the shard_map.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from erpo_jax.model.sharding import Sharding, axis_size, platform as platform_of

IMPLS = ("auto", "dense", "kernel")

# The kernel's blocks (its tuned-size lookup asks the local device, which a
# CPU host compiling for TPU is not): KV pages per block, queries per block,
# and the VMEM limit, by TPU generation.
KERNEL_BLOCKS = {"v4": (32, 32, 16 << 20)}
KERNEL_BLOCKS_DEFAULT = (128, 32, 64 << 20)


def interleave(k: jax.Array, v: jax.Array) -> jax.Array:
    """[..., Nk, K] keys and values -> [..., 2 * Nk, K] in the pages' layout."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def write(kv_pages: jax.Array, k: jax.Array, v: jax.Array, page: jax.Array,
          offset: jax.Array) -> jax.Array:
    """kv_pages with slot s's new key and value k, v [S, Nk, K] written at
    (page[s], offset[s]); page out of range (e.g. the page count): dropped."""
    kv = interleave(k, v).astype(kv_pages.dtype)
    return kv_pages.at[page, offset].set(kv, mode="drop")


def dense(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, kv_lens: jax.Array,
          *, sm_scale: float) -> jax.Array:
    """The reference path: q [S, H, K] -> [S, H, K] (q's dtype), in float32."""
    S, H, K = q.shape
    _, ps, two_nk, _ = kv_pages.shape
    Nk = two_nk // 2
    kv = jnp.take(kv_pages, page_table, axis=0)                 # [S, pps, ps, 2Nk, K]
    kv = kv.reshape(S, -1, two_nk, K).astype(jnp.float32)
    k, v = kv[:, :, 0::2], kv[:, :, 1::2]                       # [S, E, Nk, K]
    qg = q.astype(jnp.float32).reshape(S, Nk, H // Nk, K)
    scores = jnp.einsum("sngk,senk->snge", qg, k) * sm_scale
    valid = jnp.arange(k.shape[1])[None, :] < kv_lens[:, None]  # [S, E]
    scores = jnp.where(valid[:, None, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    out = jnp.einsum("snge,senk->sngk", p, v)
    return out.reshape(S, H, K).astype(q.dtype)


def _generation(sharding: Sharding | None) -> str:
    kind = (jax.devices()[0] if sharding is None else sharding.mesh.devices.flat[0]).device_kind
    return "v4" if "v4" in kind.lower() else "other"


def kernel_blocks(sharding: Sharding | None, pages_per_slot: int, slots: int) -> dict:
    """The kernel's block arguments for this target, within its bounds."""
    kv_blk, q_blk, vmem = KERNEL_BLOCKS.get(_generation(sharding), KERNEL_BLOCKS_DEFAULT)
    return dict(num_kv_pages_per_block=min(pages_per_slot, kv_blk),
                num_queries_per_block=min(slots, q_blk), vmem_limit_bytes=vmem)


def _kernel(q, kv_pages, page_table, kv_lens, *, sm_scale, blocks):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    S = q.shape[0]
    # One query token per slot; an empty slot reads one entry of its first page.
    lens = jnp.maximum(kv_lens, 1).astype(jnp.int32)
    cu = jnp.arange(S + 1, dtype=jnp.int32)
    # Mosaic multiplies bfloat16 operands at their own precision only (a
    # process-wide 'highest', as the tests set, would ask fp32 of them).
    precision = "default" if q.dtype == jnp.bfloat16 else None
    with jax.default_matmul_precision(precision):
        out = ragged_paged_attention(q, kv_pages, lens, page_table.astype(jnp.int32), cu,
                                     jnp.array([S], jnp.int32), sm_scale=sm_scale, **blocks)
    return jnp.where((kv_lens > 0)[:, None, None], out, jnp.zeros_like(out))


def resolve_impl(impl: str, sharding: Sharding | None, head_dim: int | None = None) -> str:
    """'kernel' or 'dense' for `impl` on this mesh: 'auto' is the kernel on
    TPU where it serves the head size (a multiple of 128 lanes, as
    Qwen2.5's 128), else the dense path."""
    if impl not in IMPLS:
        raise ValueError(f"rollout.paged_attention is {impl!r}; choose one of "
                         f"{', '.join(map(repr, IMPLS))}.")
    fits = head_dim is None or head_dim % 128 == 0
    if impl == "auto":
        return "kernel" if platform_of(sharding) == "tpu" and fits else "dense"
    if impl == "kernel" and not fits:
        raise ValueError(f"rollout.paged_attention is 'kernel', but the Pallas kernel needs a "
                         f"head size that is a multiple of 128 and this model's is {head_dim}: "
                         "set it to 'auto' or 'dense'.")
    return impl


def attend(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, kv_lens: jax.Array,
           *, sharding: Sharding | None = None, impl: str = "auto") -> jax.Array:
    """One decode step's attention: q [S, H, K] (one token per slot, after
    RoPE), kv_pages [pages, page_size, 2 * Nk, K] (its own key and value
    already written), page_table int32[S, pages_per_slot] (page ids local to
    the slot's data shard), kv_lens int32[S] -> [S, H, K] in q's dtype.
    impl: 'kernel' (TPU), 'dense', or 'auto' (kernel on TPU, else dense)."""
    impl = resolve_impl(impl, sharding, q.shape[-1])
    if sharding is None or sharding.mesh.size == 1:
        return _local(impl, sharding, q.shape[0], page_table.shape[1], q.shape[-1])(
            q, kv_pages, page_table, kv_lens)
    return _sharded(impl, q, kv_pages, page_table, kv_lens, sharding)


def _local(impl: str, sharding: Sharding | None, slots: int, pages_per_slot: int, K: int):
    """The per-shard function of `impl` for `slots` slots."""
    if impl == "kernel":
        return functools.partial(_kernel, sm_scale=K ** -0.5,
                                 blocks=kernel_blocks(sharding, pages_per_slot, slots))
    return functools.partial(dense, sm_scale=K ** -0.5)


def decode(q: jax.Array, k: jax.Array, v: jax.Array, kv_pages: jax.Array,
           page_table: jax.Array, kv_lens: jax.Array, live: jax.Array, *,
           sharding: Sharding | None = None, impl: str = "auto"):
    """One decode step of one layer: each live slot's key and value k, v
    [S, Nk, K] written at entry kv_lens[s] of its sequence, then `attend`
    over its kv_lens[s] + 1 entries. Returns (out [S, H, K], kv_pages).
    A slot that is not live writes nothing (its output is to be dropped)."""
    impl = resolve_impl(impl, sharding, q.shape[-1])
    K = q.shape[-1]

    def local(q, k, v, kv_pages, page_table, kv_lens, live):
        S, ps = q.shape[0], kv_pages.shape[1]
        at = jnp.minimum(kv_lens // ps, page_table.shape[1] - 1)
        page = jnp.take_along_axis(page_table, at[:, None], axis=1)[:, 0]
        page = jnp.where(live, page, kv_pages.shape[0])              # out of range: dropped
        kv_pages = write(kv_pages, k, v, page, kv_lens % ps)
        lens = jnp.where(live, kv_lens + 1, 0)
        out = _local(impl, sharding, S, page_table.shape[1], K)(q, kv_pages, page_table, lens)
        return out, kv_pages

    if sharding is None or sharding.mesh.size == 1:
        return local(q, k, v, kv_pages, page_table, kv_lens, live)
    from jax.sharding import PartitionSpec as P
    rows, heads = shard_axes(sharding, kv_pages.shape[2] // 2)
    qs, ps_ = P(rows, heads, None), P(rows, None, heads, None)
    return jax.shard_map(local, mesh=sharding.mesh,
                         in_specs=(qs, qs, qs, ps_, P(rows, None), P(rows), P(rows)),
                         out_specs=(qs, ps_), check_vma=False)(
        q, k, v, kv_pages, page_table, kv_lens, live)


def shard_axes(sharding: Sharding, Nk: int):
    """The mesh axes of slots (and pages) and of heads inside the shard_map."""
    rows = sharding.spec(("rows",))[0]
    heads = sharding.spec(("act_kv_heads",))[0]
    if Nk % axis_size(sharding.mesh, heads):
        heads = None          # fewer KV heads than tensor shards: heads stay whole per shard
    return rows, heads


def _sharded(impl, q, kv_pages, page_table, kv_lens, sharding: Sharding):
    from jax.sharding import PartitionSpec as P
    mesh = sharding.mesh
    rows, heads = shard_axes(sharding, kv_pages.shape[2] // 2)
    fn = _local(impl, sharding, q.shape[0] // sharding.data_size, page_table.shape[1],
                q.shape[-1])
    specs = (P(rows, heads, None), P(rows, None, heads, None), P(rows, None), P(rows))
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(rows, heads, None),
                         check_vma=False)(q, kv_pages, page_table, kv_lens)
