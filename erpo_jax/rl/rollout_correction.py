"""Rollout correction: which response tokens the policy-gradient term keeps
when the sampler's log-probs (the PPO anchor in bypass mode, `terms/pg.py`)
are too far from the trainer's. `loss.rollout_correction` names one entry.

An entry decides a keep mask from the first-pass log-ratio:

    keep(cfg, log_ratio, rm) -> bool[N, T-1]    (a subset of rm)

log_ratio: logp - old_logp on response positions, 0 elsewhere, with no
gradient (the mask is a selection, not a weight); rm: the response mask; cfg:
the LossConfig, whose `rollout_correction_low` / `_high` bound the kept
ratios (inclusive). The PG term zeroes the dropped tokens' per-token loss and
keeps them in its denominator, as masked importance sampling does in verl and
TRL, so a kept token's gradient is the uncorrected term's. Only the PG term
reads the mask: Query-KL (prompt positions) and the other terms are
untouched, so Query-KL's exact zeros at response positions hold under every
entry.

A new entry is a `register_rollout_correction(RolloutCorrection(...))` here
or in a user's module imported before the config is checked.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from erpo_jax.rl.registry import Registry


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """One way to mask tokens by their sampler/trainer ratio.

    keep: see the module docstring; None keeps every response token (no
      correction, and no bounds to check).
    doc: one line for the error listing the entries.
    """

    name: str
    keep: Callable[[Any, jax.Array, jax.Array], jax.Array] | None
    doc: str = ""


ROLLOUT_CORRECTIONS: Registry[RolloutCorrection] = Registry("rollout correction")
register_rollout_correction = ROLLOUT_CORRECTIONS.register


def get_rollout_correction(name: str) -> RolloutCorrection:
    return ROLLOUT_CORRECTIONS.get_entry(name, f"rollout_correction is {name!r}")


def keep_mask(cfg, log_ratio: jax.Array, rm: jax.Array) -> jax.Array:
    """bool[N, T-1]: the response tokens `cfg.rollout_correction` keeps."""
    entry = get_rollout_correction(cfg.rollout_correction)
    if entry.keep is None:
        return rm
    return rm & entry.keep(cfg, jax.lax.stop_gradient(jnp.where(rm, log_ratio, 0.0)), rm)


def _bounds(cfg) -> tuple[float, float]:
    return math.log(cfg.rollout_correction_low), math.log(cfg.rollout_correction_high)


def _token_mask(cfg, log_ratio, rm):
    lo, hi = _bounds(cfg)
    return (log_ratio >= lo) & (log_ratio <= hi)


def _sequence_mask(cfg, log_ratio, rm):
    lo, hi = _bounds(cfg)
    n = jnp.maximum(jnp.sum(rm, axis=-1, keepdims=True), 1).astype(jnp.float32)
    mean = jnp.sum(log_ratio, axis=-1, keepdims=True) / n     # log of the geometric-mean ratio
    return jnp.broadcast_to((mean >= lo) & (mean <= hi), log_ratio.shape)


register_rollout_correction(RolloutCorrection(
    "none", None, "no correction: every response token in the PG term"))
register_rollout_correction(RolloutCorrection(
    "token_mask", _token_mask,
    "drop each response token whose ratio is outside [low, high]"))
register_rollout_correction(RolloutCorrection(
    "sequence_mask", _sequence_mask,
    "drop every token of a sequence whose geometric-mean ratio is outside [low, high]"))
