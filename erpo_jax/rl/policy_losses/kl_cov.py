"""`loss.pg_loss='kl_cov'`: KL-Cov, from "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models" (Cui et al., 2025).

The unclipped surrogate -A r on every response token, plus
`kl_cov_coef` * |log r| on the max(floor(kl_cov_ratio * response tokens), 1)
tokens with the largest centred product (A - mean A)(log p - mean log p)
(ties: the earlier token), over the response tokens of the whole mini-batch
an optimizer step is taken on, whatever `optim.micro_batches` cuts it into
(base.py, `select`). There is no ratio clip (eps_low / eps_high are not read;
dual_clip is refused). The paper's values: ratio 2e-3 (Qwen2.5-7B; 2e-4 at
32B), coefficient 1.

The first pass. On the first mini-batch of a rollout the policy is the one
that sampled it, so log r is 0, and the penalty must push nowhere (it acts
from the second mini-batch or epoch on, as in the paper's off-policy
updates). verl gets that by recomputing the old log-probs with the actor
and from torch's |x|' = 0 at 0. This project reads the sampler's log-probs
(no extra forward), so log r is 0 only to rounding (about 1e-5 in float32),
and the derivative of |x| just off 0 is +-1: every selected token would get
a push of sign given by rounding noise. So the penalty is 0, with no
gradient, where |log r| <= `kl_cov_tol` (1e-4 by default: rounding, an order
above float32's sampler/trainer mismatch), and kl_cov_coef * |log r| above it.
"""

from __future__ import annotations

import jax.numpy as jnp

from erpo_jax.rl.policy_losses.base import (PolicyLoss, first_k, register_policy_loss,
                                            selected_count, token_covariance)


def select(inputs, adv, ratio):
    cov = token_covariance(inputs, adv)
    return first_k(jnp.where(inputs.rm, -cov, jnp.inf),
                   selected_count(inputs, inputs.cfg.kl_cov_ratio))


def kl_cov(inputs, adv, log_ratio, ratio, selected):
    cfg = inputs.cfg
    size = jnp.abs(log_ratio)
    # where() takes the |log r| branch only outside the rounding band: its
    # gradient there is sign(log r), inside the band exactly 0.
    penalty = jnp.where(selected & (size > cfg.kl_cov_tol), cfg.kl_cov_coef * size, 0.0)
    pg = -adv * ratio + penalty
    return pg, {"cov_selected_frac": inputs.tok_mean(selected.astype(jnp.float32))}


def _check(cfg) -> None:
    if not 0 < cfg.kl_cov_ratio <= 1:
        raise ValueError(f"LossConfig.kl_cov_ratio must be in (0, 1], got {cfg.kl_cov_ratio}.")
    if not cfg.kl_cov_coef >= 0:
        raise ValueError(f"LossConfig.kl_cov_coef must be >= 0, got {cfg.kl_cov_coef}.")
    if not cfg.kl_cov_tol >= 0:
        raise ValueError(f"LossConfig.kl_cov_tol must be >= 0 (the |log r| treated as "
                         f"rounding), got {cfg.kl_cov_tol}.")
    if cfg.dual_clip is not None:
        raise ValueError("LossConfig.dual_clip caps the clipped surrogate, but pg_loss='kl_cov' "
                         "has no ratio clip; set dual_clip to None or use pg_loss='ppo_clip'.")


register_policy_loss(PolicyLoss(
    "kl_cov", kl_cov, select=select, check=_check,
    doc="-A r, plus kl_cov_coef |log r| (0 within kl_cov_tol of 0) on the kl_cov_ratio of "
        "the tokens with the largest advantage/log-prob covariance"))
