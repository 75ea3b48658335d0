"""What a loss term is, and the registry the loss, the update and the inspector iterate.

A term is one entry: its name, the LossConfig field of its coefficient, its
sign, what it normalises over, the batch fields it reads, and its function.
`loss.loss_terms` calls every registered term, `loss.loss_from_stats` sums
them, the update splits micro-batches by each term's normaliser, and
`grad_flow` / `erpo inspect-grads` report a row per term: registering a term
(one module under `erpo_jax/rl/terms/`, imported by the package) is all it
takes for each of those to see it.

A term's function gets a `LossInputs` and returns (value, metrics): the
value before its coefficient and sign (a float32[] from `inputs.agg` or its
own reduction) and metrics without gradient. A term must read the policy
statistics only through `where(mask, ...)` of the positions it owns, so its
gradient is exactly 0.0 elsewhere; `tests/test_loss_terms.py` checks that for
every registered term.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from erpo_jax.rl.registry import Registry

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_sum_norm")
# What a term's value is normalised over; the update weighs each micro-batch's
# term by its share of this count (train_step._term_counts).
NORMALISERS = ("response", "query")


def aggregate(x: jax.Array, mask: jax.Array, mode: str, norm_const: float | None = None):
    """float32[] aggregate of per-token x float32[N, T-1] over mask bool[N, T-1].

    token_mean           sum over all masked tokens / their count
    seq_mean_token_mean  mean over rows (with >= 1 masked token) of each row's token mean
    seq_sum_norm         sum over all masked tokens / (N * norm_const)  (Dr. GRPO)
    """
    m = mask.astype(bool)
    x = jnp.where(m, x, 0.0)
    if mode == "token_mean":
        return jnp.sum(x) / jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)
    if mode == "seq_mean_token_mean":
        lens = jnp.sum(m, axis=-1)
        row = jnp.sum(x, axis=-1) / jnp.maximum(lens, 1).astype(jnp.float32)
        return jnp.sum(row) / jnp.maximum(jnp.sum(lens > 0), 1).astype(jnp.float32)
    if mode == "seq_sum_norm":
        return jnp.sum(x) / (x.shape[0] * norm_const)
    raise ValueError(f"Unknown aggregation mode {mode!r}; choose one of {AGG_MODES}.")


class LossInputs(NamedTuple):
    """What every term function reads (float32 statistics, masks as bool).

    logp, entropy: float32[N, T-1] of the policy at the sampling temperature;
    logp_t1: float32[N, T-1] at temperature 1 (Query-KL); batch: the RLBatch;
    cfg: the LossConfig; rm / qm: response / query masks; agg: x -> float32[],
    the configured aggregation over response positions; coef: name -> the
    coefficient in use (a LossConfig field, or a value the update passes in,
    e.g. the adaptive Policy-KL coefficient); key: a PRNG key for terms that
    draw (None where no active piece needs one); selected: bool[N, T-1], the
    tokens the policy loss singles out when they were chosen over a larger
    batch than this one (the update's whole mini-batch, `policy_losses.base`),
    else None.
    """

    logp: jax.Array
    entropy: jax.Array
    logp_t1: jax.Array
    batch: Any
    cfg: Any
    rm: jax.Array
    qm: jax.Array
    agg: Callable[[jax.Array], jax.Array]
    coef: Callable[[str], Any]
    key: jax.Array | None = None
    selected: jax.Array | None = None

    def tok_mean(self, x: jax.Array) -> jax.Array:
        """Mean of x over the response tokens (a monitor: no aggregation mode)."""
        n = jnp.maximum(jnp.sum(self.rm), 1).astype(jnp.float32)
        return jnp.sum(jnp.where(self.rm, x, 0.0)) / n


@dataclasses.dataclass(frozen=True)
class Term:
    """One additive term of the loss.

    name: its key in `loss_terms`' dict, the update's `term_<name>` metric and
      the inspector's row.
    fn: LossInputs -> (value before coefficient and sign, metrics).
    coef: the LossConfig field holding its coefficient; None: always on, with
      coefficient 1 (the PG surrogate).
    sign: +1 for a penalty, -1 for a bonus (the entropy bonus).
    normaliser: 'response' (the configured aggregation's count of response
      tokens or rows) or 'query' (distinct queries).
    needs: RLBatch fields, beyond the ones every batch has, that it reads
      when on (e.g. 'ref_logp'); the loss checks them at trace time.
    active: cfg -> whether it is on (default: its coefficient > 0). An
      inactive term is a constant 0.0 and reads none of its `needs`.
    monitor: LossInputs -> metrics (no gradient) when it is off; None: none.
    check: cfg -> None, raising ValueError naming a LossConfig field, for the
      term's own settings (called by LossConfig.validate).
    """

    name: str
    fn: Callable[[LossInputs], tuple[jax.Array, dict]]
    coef: str | None = None
    sign: float = 1.0
    normaliser: str = "response"
    needs: tuple[str, ...] = ()
    active: Callable[[Any], bool] | None = None
    monitor: Callable[[LossInputs], dict] | None = None
    check: Callable[[Any], None] | None = None

    def __post_init__(self):
        if self.normaliser not in NORMALISERS:
            raise ValueError(f"Term {self.name!r}: normaliser must be one of {NORMALISERS}, "
                             f"got {self.normaliser!r}.")

    def is_on(self, cfg) -> bool:
        if self.active is not None:
            return bool(self.active(cfg))
        return self.coef is None or getattr(cfg, self.coef) > 0


# name -> Term, in registration order (the order of the loss's terms and the
# inspector's rows); 'total' is the inspector's row for their sum.
TERMS: Registry[Term] = Registry("loss term", reserved=("total",))
register = TERMS.register
