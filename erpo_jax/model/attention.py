"""The attention core, softmax(q k^T / sqrt(K) + bias) v, with its own backward.

Shapes: q [B, T, N, G, K] (G query heads share each of the N kv heads), keys
and values [B, S, N, K] ("bsnk") or, from a KVCache, keys [B, N, K, S]
("bnks") and values [B, N, S, K] ("bnsk"); bias float32 [B, T, S] (0 or
NEG_INF); the output [B, T, N, G, K] in the compute dtype.

Why not plain `jax.nn.softmax` under autodiff. On the short, narrow heads of
RL training (T = S = 64..512, K = 16..128) the score-shaped [B, N, G, T, S]
elementwise work costs more than the matmuls, and autodiff adds to it:
  * forward: the softmax divides every score by its row sum. Here the
    unnormalised exp(s - max) multiplies the values and the [.., T, K]
    result is divided instead (S / K times fewer divisions);
  * backward: autodiff reduces dP * P over S for every score row. The same
    row term equals sum_K(dO * O) (the FlashAttention identity), a reduction
    over K instead of S.
Everything else is as autodiff would do it: the same matmuls, operands in
the compute dtype with float32 accumulation, the exponentials saved in the
compute dtype (what autodiff saves for the probabilities).
On the CPU every dot here takes float32 operands: XLA's CPU backend computes
bfloat16 dots in float32 anyway, and its DotThunk rejects some bfloat16 x
bfloat16 -> float32 products (the backward's at batch 4 x 16 tokens, and
prefill scores against a KVCache's slot-minor keys).
Reverse mode only (`jax.grad`, `jax.vjp`); forward-mode `jax.jvp` through a
`jax.custom_vjp` is not defined. `reference` is the plain version, for tests.

Long sequences. The scores of one row are [N, G, T, S]: at 4096 tokens and
28 heads that is 1.75 GiB in float32, plus the saved exponentials, per row
and layer. `attend_blocked` runs the queries in blocks of `q_block` under
`jax.checkpoint`, so one block's scores exist at a time, forward and
backward (the backward recomputes its block's forward). Each query row's
softmax is its own, so the result is the same function. Off the CPU the
model blocks queries beyond `Q_BLOCK` (`query_block`); on the CPU, where
memory is the host's and the score-shaped work dominates, it does not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

f32 = jnp.float32


# Query positions per block of `attend_blocked` off the CPU (see the module docstring).
Q_BLOCK = 512


def _mm(dtype: str, platform: str | None):
    """The operand dtype of a dot whose inputs are in `dtype` (float32 on the
    CPU). platform: the one compiled for (None: JAX's default backend)."""
    return f32 if (platform or jax.default_backend()) == "cpu" else jnp.dtype(dtype)


def _scores(q, k, ks: str, dt, platform=None):
    scale = q.shape[-1] ** -0.5
    m = _mm(dt, platform)
    return jnp.einsum(f"btngk,{ks}->bngts", q.astype(m), k.astype(m),
                      preferred_element_type=f32) * scale


def _forward(q, k, v, bias, ks, vs, dt, platform):
    s = _scores(q, k, ks, dt, platform) + bias[:, None, None]
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))                # [B, N, G, T, S]
    row = jnp.sum(e, axis=-1)                                           # [B, N, G, T]
    e = e.astype(dt)
    m = _mm(dt, platform)
    o = jnp.einsum(f"bngts,{vs}->btngk", e.astype(m), v.astype(m), preferred_element_type=f32)
    o = (o / row.transpose(0, 3, 1, 2)[..., None]).astype(dt)
    return o, (e, row)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def attend(q, k, v, bias, ks: str = "bsnk", vs: str = "bsnk", dt: str = "float32",
           platform: str | None = None):
    """softmax(q k^T / sqrt(K) + bias) v -> [B, T, N, G, K] in dtype `dt`.

    ks / vs: the key / value layout ("bsnk", or "bnks" / "bnsk" for a cache);
    dt: the compute dtype (the dots' operand dtype off the CPU);
    platform: the one the program is compiled for (default JAX's backend)."""
    return _forward(q, k, v, bias, ks, vs, dt, platform)[0]


