"""A synthetic RL batch from a model: for tests, the gradient inspector and benchmarks.

Random queries of random lengths (shared by the G rows of a group, as in a
real rollout), random responses of random lengths, rewards in {0, 1} turned
into GRPO advantages, sampling log-probs from the policy with a little noise
(so ratios differ from 1 and some clip), and "reference" log-probs from a
perturbed copy of the parameters (so the KL terms are not zero).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.logprobs import token_logprobs
from erpo_jax.rl import advantages as adv_lib
from erpo_jax.rl.batch import RLBatch, as_jax, group_ids, masks_from_layout
from erpo_jax.rl.weights import query_scores, query_weights


def random_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02):
    """Random policy parameters drawn on the host: normal(0, std) matrices, ones for
    norm scales, zeros for biases (the model's own initialisers).

    Unlike `model.init_params` this compiles nothing (the shapes come from
    `jax.eval_shape`), which keeps tests and the inspector quick; it does not
    place parameters in a sharding.
    """
    rs = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if name.endswith("['scale']"):
            value = np.ones(leaf.shape)
        elif name.endswith("_bias']"):
            value = np.zeros(leaf.shape)
        else:
            value = std * rs.standard_normal(leaf.shape)
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, model_lib.abstract_params(cfg))


def perturb(params, seed: int, scale: float):
    """params + scale * (std(leaf) + 1e-3) * normal noise, leaf by leaf, drawn on the
    host (a stand-in for a reference model near the policy)."""
    rs = np.random.default_rng(seed)

    def noisy(p):
        p = np.asarray(p)
        noise = scale * (p.std() + 1e-3) * rs.standard_normal(p.shape)
        return jnp.asarray(p + noise, p.dtype)

    return jax.tree.map(noisy, params)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logprobs(params, cfg, tokens, attn_mask, temperature):
    # temperature is traced, so the policy and the reference share one compile.
    return token_logprobs(params, cfg, tokens, attn_mask, temperature=temperature,
                          chunk_size=None)


def synthetic_batch(params, cfg: ModelConfig, seed: int = 0, *, num_queries: int = 2,
                    group_size: int = 2, query_width: int = 6, response_width: int = 6,
                    temperature: float = 1.0, ref_params=None, ref_noise: float = 0.5,
                    old_noise: float = 0.3, with_ref_logp: bool = True) -> RLBatch:
    """An RLBatch of N = num_queries * group_size rows and T = query_width + response_width.

    ref_params: the reference; default `perturb(params, ..., ref_noise)`.
    with_ref_logp: fill batch.ref_logp (reference response log-probs at
      `temperature`), needed only for Policy-KL in the loss.
    """
    if query_width < 2 or response_width < 1:
        raise ValueError("synthetic_batch needs query_width >= 2 and response_width >= 1.")
    rs = np.random.default_rng(seed)
    B, G, Q, R = num_queries, group_size, query_width, response_width
    N, T = B * G, Q + R
    tokens = np.zeros((N, T), np.int32)
    attn = np.zeros((N, T), bool)
    for b in range(B):
        qlen = rs.integers(2, Q + 1)
        query = rs.integers(1, cfg.vocab_size, qlen)
        for g in range(G):
            n = b * G + g
            rlen = rs.integers(1, R + 1)
            tokens[n, Q - qlen:Q] = query
            tokens[n, Q:Q + rlen] = rs.integers(1, cfg.vocab_size, rlen)
            attn[n, Q - qlen:Q + rlen] = True
    qmask, rmask = masks_from_layout(attn, Q)

    ref = ref_params if ref_params is not None else perturb(params, seed + 1, ref_noise)
    args = (cfg, jnp.asarray(tokens), jnp.asarray(attn), jnp.float32(temperature))
    pol = np.asarray(_logprobs(params, *args).logp)
    ref_stats = _logprobs(ref, *args)
    ref_logp, ref_t1 = np.asarray(ref_stats.logp), np.asarray(ref_stats.logp_t1)
    old = pol + old_noise * rs.standard_normal((N, T - 1)).astype(np.float32)
    ref_logp = ref_logp if with_ref_logp else None

    rewards = rs.integers(0, 2, (B, G)).astype(np.float32)
    advantages = np.asarray(adv_lib.grpo(rewards)).reshape(N)
    s = query_scores(ref_t1[::G], qmask[::G])
    weights = np.repeat(query_weights(s, "likelihood", tau=1.0, w_min=0.5, w_max=2.0), G)
    return as_jax(RLBatch(
        tokens=tokens, attn_mask=attn, query_mask=qmask, response_mask=rmask,
        old_logp=np.where(rmask, old, 0.0), advantages=advantages,
        ref_query_logp=np.where(qmask, ref_t1, 0.0), query_weight=weights,
        group_id=group_ids(B, G), ref_logp=ref_logp))
