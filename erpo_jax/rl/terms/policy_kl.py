"""Policy-KL: beta_policy * agg(k(logp_ref - logp)) on the response positions at
the sampling temperature, when `policy_kl_mode='loss'` (in 'reward' mode the
trainer takes it out of the rewards instead, `rl/shaping.py`). Its
coefficient is `beta_policy`, or the adaptive controller's value
(`rl/kl_control.py`) when `kl_target` is set."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.rl.kl import kl_estimate
from erpo_jax.rl.terms.base import Term, register


def _kl(inputs):
    c = inputs.cfg
    return inputs.agg(kl_estimate(inputs.logp, inputs.batch.ref_logp, c.policy_kl_estimator,
                                  inputs.rm, c.kl_clamp))


def policy_kl(inputs):
    value = _kl(inputs)
    return value, {"policy_kl": jax.lax.stop_gradient(value)}


def monitor(inputs):
    """In 'reward' mode the KL the rewards were shaped with is still measured
    (the adaptive controller reads it); with Policy-KL off it is 0."""
    c = inputs.cfg
    if c.beta_policy > 0 and inputs.batch.ref_logp is not None:
        return {"policy_kl": jax.lax.stop_gradient(_kl(inputs))}
    return {"policy_kl": jnp.zeros((), jnp.float32)}


register(Term("policy_kl", policy_kl, coef="beta_policy", normaliser="response",
              needs=("ref_logp",), active=lambda c: c.policy_kl_in_loss, monitor=monitor))
