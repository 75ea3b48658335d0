"""The advantage estimators' formulas, as pure functions of rewards (and, for
GAE, a critic's values). Choosing one by name, and what the trainer must know
about each, is the registry's (`erpo_jax.rl.estimators`, the only list of
estimators); this module imports nothing from the package.

Outcome estimators take one reward per response, `rewards: float32[B, G]`
(B queries, G responses each; or float32[B*G] with `group_size=G`, rows
grouped query-major), and return `advantages: float32[B, G]`:

  grpo          (r - mean_g r) / (std_g r + eps), std with Bessel's correction
  dr_grpo       r - mean_g r                      (Dr. GRPO: no std division)
  rloo          r - mean of the other G-1 rewards (leave-one-out baseline)
  reinforce     r - mean_g r                      (plain REINFORCE, group-mean baseline)
  reinforce_pp  REINFORCE++, per-response variant (a deviation, see below):
                (r [- mean_g r]) whitened over the batch's responses

REINFORCE++ as its paper, OpenRLHF and verl define it is token-level:
`reinforce_pp_tokens` takes per-token rewards (the outcome at the last
response token, minus any per-token KL penalty), forms the discounted
returns-to-go and whitens them over all response tokens of the batch (masked
mean, unbiased variance). That is the trainer's default
(`algo.reinforce_pp_whiten='token'`). `reinforce_pp` above counts each
response once instead of once per token (`algo.reinforce_pp_whiten='response'`):
longer responses then weigh no more in the mean and variance than short ones.

For every group-baselined estimator a group whose rewards are all equal gets
advantages that are exactly 0.0 (not merely small), and never NaN.

`gae` is the PPO estimator: per token, from per-token rewards and a learned
critic's values (`critic.py`); it returns (advantages, returns), both
float32[N, T-1]. Only estimators registered with `needs_critic=True`
(`estimators.get(name).needs_critic`) create a critic.

All arithmetic is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def as_groups(rewards: jax.Array, group_size: int | None = None) -> jax.Array:
    """float32[B, G] view of rewards given as [B, G], or [B*G] with group_size."""
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim == 2:
        if group_size is not None and group_size != r.shape[1]:
            raise ValueError(f"rewards have shape {r.shape} but group_size={group_size}; "
                             "pass [B, G] rewards or [B*G] rewards with group_size=G.")
        return r
    if r.ndim != 1:
        raise ValueError(f"rewards must be float[B, G] or float[B*G], got shape {r.shape}.")
    if group_size is None:
        raise ValueError("rewards are flat [B*G]; pass group_size=G so groups can be formed.")
    if group_size <= 0 or r.shape[0] % group_size:
        raise ValueError(f"{r.shape[0]} rewards cannot be split into groups of {group_size}.")
    return r.reshape(-1, group_size)


def _centered(r: jax.Array) -> jax.Array:
    """r - group mean, forced to exactly 0 for groups whose rewards are all equal.

    The float mean of G equal numbers need not equal them bit for bit, so the
    subtraction alone can leave ~1e-8 residue (which GRPO's division by a ~0
    std would then blow up).
    """
    c = r - jnp.mean(r, axis=-1, keepdims=True)
    flat = jnp.max(r, axis=-1, keepdims=True) == jnp.min(r, axis=-1, keepdims=True)
    return jnp.where(flat, 0.0, c)


def grpo(rewards, group_size: int | None = None, *, eps: float = 1e-6) -> jax.Array:
    """GRPO: (r - mean) / (std + eps), std unbiased (ddof=1) within each group."""
    r = as_groups(rewards, group_size)
    G = r.shape[1]
    c = _centered(r)
    std = jnp.sqrt(jnp.sum(c * c, axis=-1, keepdims=True) / max(G - 1, 1))
    return c / (std + eps)


def dr_grpo(rewards, group_size: int | None = None) -> jax.Array:
    """Dr. GRPO: r - group mean (no division by the group std)."""
    return _centered(as_groups(rewards, group_size))


def reinforce(rewards, group_size: int | None = None) -> jax.Array:
    """Plain REINFORCE with the group mean as the baseline.

    Numerically identical to `dr_grpo`; kept as its own name because the two
    are different recipes (Dr. GRPO also changes the loss aggregation).
    """
    return _centered(as_groups(rewards, group_size))


def rloo(rewards, group_size: int | None = None) -> jax.Array:
    """RLOO: r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean r)."""
    r = as_groups(rewards, group_size)
    G = r.shape[1]
    if G < 2:
        raise ValueError(f"RLOO needs at least 2 responses per query, got group size {G}.")
    return _centered(r) * (G / (G - 1))


def reinforce_pp(rewards, group_size: int | None = None, *, group_baseline: bool = False,
                 eps: float = 1e-6) -> jax.Array:
    """REINFORCE++: whiten over the whole batch (all B*G responses, each counted once).

    group_baseline=False: (r - mean_batch r) / (std_batch r + eps).
    group_baseline=True: first subtract the group mean, then divide by the
      batch std of the centered rewards (their batch mean is 0 by
      construction, so it is not subtracted again); all-equal groups stay 0.
    std is the population std (ddof=0) over the batch.
    """
    r = as_groups(rewards, group_size)
    if group_baseline:
        c = _centered(r)
    else:
        c = r - jnp.mean(r)
        c = jnp.where(jnp.max(r) == jnp.min(r), 0.0, c)
    std = jnp.sqrt(jnp.mean(c * c))
    return c / (std + eps)


def masked_whiten(x: jax.Array, mask: jax.Array, *, unbiased: bool = True,
                  eps: float = 1e-6) -> jax.Array:
    """(x - mean) / (std + eps) over the entries where `mask` is True; 0 elsewhere.

    unbiased: Bessel's correction in the variance (n - 1). If every masked
    value is equal the result is exactly 0 there (not ~1e-8 / eps).
    """
    m = mask.astype(bool)
    x = x.astype(jnp.float32)
    n = jnp.sum(m).astype(jnp.float32)
    mean = jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(n, 1.0)
    c = jnp.where(m, x - mean, 0.0)
    flat = jnp.max(jnp.where(m, x, -jnp.inf)) == jnp.min(jnp.where(m, x, jnp.inf))
    c = jnp.where(flat, 0.0, c)
    denom = jnp.maximum(n - 1.0, 1.0) if unbiased else jnp.maximum(n, 1.0)
    std = jnp.sqrt(jnp.sum(c * c) / denom)
    return jnp.where(m, c / (std + eps), 0.0)


def returns_to_go(token_rewards: jax.Array, response_mask: jax.Array,
                  gamma: float = 1.0) -> jax.Array:
    """float32[N, T-1]: G_t = r_t + gamma * G_{t+1} over each row's response tokens
    (0 outside them; the recursion skips masked-out positions)."""
    m = response_mask.astype(bool)
    r = jnp.where(m, token_rewards.astype(jnp.float32), 0.0)

    def step(next_g, x):
        r_t, m_t = x
        g = r_t + gamma * next_g
        return jnp.where(m_t, g, next_g), jnp.where(m_t, g, 0.0)

    _, g = jax.lax.scan(step, jnp.zeros(r.shape[0], jnp.float32), (r.T, m.T), reverse=True)
    return g.T


def reinforce_pp_tokens(token_rewards: jax.Array, response_mask: jax.Array, *,
                        gamma: float = 1.0, eps: float = 1e-6) -> jax.Array:
    """REINFORCE++ (token-level, as its paper, OpenRLHF and verl): float32[N, T-1].

    token_rewards: float32[N, T-1] (outcome at the last response token, minus
      any per-token KL penalty) or float32[N] outcome rewards (placed at the
      last response token). Returns the returns-to-go whitened over all
      response tokens of the batch (masked mean, unbiased variance), 0
      outside the mask.
    """
    m = response_mask.astype(bool)
    if token_rewards.ndim == 1:
        token_rewards = outcome_to_token_rewards(token_rewards, m)
    return masked_whiten(returns_to_go(token_rewards, m, gamma), m, unbiased=True, eps=eps)


def gae(token_rewards: jax.Array, values: jax.Array, response_mask: jax.Array, *,
        gamma: float = 1.0, lam: float = 0.95, whiten: bool = False,
        eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over the response tokens of each row.

    token_rewards: float32[N, T-1] per-token rewards (typically the outcome
      reward at the last response token, see `outcome_to_token_rewards`, minus
      any per-token KL penalty), or float32[N] outcome rewards, which are
      placed at each row's last response token.
    values: float32[N, T-1] critic values aligned with token_logprobs:
      values[:, t] is V of the state that predicts tokens[:, t+1].
    response_mask: bool[N, T-1]; response positions must be contiguous in a
      row (the recursion skips everything else and bootstraps 0 after the
      last response token).
    Returns (advantages, returns), float32[N, T-1], 0 outside the mask;
    returns = advantages + values are the critic's targets. whiten=True
    whitens the advantages over all response tokens of the batch (returns are
    computed before whitening).
    """
    m = response_mask.astype(bool)
    v = values.astype(jnp.float32)
    if token_rewards.ndim == 1:
        token_rewards = outcome_to_token_rewards(token_rewards, m)
    r = token_rewards.astype(jnp.float32)
    if r.shape != v.shape or m.shape != v.shape:
        raise ValueError(f"gae: token_rewards {r.shape}, values {v.shape} and response_mask "
                         f"{m.shape} must all be [N, T-1].")

    def step(carry, x):
        next_v, next_a = carry
        r_t, v_t, m_t = x
        delta = r_t + gamma * next_v - v_t
        a_t = delta + gamma * lam * next_a
        carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a))
        return carry, jnp.where(m_t, a_t, 0.0)

    zeros = jnp.zeros(v.shape[0], jnp.float32)
    _, adv = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
    adv = adv.T
    returns = jnp.where(m, adv + v, 0.0)
    if whiten:
        adv = masked_whiten(adv, m, unbiased=False, eps=eps)
    return adv, returns


def outcome_to_token_rewards(rewards: jax.Array, response_mask: jax.Array) -> jax.Array:
    """float32[N, T-1]: each row's outcome reward at its last response token, 0 elsewhere."""
    m = response_mask.astype(bool)
    T = m.shape[-1]
    last = T - 1 - jnp.argmax(m[:, ::-1], axis=-1)
    at_last = (jnp.arange(T)[None, :] == last[:, None]) & m
    return jnp.where(at_last, jnp.asarray(rewards, jnp.float32)[:, None], 0.0)
