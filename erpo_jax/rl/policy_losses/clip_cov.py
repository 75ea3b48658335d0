"""`loss.pg_loss='clip_cov'`: Clip-Cov, from "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models" (Cui et al., 2025).

The PPO clipped surrogate, except that a few response tokens with a large
covariance between advantage and log-probability get no gradient at all. A
token is eligible when its centred product (A - mean A)(log p - mean log p)
lies strictly between `clip_cov_lb` and `clip_cov_ub` and the ratio clip is
not already its active branch; max(floor(clip_cov_ratio * response tokens), 1)
of the eligible tokens are drawn uniformly at random (fewer when fewer are
eligible) and their surrogate is set to 0. The means and the count run over
the response tokens of the (micro-)batch the loss sees, as verl computes them
per micro-batch. The paper's values: ratio 2e-4, bounds (1, 5).

The draw uses `LossInputs.key`: in the update, a key from train.seed, the
optimizer step and the micro-batch, so a resumed run draws the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.rl.policy_losses.base import (PolicyLoss, first_k, ppo_clip_parts,
                                            register_policy_loss, selected_count,
                                            token_covariance)


def clip_cov(inputs, adv, log_ratio, ratio):
    cfg, rm = inputs.cfg, inputs.rm
    pg, clipped, metrics = ppo_clip_parts(inputs, adv, ratio)
    cov = token_covariance(inputs, adv)
    eligible = rm & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    draw = jax.random.uniform(inputs.key, cov.shape)
    chosen = first_k(jnp.where(eligible, draw, jnp.inf), selected_count(inputs, cfg.clip_cov_ratio))
    pg = jnp.where(chosen, 0.0, pg)   # no gradient reaches the chosen tokens
    metrics["cov_selected_frac"] = inputs.tok_mean(chosen.astype(jnp.float32))
    metrics["cov_mean"] = inputs.tok_mean(cov)
    return pg, metrics


def _check(cfg) -> None:
    if not 0 < cfg.clip_cov_ratio <= 1:
        raise ValueError(f"LossConfig.clip_cov_ratio must be in (0, 1], got {cfg.clip_cov_ratio}.")
    if not cfg.clip_cov_lb < cfg.clip_cov_ub:
        raise ValueError(f"LossConfig.clip_cov_lb ({cfg.clip_cov_lb}) must be below "
                         f"clip_cov_ub ({cfg.clip_cov_ub}).")


register_policy_loss(PolicyLoss(
    "clip_cov", clip_cov, needs_key=True, check=_check,
    doc="ppo_clip, with a random clip_cov_ratio of the tokens whose advantage/log-prob "
        "covariance is in (clip_cov_lb, clip_cov_ub) detached"))
