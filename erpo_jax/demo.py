"""The embedded CPU demo: what `erpo demo` (the README's first command) runs."""

from __future__ import annotations

import time


def run_demo(args) -> int:
    import jax
    import jax.numpy as jnp

    from erpo_jax.model import model as model_lib
    from erpo_jax.model.config import PRESETS
    from erpo_jax.model.logprobs import token_logprobs

    cfg = PRESETS["tiny"]
    t0 = time.perf_counter()
    params = model_lib.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, cfg.vocab_size)
    out = jax.jit(lambda p, t: token_logprobs(p, cfg, t, chunk_size=8))(params, tokens)
    out.logp.block_until_ready()
    print(f"erpo-jax on {jax.devices()[0].platform}: a {cfg.num_params():,}-parameter "
          f"{cfg.family}-style model, forward + per-token log-probs of a 4x32 batch in "
          f"{time.perf_counter() - t0:.2f} s (mean log-prob {float(jnp.mean(out.logp)):.3f}, "
          f"mean entropy {float(jnp.mean(out.entropy)):.3f}).")
    print("Coming next in this demo: SFT of a tiny model on the embedded arithmetic task, "
          "then RL three ways (GRPO + Policy-KL, no KL, ERPO) and a summary with plots.")
    return 0
