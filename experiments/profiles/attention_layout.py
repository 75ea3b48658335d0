"""Token-major against head-major attention operands on the CPU, forward and
backward of attention layers at the `erpo bench --peer` shapes.

Each layer is the model's: q/k/v projections through `dense`, q/k RMSNorm,
RoPE, `attention.attend`, the output projection and the residual. The
token-major version hands `attend` q [B, T, N, G, K] and k/v [B, S, N, K] and
projects the [B, T, H, K] output (the model's path before session 12, and
still its path off the CPU); the head-major one transposes q to
[B, N, G, T, K] and k/v to [B, N, S, K] and projects the head-major output
directly (the model's CPU path). Both are compiled in one process and timed
interleaved; the script prints the median of each round.

    python experiments/profiles/attention_layout.py tiny|small [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.model import attention
from erpo_jax.model.dense import dense
from erpo_jax.model.model import apply_rope, rms_norm

f32 = jnp.float32
# rows, tokens, embed, query heads, kv heads, head_dim: one micro-batch of each peer config.
SHAPES = {"tiny": (32, 64, 64, 4, 2, 16), "small": (32, 192, 256, 8, 4, 32)}
LAYERS = 2


def layers(B, T, D, H, N, K, seed=0):
    rng = np.random.default_rng(seed)
    w = [dict(q=rng.normal(0, .1, (D, H, K)), k=rng.normal(0, .1, (D, N, K)),
              v=rng.normal(0, .1, (D, N, K)), o=rng.normal(0, .1, (H, K, D)),
              qn=np.ones(K), kn=np.ones(K)) for _ in range(LAYERS)]
    w = jax.tree_util.tree_map(lambda a: jnp.asarray(a, f32), w)
    x = jnp.asarray(rng.normal(size=(B, T, D)), f32)
    inv = 1.0 / (10000 ** (jnp.arange(0, K, 2, dtype=f32) / K))
    freqs = jnp.broadcast_to(jnp.arange(T, dtype=f32), (B, T))[..., None] * inv
    freqs = jnp.concatenate([freqs, freqs], -1)
    bias = jnp.where(jnp.tril(jnp.ones((T, T), bool)), 0.0, -1e30)[None].repeat(B, 0).astype(f32)
    return w, x, jnp.cos(freqs), jnp.sin(freqs), bias


def make(head_major: bool, B, T, D, H, N, K, cos, sin, bias):
    G = H // N
    mm = lambda x, w, n=1: dense(x, w, n, platform="cpu")

    def layer(w, x):
        q, k, v = mm(x, w["q"]), mm(x, w["k"]), mm(x, w["v"])
        q, k = rms_norm(q, w["qn"], 1e-6, f32), rms_norm(k, w["kn"], 1e-6, f32)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = q.reshape(B, T, N, G, K)
        if not head_major:
            out = attention.attend(q, k, v, bias, "bsnk", "bsnk", "float32", "cpu")
            return x + mm(out.reshape(B, T, H, K), w["o"], 2)
        out = attention.attend(q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3),
                               v.transpose(0, 2, 1, 3), bias, "bnsk", "bnsk", "float32", "cpu",
                               "bngtk")
        return x + jnp.einsum("bngtk,ngkd->btd", out, w["o"].reshape(N, G, K, D))

    def loss(ws, x):
        for w in ws:
            x = layer(w, x)
        return jnp.sum(x * x)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("size", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    B, T, D, H, N, K = SHAPES[args.size]
    w, x, cos, sin, bias = layers(B, T, D, H, N, K)
    fns = {name: make(hm, B, T, D, H, N, K, cos, sin, bias)
           for name, hm in (("token-major", False), ("head-major", True))}
    out = {name: f(w, x) for name, f in fns.items()}
    a, b = out.values()
    np.testing.assert_allclose(a[1][1], b[1][1], rtol=1e-3, atol=1e-3)   # the same gradient
    calls = 30 if args.size == "tiny" else 4
    times = {name: [] for name in fns}
    for r in range(args.rounds):
        for name, f in (fns.items() if r % 2 == 0 else reversed(fns.items())):
            ts = []
            for _ in range(calls):
                t0 = time.perf_counter()
                jax.block_until_ready(f(w, x))
                ts.append(time.perf_counter() - t0)
            times[name].append(statistics.median(ts) * 1e3)
    print(f"{args.size}: {LAYERS} attention layers, forward + backward, B={B} T={T} D={D} "
          f"H={H} N={N} K={K}; ms, median per round")
    for name, ts in times.items():
        print(f"  {name:12s} median {statistics.median(ts):9.2f}  rounds "
              + " ".join(f"{t:.2f}" for t in ts))


if __name__ == "__main__":
    main()
