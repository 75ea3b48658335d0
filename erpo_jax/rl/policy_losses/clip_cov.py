"""`loss.pg_loss='clip_cov'`: Clip-Cov, from "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models" (Cui et al., 2025).

The PPO clipped surrogate, except that a few response tokens with a large
covariance between advantage and log-probability get no gradient at all. A
token is eligible when its centred product (A - mean A)(log p - mean log p)
lies strictly between `clip_cov_lb` and `clip_cov_ub` and the ratio clip is
not already its active branch; max(floor(clip_cov_ratio * response tokens), 1)
of the eligible tokens are drawn uniformly at random (fewer when fewer are
eligible) and their surrogate is set to 0. The means, the count and the draw
are over the response tokens of the whole mini-batch an optimizer step is
taken on, whatever `optim.micro_batches` cuts it into (base.py, `select`);
verl computes them per micro-batch, which makes the algorithm depend on
the memory setting. The paper's values: ratio 2e-4, bounds (1, 5).

The draw uses `LossInputs.key`: in the update, a key from train.seed and
the optimizer step, so a resumed run draws the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.rl.policy_losses.base import (PolicyLoss, first_k, ppo_clip_parts,
                                            register_policy_loss, selected_count,
                                            token_covariance)


def select(inputs, adv, ratio):
    cfg, rm = inputs.cfg, inputs.rm
    _, clipped, _ = ppo_clip_parts(inputs, adv, ratio)
    cov = token_covariance(inputs, adv)
    eligible = rm & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    draw = jax.random.uniform(inputs.key, cov.shape)
    return first_k(jnp.where(eligible, draw, jnp.inf), selected_count(inputs, cfg.clip_cov_ratio))


def clip_cov(inputs, adv, log_ratio, ratio, selected):
    pg, _, metrics = ppo_clip_parts(inputs, adv, ratio)
    pg = jnp.where(selected, 0.0, pg)   # no gradient reaches the chosen tokens
    metrics["cov_selected_frac"] = inputs.tok_mean(selected.astype(jnp.float32))
    return pg, metrics


def _check(cfg) -> None:
    if not 0 < cfg.clip_cov_ratio <= 1:
        raise ValueError(f"LossConfig.clip_cov_ratio must be in (0, 1], got {cfg.clip_cov_ratio}.")
    if not cfg.clip_cov_lb < cfg.clip_cov_ub:
        raise ValueError(f"LossConfig.clip_cov_lb ({cfg.clip_cov_lb}) must be below "
                         f"LossConfig.clip_cov_ub ({cfg.clip_cov_ub}): the covariance band "
                         "Clip-Cov draws from is empty.")


register_policy_loss(PolicyLoss(
    "clip_cov", clip_cov, select=select, needs_key=True, check=_check,
    doc="ppo_clip, with a random clip_cov_ratio of the tokens whose advantage/log-prob "
        "covariance is in (clip_cov_lb, clip_cov_ub) detached"))
