"""Query-KL (QKL): the KL estimator on query positions only, counted once per query.

    QKL(x) = mean over the query positions t of k(logp_ref[t] - logp[t])
    QKL    = mean over the distinct queries of the batch of QKL(x)

`logp` is the policy's temperature-1 log-likelihood of the query tokens
(`TokenLogprobs.logp_t1`), from the same forward pass the PG loss makes;
`logp_ref` is cached once before training, so the reference model never runs
during training.

Gradient flow. The policy log-probs enter this branch as
`where(query_mask, logp, stop_gradient(logp))`, and the per-token values are
masked again after the estimator, so d QKL / d logits is exactly 0.0 at every
response and padding position: QKL reaches the parameters only through the
query likelihood.

Counting. The G responses of one query repeat its query tokens. Rows are
averaged within their `group_id` first, then over groups, so a query weighs
the same whatever its group size: duplicating every response of a group
changes neither the value nor the gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.rl.kl import kl_from_diff

LOSS_ESTIMATORS = ("k2", "k3")


def per_row_query_kl(logp_t1: jax.Array, ref_query_logp: jax.Array, query_mask: jax.Array,
                     estimator: str = "k3", clamp: float | None = None):
    """(row_qkl float32[N], has_query bool[N]): token-mean QKL of each row.

    logp_t1, ref_query_logp: float32[N, T-1]; query_mask: bool[N, T-1].
    Rows without any query target (a one-token query) get 0 and has_query False.
    """
    m = query_mask.astype(bool)
    logp_q = jnp.where(m, logp_t1, jax.lax.stop_gradient(logp_t1)).astype(jnp.float32)
    d = jnp.where(m, ref_query_logp.astype(jnp.float32) - logp_q, 0.0)
    k = jnp.where(m, kl_from_diff(d, estimator, clamp), 0.0)
    count = jnp.sum(m, axis=-1)
    row = jnp.sum(k, axis=-1) / jnp.maximum(count, 1).astype(jnp.float32)
    return row, count > 0


def query_kl(logp_t1: jax.Array, ref_query_logp: jax.Array, query_mask: jax.Array,
             group_id: jax.Array, estimator: str = "k3", clamp: float | None = None) -> jax.Array:
    """float32[]: mean over distinct queries of the per-query token-mean QKL.

    group_id: int32[N] in [0, N), the query of each row. Any estimator may be
    evaluated here ('k1' for monitoring drift); the loss must use k2 or k3
    (see `check_loss_estimator`). Returns 0 when no row has a query target.
    """
    row, has = per_row_query_kl(logp_t1, ref_query_logp, query_mask, estimator, clamp)
    n = row.shape[0]
    w = has.astype(jnp.float32)
    g_sum = jax.ops.segment_sum(row * w, group_id, num_segments=n)
    g_cnt = jax.ops.segment_sum(w, group_id, num_segments=n)
    present = g_cnt > 0
    g_mean = jnp.where(present, g_sum / jnp.maximum(g_cnt, 1.0), 0.0)
    return jnp.sum(g_mean) / jnp.maximum(jnp.sum(present), 1).astype(jnp.float32)


def check_loss_estimator(name: str) -> None:
    """Raise unless `name` may be minimised on query positions."""
    if name == "k1":
        raise ValueError("query_kl_estimator='k1' cannot be a loss: query tokens come from the "
                         "data, so minimising k1 pushes their likelihood down without bound. "
                         "Use 'k3' (default) or 'k2'; k1 is reported as a metric.")
    if name not in LOSS_ESTIMATORS:
        raise ValueError(f"query_kl_estimator is {name!r}; choose one of {LOSS_ESTIMATORS}.")