def _attend_fwd(q, k, v, bias, ks, vs, dt, platform):
    o, (e, row) = _forward(q, k, v, bias, ks, vs, dt, platform)
    # Not the bias: it gets no gradient, and under a layer scan every saved
    # array is stacked once per layer.
    return o, (q, k, v, o, e, row)


def _attend_bwd(ks, vs, dt, platform, res, do):
    q, k, v, o, e, row = res
    scale = q.shape[-1] ** -0.5
    # dO / row: the probabilities are e / row, so every term below carries it.
    m = _mm(dt, platform)
    dos = do.astype(f32) / row.transpose(0, 3, 1, 2)[..., None]         # [B, T, N, G, K]
    dos_m = dos.astype(dt).astype(m)
    dv = jnp.einsum(f"bngts,btngk->{vs}", e.astype(m), dos_m, preferred_element_type=f32)
    dp = jnp.einsum(f"btngk,{vs}->bngts", dos_m, v.astype(m),
                    preferred_element_type=f32)                         # dP / row
    delta = jnp.sum(dos * o.astype(f32), axis=-1).transpose(0, 2, 3, 1)  # sum_S dP * P / row
    ds = ((e.astype(f32) * (dp - delta[..., None])) * scale).astype(dt).astype(m)
    dq = jnp.einsum(f"bngts,{ks}->btngk", ds, k.astype(m), preferred_element_type=f32)
    dk = jnp.einsum(f"bngts,btngk->{ks}", ds, q.astype(m), preferred_element_type=f32)
    B, _, _, T, S = e.shape
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            jnp.zeros((B, T, S), f32))


attend.defvjp(_attend_fwd, _attend_bwd)


def query_block(T: int, platform: str | None) -> int | None:
    """The query block `attend_blocked` should use for T queries: Q_BLOCK off
    the CPU when T is longer, else None (one block)."""
    cpu = (platform or jax.default_backend()) == "cpu"
    return None if cpu or T <= Q_BLOCK else Q_BLOCK


def attend_blocked(q, k, v, bias, ks: str = "bsnk", vs: str = "bsnk", dt: str = "float32",
                   platform: str | None = None, q_block: int | None = None):
    """`attend` over blocks of `q_block` query positions (None: one block).

    Same arguments and result as `attend`. The blocks run in a `lax.scan`,
    each under `jax.checkpoint`: the forward keeps only the block's inputs,
    and the backward recomputes one block's scores at a time. T need not be
    a multiple of q_block (the last block is padded; its padding rows attend
    to every key and are dropped).
    """
    B, T = q.shape[:2]
    if q_block is None or T <= q_block:
        return attend(q, k, v, bias, ks, vs, dt, platform)
    n = -(-T // q_block)
    pad = n * q_block - T
    qp = jnp.pad(q, ((0, 0), (0, pad)) + ((0, 0),) * (q.ndim - 2))
    bp = jnp.pad(bias, ((0, 0), (0, pad), (0, 0)))
    qs = qp.reshape(B, n, q_block, *q.shape[2:]).swapaxes(0, 1)        # [n, B, Q, N, G, K]
    bs = bp.reshape(B, n, q_block, bias.shape[-1]).swapaxes(0, 1)      # [n, B, Q, S]
    block = jax.checkpoint(lambda qb, bb: attend(qb, k, v, bb, ks, vs, dt, platform),
                           prevent_cse=False)
    _, out = jax.lax.scan(lambda c, x: (c, block(*x)), None, (qs, bs))
    return out.swapaxes(0, 1).reshape(B, n * q_block, *q.shape[2:])[:, :T]


def reference(q, k, v, bias, ks: str = "bsnk", vs: str = "bsnk", dt: str = "float32"):
    """The same function through `jax.nn.softmax` and autodiff (tests compare against it)."""
    m = _mm(dt, None)
    probs = jax.nn.softmax(_scores(q, k, ks, dt) + bias[:, None, None], axis=-1).astype(dt)
    return jnp.einsum(f"bngts,{vs}->btngk", probs.astype(m), v.astype(m),
                      preferred_element_type=f32).astype(dt)
