"""What a policy loss is (the PG term's per-token surrogate), and its registry.

`loss.pg_loss` names one entry; the PG term (`rl/terms/pg.py`) computes the
advantages and the ratio once and asks the entry for the per-token loss. An
entry is one module under `erpo_jax/rl/policy_losses/`:

    fn(inputs, adv, log_ratio, ratio, selected) -> (per-token loss float32[N, T-1], metrics)
    select(inputs, adv, ratio) -> bool[N, T-1]     (optional)

adv: float32[N, T-1] (0 outside response positions); log_ratio: logp -
old_logp on response positions (0 elsewhere); ratio: exp(log_ratio), its
exponent clipped so it cannot overflow. The PG term multiplies the result by
the per-query weights and aggregates it over the response positions, so a
policy loss only decides each response token's surrogate.

A policy loss that singles out tokens by a statistic of the batch (Clip-Cov
and KL-Cov: a covariance centred on the batch's means, a count that is a
share of its tokens, a random draw) has a `select`. Its selection belongs to
the whole mini-batch an optimizer step is taken on, not to the micro-batch
that accumulation happens to cut: the update computes it over the whole
mini-batch before splitting it (`train_step.build_update`, a gradient-free
forward when there are several micro-batches) and hands each micro-batch
its rows of the mask as `selected`. When the loss sees the whole batch
(one micro-batch, `loss_from_stats`, the inspector) `selected` is None and
the PG term calls `select` on what it sees, with `inputs.key`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from erpo_jax.rl.registry import Registry


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """One per-token policy-gradient surrogate.

    fn: see the module docstring.
    select: see the module docstring; None for a per-token surrogate.
    needs_key: its `select` draws (a PRNG key reaches it through `LossInputs.key`).
    check: cfg -> None, raising ValueError naming a LossConfig field, for its
      own settings; called only when `loss.pg_loss` names it.
    doc: one line for `erpo config --show` and the error listing the entries.
    """

    name: str
    fn: Callable[..., tuple[jax.Array, dict]]
    select: Callable[..., jax.Array] | None = None
    needs_key: bool = False
    check: Callable[[Any], None] | None = None
    doc: str = ""


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


def get_policy_loss(name: str) -> PolicyLoss:
    return POLICY_LOSSES.get_entry(name, f"pg_loss is {name!r}")


def ppo_clip_parts(inputs, adv, ratio):
    """(per-token loss, clipped bool[N, T-1], metrics) of the clipped surrogate
    max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), with the dual clip
    (cap c |A| for A < 0) when `loss.dual_clip` is set; `clipped` marks the
    response tokens where the ratio clip is the active branch."""
    cfg, rm = inputs.cfg, inputs.rm
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = jnp.maximum(pg_unclipped, pg_clipped)
    clipped = rm & (pg_clipped > pg_unclipped)
    metrics = {"clip_frac": inputs.tok_mean(clipped.astype(jnp.float32))}
    if cfg.dual_clip is not None:
        cap = -adv * cfg.dual_clip  # = c * |A| for A < 0
        dual = rm & (adv < 0) & (pg > cap)
        pg = jnp.where(adv < 0, jnp.minimum(pg, cap), pg)
        metrics["dual_clip_frac"] = inputs.tok_mean(dual.astype(jnp.float32))
    return pg, clipped, metrics


def token_covariance(inputs, adv):
    """float32[N, T-1]: each response token's centred product
    (A_t - mean A) (logp_t - mean logp), the means over the response tokens
    of the batch `inputs` holds (the whole mini-batch: see `select` above);
    no gradient (it only selects tokens)."""
    sg = jax.lax.stop_gradient
    a, lp = sg(adv), sg(inputs.logp)
    return (a - inputs.tok_mean(a)) * (lp - inputs.tok_mean(lp))


def selected_count(inputs, fraction: float) -> jax.Array:
    """max(floor(fraction * response tokens), 1), as the entropy-mechanism
    paper and verl count the tokens a covariance method touches."""
    n = jnp.sum(inputs.rm).astype(jnp.float32)
    return jnp.maximum(jnp.floor(fraction * n), 1.0)


def first_k(score: jax.Array, k: jax.Array) -> jax.Array:
    """bool mask of the k entries of `score` with the smallest values (ties:
    the lower flat index first); entries at +inf are never chosen."""
    flat = score.reshape(-1)
    rank = jnp.argsort(jnp.argsort(flat, stable=True), stable=True)
    return ((rank < k) & jnp.isfinite(flat)).reshape(score.shape)
