"""The policy-gradient term: each response token's surrogate (`loss.pg_loss`,
see `erpo_jax/rl/policy_losses/`) times its query's weight, aggregated over the
response positions. Always on, coefficient 1."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.rl.kl import LOG_RATIO_LIMIT, kl_estimate
from erpo_jax.rl.policy_losses import get_policy_loss
from erpo_jax.rl.terms.base import Term, register


def pg_parts(inputs):
    """(adv, log_ratio, ratio), float32[N, T-1], 0 / 0 / 1 outside the response
    positions: what every policy loss reads."""
    batch, rm = inputs.batch, inputs.rm
    f32 = lambda x: x.astype(jnp.float32)
    adv = f32(batch.advantages)
    adv = adv[:, None] if adv.ndim == 1 else adv
    adv = jnp.where(rm, adv, 0.0)
    log_ratio = jnp.where(rm, inputs.logp - f32(batch.old_logp), 0.0)
    ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # cannot overflow
    return adv, log_ratio, ratio


def selection(inputs):
    """bool[N, T-1] or None: the tokens the policy loss singles out, computed
    on the batch `inputs` holds (`policy_losses.base`: the whole mini-batch)."""
    entry = get_policy_loss(inputs.cfg.pg_loss)
    if entry.select is None:
        return None
    adv, _, ratio = pg_parts(inputs)
    return jax.lax.stop_gradient(entry.select(inputs, adv, ratio))


def pg(inputs):
    batch, rm = inputs.batch, inputs.rm
    f32 = lambda x: x.astype(jnp.float32)
    adv, log_ratio, ratio = pg_parts(inputs)
    selected = inputs.selected if inputs.selected is not None else selection(inputs)
    per_token, metrics = get_policy_loss(inputs.cfg.pg_loss).fn(inputs, adv, log_ratio, ratio,
                                                                selected)
    per_token = per_token * f32(batch.query_weight)[:, None]
    sg = jax.lax.stop_gradient
    any_tok = jnp.any(rm)
    metrics = {
        **metrics,
        "ratio_mean": sg(inputs.tok_mean(ratio)),
        "ratio_min": sg(jnp.where(any_tok, jnp.min(jnp.where(rm, ratio, jnp.inf)), 1.0)),
        "ratio_max": sg(jnp.where(any_tok, jnp.max(jnp.where(rm, ratio, -jnp.inf)), 1.0)),
        "approx_kl_old": sg(inputs.tok_mean(kl_estimate(inputs.logp, batch.old_logp, "k3", rm))),
    }
    return inputs.agg(per_token), metrics


def _check(cfg) -> None:
    entry = get_policy_loss(cfg.pg_loss)
    if entry.check is not None:
        entry.check(cfg)


register(Term("pg", pg, coef=None, normaliser="response", check=_check))
