"""The attention core, softmax(q k^T / sqrt(K) + bias) v, with its own backward.

Shapes: q [B, T, N, G, K] ("btngk"; G query heads share each of the N kv
heads) or head-major [B, N, G, T, K] ("bngtk"); keys and values [B, S, N, K]
("bsnk"), head-major [B, N, S, K] ("bnsk"), or, from a KVCache, keys
[B, N, K, S] ("bnks") and values [B, N, S, K] ("bnsk"); bias float32
[B, T, S] (0 or NEG_INF); the output in q's layout and the compute dtype.

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

Head-major operands. Every product here is batched over (b, n). With q, k
and v in the projections' token-major layouts XLA's CPU backend copies each
operand, and each cotangent, to a head-major one around every dot: copies
of a few hundred KB at ~10-20 ns per element. The model on the CPU hands
over head-major q, k and v instead (one transpose each, after the q/k-norm
and RoPE) and takes the output head-major into its output projection.
Measured on the peer configs of `erpo bench --peer` (both versions of the
update and of the reference forward compiled in one process, timed
interleaved, 2 cores): the small config's update 12.0 -> 10.9 s and its
reference forward 3.80 -> 3.18 s; the tiny one's update 38.7 -> 35.7 ms
(medians of 8 noisy rounds). Transposing the narrow operand for the key and
value gradients as well (as `dense` does for weights) was slower (tiny
update 34.9 -> 37.7 ms).

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


Q_LAYOUTS = ("btngk", "bngtk")
K_LAYOUTS = ("bsnk", "bnsk", "bnks")
V_LAYOUTS = ("bsnk", "bnsk")


def _check_layouts(qs: str, ks: str, vs: str) -> None:
    for name, got, allowed in (("qs", qs, Q_LAYOUTS), ("ks", ks, K_LAYOUTS),
                               ("vs", vs, V_LAYOUTS)):
        if got not in allowed:
            raise ValueError(f"attention: {name}={got!r}; use one of {allowed}.")


def _per_query(x, qs: str):
    """x [B, N, G, T] (one number per query row) aligned to q's layout, with a
    trailing axis of 1 to broadcast over K."""
    return (x if qs == "bngtk" else x.transpose(0, 3, 1, 2))[..., None]


def _scores(q, k, qs: str, ks: str, dt, platform=None):
    scale = q.shape[-1] ** -0.5
    m = _mm(dt, platform)
    return jnp.einsum(f"{qs},{ks}->bngts", q.astype(m), k.astype(m),
                      preferred_element_type=f32) * scale


def _forward(q, k, v, bias, ks, vs, dt, platform, qs):
    s = _scores(q, k, qs, ks, dt, platform) + bias[:, None, None]
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))                # [B, N, G, T, S]
    row = jnp.sum(e, axis=-1)                                           # [B, N, G, T]
    e = e.astype(dt)
    m = _mm(dt, platform)
    o = jnp.einsum(f"bngts,{vs}->{qs}", e.astype(m), v.astype(m), preferred_element_type=f32)
    o = (o / _per_query(row, qs)).astype(dt)
    return o, (e, row)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def attend(q, k, v, bias, ks: str = "bsnk", vs: str = "bsnk", dt: str = "float32",
           platform: str | None = None, qs: str = "btngk"):
    """softmax(q k^T / sqrt(K) + bias) v, in q's layout and dtype `dt`.

    qs / ks / vs: the query / key / value layouts (see the module docstring);
    dt: the compute dtype (the dots' operand dtype off the CPU);
    platform: the one the program is compiled for (default JAX's backend)."""
    _check_layouts(qs, ks, vs)
    return _forward(q, k, v, bias, ks, vs, dt, platform, qs)[0]


def _attend_fwd(q, k, v, bias, ks, vs, dt, platform, qs):
    _check_layouts(qs, ks, vs)
    o, (e, row) = _forward(q, k, v, bias, ks, vs, dt, platform, qs)
    # Not the bias: it gets no gradient, and under a layer scan every saved
    # array is stacked once per layer.
    return o, (q, k, v, o, e, row)


def _attend_bwd(ks, vs, dt, platform, qs, res, do):
    q, k, v, o, e, row = res
    scale = q.shape[-1] ** -0.5
    # dO / row: the probabilities are e / row, so every term below carries it.
    m = _mm(dt, platform)
    dos = do.astype(f32) / _per_query(row, qs)                          # q's layout
    dos_m = dos.astype(dt).astype(m)
    dv = jnp.einsum(f"bngts,{qs}->{vs}", e.astype(m), dos_m, preferred_element_type=f32)
    dp = jnp.einsum(f"{qs},{vs}->bngts", dos_m, v.astype(m),
                    preferred_element_type=f32)                         # dP / row
    delta = jnp.sum(dos * o.astype(f32), axis=-1)                       # sum_S dP * P / row
    if qs == "btngk":
        delta = delta.transpose(0, 2, 3, 1)                             # [B, N, G, T]
    ds = ((e.astype(f32) * (dp - delta[..., None])) * scale).astype(dt).astype(m)
    dq = jnp.einsum(f"bngts,{ks}->{qs}", ds, k.astype(m), preferred_element_type=f32)
    dk = jnp.einsum(f"bngts,{qs}->{ks}", ds, q.astype(m), preferred_element_type=f32)
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
                   platform: str | None = None, q_block: int | None = None,
                   qs: str = "btngk"):
    """`attend` over blocks of `q_block` query positions (None: one block).

    Same arguments and result as `attend`. The blocks run in a `lax.scan`,
    each under `jax.checkpoint`: the forward keeps only the block's inputs,
    and the backward recomputes one block's scores at a time. T need not be
    a multiple of q_block (the last block is padded; its padding rows attend
    to every key and are dropped).
    """
    _check_layouts(qs, ks, vs)
    t_axis = qs.index("t")
    B, T = q.shape[0], q.shape[t_axis]
    if q_block is None or T <= q_block:
        return attend(q, k, v, bias, ks, vs, dt, platform, qs)
    n = -(-T // q_block)
    pad = n * q_block - T
    qt = jnp.moveaxis(q, t_axis, 1)                                     # [B, T, ...]
    qp = jnp.pad(qt, ((0, 0), (0, pad)) + ((0, 0),) * (q.ndim - 2))
    bp = jnp.pad(bias, ((0, 0), (0, pad), (0, 0)))
    qb = qp.reshape(B, n, q_block, *qt.shape[2:]).swapaxes(0, 1)       # [n, B, Q, ...]
    bb = bp.reshape(B, n, q_block, bias.shape[-1]).swapaxes(0, 1)      # [n, B, Q, S]
    block = jax.checkpoint(
        lambda qc, bc: jnp.moveaxis(attend(jnp.moveaxis(qc, 1, t_axis), k, v, bc, ks, vs, dt,
                                           platform, qs), t_axis, 1),
        prevent_cse=False)
    _, out = jax.lax.scan(lambda c, x: (c, block(*x)), None, (qb, bb))
    out = out.swapaxes(0, 1).reshape(B, n * q_block, *qt.shape[2:])[:, :T]
    return jnp.moveaxis(out, 1, t_axis)


def reference(q, k, v, bias, ks: str = "bsnk", vs: str = "bsnk", dt: str = "float32",
              qs: str = "btngk"):
    """The same function through `jax.nn.softmax` and autodiff (tests compare against it)."""
    m = _mm(dt, None)
    probs = jax.nn.softmax(_scores(q, k, qs, ks, dt) + bias[:, None, None], axis=-1).astype(dt)
    return jnp.einsum(f"bngts,{vs}->{qs}", probs.astype(m), v.astype(m),
                      preferred_element_type=f32).astype(dt)
