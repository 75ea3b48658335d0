"""Side-by-side timing of the top-k threshold: lax.top_k (the path truncate_logits
takes off the CPU) against the bit bisection it takes on the CPU, in one run.
Run: .venv/bin/python experiments/profiles/topk_bisection.py"""
import time, jax, jax.numpy as jnp, numpy as np
from erpo_jax.rollout.choice import truncate_logits
for R, V in ((64, 151936), (128, 4096)):
    z = jnp.asarray(np.random.default_rng(0).normal(0, 3, (R, V)).astype(np.float32))
    out = {}
    for plat in ("tpu", "cpu"):   # "tpu": the lax.top_k path, compiled here for the CPU
        f = jax.jit(lambda z, p=plat: truncate_logits(z, 50, 1.0, p))
        f(z).block_until_ready()
        ts = []
        for _ in range(7):
            t = time.perf_counter(); f(z).block_until_ready(); ts.append(time.perf_counter() - t)
        out[plat] = np.median(ts) * 1e3
    print(f"R={R} V={V} top_k=50: lax.top_k {out['tpu']:.1f} ms, bisection {out['cpu']:.1f} ms, ratio {out['cpu']/out['tpu']:.3f}")
