"""`loss.pg_loss='ppo_clip'` (the default): PPO's clipped surrogate, with
the asymmetric clip [1 - eps_low, 1 + eps_high] (clip-higher is eps_high >
eps_low) and the optional dual clip."""

from __future__ import annotations

from erpo_jax.rl.policy_losses.base import PolicyLoss, ppo_clip_parts, register_policy_loss


def ppo_clip(inputs, adv, log_ratio, ratio, selected=None):
    pg, _, metrics = ppo_clip_parts(inputs, adv, ratio)
    return pg, metrics


register_policy_loss(PolicyLoss(
    "ppo_clip", ppo_clip,
    doc="max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) per token (+ dual_clip)"))
