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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

f32 = jnp.float32


def _mm(dtype: str):
    """The operand dtype of a dot whose inputs are in `dtype` (float32 on the CPU)."""
    return f32 if jax.default_backend() == "cpu" else jnp.dtype(dtype)


def _scores(q, k, ks: str, dt):
    scale = q.shape[-1] ** -0.5
    return jnp.einsum(f"btngk,{ks}->bngts", q.astype(_mm(dt)), k.astype(_mm(dt)),
                      preferred_element_type=f32) * scale


def _forward(q, k, v, bias, ks, vs, dt):
    s = _scores(q, k, ks, dt) + bias[:, None, None]
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))                # [B, N, G, T, S]
    row = jnp.sum(e, axis=-1)                                           # [B, N, G, T]
    e = e.astype(dt)
    o = jnp.einsum(f"bngts,{vs}->btngk", e.astype(_mm(dt)), v.astype(_mm(dt)),
                   preferred_element_type=f32)
    o = (o / row.transpose(0, 3, 1, 2)[..., None]).astype(dt)
    return o, (e, row)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def attend(q, k, v, bias, ks: str = "bsnk", vs: str = "bsnk", dt: str = "float32"):
    """softmax(q k^T / sqrt(K) + bias) v -> [B, T, N, G, K] in dtype `dt`.

    ks / vs: the key / value layout ("bsnk", or "bnks" / "bnsk" for a cache);
    dt: the compute dtype (the dots' operand dtype off the CPU)."""
    return _forward(q, k, v, bias, ks, vs, dt)[0]


def _attend_fwd(q, k, v, bias, ks, vs, dt):
    o, (e, row) = _forward(q, k, v, bias, ks, vs, dt)
    # Not the bias: it gets no gradient, and under a layer scan every saved
    # array is stacked once per layer.
    return o, (q, k, v, o, e, row)


def _attend_bwd(ks, vs, dt, res, do):
    q, k, v, o, e, row = res
    scale = q.shape[-1] ** -0.5
    # dO / row: the probabilities are e / row, so every term below carries it.
    m = _mm(dt)
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


def reference(q, k, v, bias, ks: str = "bsnk", vs: str = "bsnk", dt: str = "float32"):
    """The same function through `jax.nn.softmax` and autodiff (tests compare against it)."""
    probs = jax.nn.softmax(_scores(q, k, ks, dt) + bias[:, None, None], axis=-1).astype(dt)
    return jnp.einsum(f"bngts,{vs}->btngk", probs.astype(_mm(dt)), v.astype(_mm(dt)),
                      preferred_element_type=f32).astype(dt)
