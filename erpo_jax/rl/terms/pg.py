"""The policy-gradient term: each response token's surrogate (`loss.pg_loss`,
see `erpo_jax/rl/policy_losses/`) times its query's weight, aggregated over the
response positions. Always on, coefficient 1.

Bypass mode. The project never recomputes the old policy's log-probs: the
sampler's (`batch.old_logp`) are PPO's anchor, so on the update's first pass
(the first mini-batch of the first epoch, where the policy is the one that
sampled) log r = logp - old_logp is exactly the sampler/trainer mismatch.
The term reports it on every pass as `mismatch/logp_abs_mean` (mean |log r|
over response tokens), `mismatch/ratio_out_frac` (share of response tokens
whose ratio is outside MISMATCH_BAND) and `mismatch/seq_logp_abs_max` (the
largest per-sequence |sum_t log r|); the Trainer logs the step's first
update's values. `loss.rollout_correction` (masked importance sampling, as
verl's and TRL's; the entries are in `rl/rollout_correction.py`) removes
from the term the response tokens ('token_mask') or whole sequences
('sequence_mask': the geometric-mean ratio exp(mean_t log r)) whose ratio is
outside [rollout_correction_low, rollout_correction_high]; a masked token
adds 0 to the term and stays in its denominator (verl's convention), so the
kept tokens' gradients are the uncorrected term's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.rl.kl import LOG_RATIO_LIMIT, kl_estimate
from erpo_jax.rl.policy_losses import get_policy_loss
from erpo_jax.rl.rollout_correction import keep_mask
from erpo_jax.rl.terms.base import Term, register

# The ratio band `mismatch/ratio_out_frac` counts the tokens outside of.
MISMATCH_BAND = (0.9, 1.1)
# How the update combines these metrics over its micro-batches
# (train_step.build_update): a mean over response tokens (weighted by each
# micro-batch's tokens), and a max.
TOKEN_MEAN_METRICS = ("mismatch/logp_abs_mean", "mismatch/ratio_out_frac",
                      "rollout_correction_masked_frac")
MAX_METRICS = ("mismatch/seq_logp_abs_max",)


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


def mismatch_metrics(inputs, log_ratio, ratio) -> dict:
    """The sampler/trainer mismatch of this batch (see the module docstring)."""
    sg, rm = jax.lax.stop_gradient, inputs.rm
    lr = sg(jnp.where(rm, log_ratio, 0.0))
    lo, hi = MISMATCH_BAND
    out = rm & ((sg(ratio) < lo) | (sg(ratio) > hi))
    return {"mismatch/logp_abs_mean": inputs.tok_mean(jnp.abs(lr)),
            "mismatch/ratio_out_frac": inputs.tok_mean(out.astype(jnp.float32)),
            "mismatch/seq_logp_abs_max": jnp.max(jnp.abs(jnp.sum(lr, axis=-1)))}


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
    metrics = {**metrics, **mismatch_metrics(inputs, log_ratio, ratio)}
    if inputs.cfg.rollout_correction != "none":
        # Masked tokens add exactly 0 (and no gradient) but stay in agg's
        # denominator: they count as 0, as in verl.
        keep = keep_mask(inputs.cfg, log_ratio, rm)
        per_token = jnp.where(keep, per_token, 0.0)
        metrics["rollout_correction_masked_frac"] = inputs.tok_mean(
            (rm & ~keep).astype(jnp.float32))
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
