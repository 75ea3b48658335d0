"""`loss.pg_loss='kl_cov'`: KL-Cov, from "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models" (Cui et al., 2025).

The unclipped surrogate -A r on every response token, plus
`kl_cov_coef` * |log r| on the max(floor(kl_cov_ratio * response tokens), 1)
tokens with the largest centred product (A - mean A)(log p - mean log p)
(ties: the earlier token), over the response tokens of the (micro-)batch.
There is no ratio clip (eps_low / eps_high are not read; dual_clip is
refused). The paper's values: ratio 2e-3 (Qwen2.5-7B; 2e-4 at 32B), coefficient 1.

|log r| is 0 on the first pass over a rollout (r = 1): the penalty acts from
the second mini-batch or epoch on, as in the paper's off-policy updates.
"""

from __future__ import annotations

import jax.numpy as jnp

from erpo_jax.rl.policy_losses.base import (PolicyLoss, first_k, register_policy_loss,
                                            selected_count, token_covariance)


def kl_cov(inputs, adv, log_ratio, ratio):
    cfg, rm = inputs.cfg, inputs.rm
    cov = token_covariance(inputs, adv)
    chosen = first_k(jnp.where(rm, -cov, jnp.inf), selected_count(inputs, cfg.kl_cov_ratio))
    pg = -adv * ratio + jnp.where(chosen, cfg.kl_cov_coef * jnp.abs(log_ratio), 0.0)
    return pg, {"cov_selected_frac": inputs.tok_mean(chosen.astype(jnp.float32)),
                "cov_mean": inputs.tok_mean(cov)}


def _check(cfg) -> None:
    if not 0 < cfg.kl_cov_ratio <= 1:
        raise ValueError(f"LossConfig.kl_cov_ratio must be in (0, 1], got {cfg.kl_cov_ratio}.")
    if not cfg.kl_cov_coef >= 0:
        raise ValueError(f"LossConfig.kl_cov_coef must be >= 0, got {cfg.kl_cov_coef}.")
    if cfg.dual_clip is not None:
        raise ValueError("LossConfig.dual_clip caps the clipped surrogate, but pg_loss='kl_cov' "
                         "has no ratio clip; set dual_clip to None or use pg_loss='ppo_clip'.")


register_policy_loss(PolicyLoss(
    "kl_cov", kl_cov, check=_check,
    doc="-A r, plus kl_cov_coef |log r| on the kl_cov_ratio of the tokens with the "
        "largest advantage/log-prob covariance"))
