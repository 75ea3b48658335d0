"""Per-token sample estimators of KL(pi_theta || pi_ref), chosen by name.

Every estimator is a function of `d = logp_ref - logp_theta` (float32, any
shape), evaluated on tokens sampled from (or, for queries, drawn from the data
and scored by) the policy:

  k1(d) = -d                  unbiased, can be negative (monitoring only on queries)
  k2(d) = d**2 / 2            low variance, biased
  k3(d) = exp(d) - d - 1      unbiased, always >= 0 (d clipped to +-20 first)

The same estimators serve Policy-KL (response positions, in the loss or
subtracted from the reward, see `kl_penalized_rewards`) and Query-KL (query
positions, `query_kl.py`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from erpo_jax.rl.advantages import outcome_to_token_rewards

# |log-ratio| beyond which nothing is exponentiated: k3 clips d here, and the
# PG ratio clips logp - old_logp here (`loss.py`). exp(20) = 4.85e8 is finite
# in float32 with room for the sums built on it.
LOG_RATIO_LIMIT = 20.0


def k1(d: jax.Array) -> jax.Array:
    return -d


def k2(d: jax.Array) -> jax.Array:
    return 0.5 * jnp.square(d)


def k3(d: jax.Array) -> jax.Array:
    # The log-ratio is clipped to +-LOG_RATIO_LIMIT before exp (as verl does):
    # exp(d) overflows float32 at d > 88, and a clip *after* exp would then
    # multiply an infinite derivative by 0 (NaN). Beyond the limit the value
    # is k3(+-LOG_RATIO_LIMIT) (k3(20) = 4.85e8) and the gradient is 0.
    d = jnp.clip(d, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    # expm1 keeps the value accurate (and exactly 0 at d == 0) for small |d|.
    return jnp.expm1(d) - d


ESTIMATORS: dict[str, Callable[[jax.Array], jax.Array]] = {"k1": k1, "k2": k2, "k3": k3}


def get_estimator(name: str) -> Callable[[jax.Array], jax.Array]:
    """The estimator called `name` ('k1', 'k2' or 'k3')."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"Unknown KL estimator {name!r}; choose one of {sorted(ESTIMATORS)}.") from None


def kl_from_diff(d: jax.Array, name: str = "k3", clamp: float | None = None) -> jax.Array:
    """Per-token estimate k(d), float32, same shape as `d`.

    clamp: if set, the estimate is clipped to [-clamp, clamp] (k3 and k2 are
      never negative, so only the upper bound acts on them). Beyond the clamp
      the gradient is zero, as with any clip. Independently of it, k3 clips
      its log-ratio to +-LOG_RATIO_LIMIT before exp, so value and gradient
      stay finite at any drift.
    """
    out = get_estimator(name)(jnp.asarray(d, jnp.float32))
    if clamp is not None:
        if clamp <= 0:
            raise ValueError(f"KL clamp must be positive, got {clamp}.")
        out = jnp.clip(out, -clamp, clamp)
    return out


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, name: str = "k3",
                mask: jax.Array | None = None, clamp: float | None = None) -> jax.Array:
    """Per-token k(logp_ref - logp), float32[...]; 0 where `mask` is False.

    Masked-out positions get d = 0 before the estimator, so garbage reference
    values there (e.g. -inf padding) cannot put NaN into the gradient.
    """
    d = ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)
    if mask is not None:
        d = jnp.where(mask, d, 0.0)
    out = kl_from_diff(d, name, clamp)
    if mask is not None:
        out = jnp.where(mask, out, 0.0)
    return out


def kl_penalized_rewards(rewards: jax.Array, logp: jax.Array, ref_logp: jax.Array,
                         response_mask: jax.Array, beta: float, name: str = "k1",
                         clamp: float | None = None, token_level: bool = False) -> jax.Array:
    """Policy-KL in the reward instead of the loss ("kl in reward").

    rewards: float32[N], the outcome reward of each response.
    logp, ref_logp: float32[N, T-1], sampling-policy and reference log-probs.
    response_mask: bool[N, T-1].
    token_level=False: returns float32[N], `r - beta * sum_t k(d[t])` over the
      response (for outcome estimators: GRPO, RLOO, ...).
    token_level=True: returns float32[N, T-1], `-beta * k(d[t])` on every
      response token plus `r` at the last response token (for GAE and
      REINFORCE++ returns); 0 elsewhere.
    The penalty is a constant of the policy (no gradient flows through it).
    """
    m = response_mask.astype(bool)
    k = jax.lax.stop_gradient(kl_estimate(logp, ref_logp, name, m, clamp))
    r = rewards.astype(jnp.float32)
    if not token_level:
        return r - beta * jnp.sum(k, axis=-1)
    return outcome_to_token_rewards(r, m) - beta * k
