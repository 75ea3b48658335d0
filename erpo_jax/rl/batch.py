"""The RL training batch: one pytree with documented shapes, and its host-side checks.

Layout. N = B * G rows (B queries, G responses each, rows query-major: row
n belongs to query n // G unless `group_id` says otherwise). Each row of
`tokens` is the query left-padded to a fixed width Q, then the response,
right-padded to the full length T:

    [pad pad x1 x2 x3 | y1 y2 y3 y4 pad pad]

All per-token arrays have T-1 columns, aligned with `token_logprobs`: column
t is the prediction of tokens[:, t+1]. Query positions are the targets
x2..xm (x1 has no prediction); response positions are y1..yn.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class RLBatch(NamedTuple):
    """One policy-gradient batch (a pytree; every field is an array or None).

    tokens: int32[N, T]       left-padded query + response + right padding.
    attn_mask: bool[N, T]     True for real tokens.
    query_mask: bool[N, T-1]  target positions that are query tokens (x2..xm).
    response_mask: bool[N, T-1]  target positions that are response tokens.
    old_logp: float32[N, T-1] sampling-policy log-probs of the response tokens
                              (at the sampling temperature); read only under
                              response_mask.
    advantages: float32[N] (one per response) or float32[N, T-1] (per token).
    ref_query_logp: float32[N, T-1]  cached reference log-probs at temperature
                              1, read only under query_mask (dataset-static).
    query_weight: float32[N]  the per-query weight of each row's query.
    group_id: int32[N]        index in [0, N) of each row's query; rows of one
                              query share it (Query-KL is counted once per id).
    ref_logp: float32[N, T-1] or None  reference log-probs of the response
                              tokens at the sampling temperature; needed only
                              when Policy-KL is in the loss (beta_policy > 0).
    """

    tokens: jax.Array
    attn_mask: jax.Array
    query_mask: jax.Array
    response_mask: jax.Array
    old_logp: jax.Array
    advantages: jax.Array
    ref_query_logp: jax.Array
    query_weight: jax.Array
    group_id: jax.Array
    ref_logp: jax.Array | None = None


def group_ids(num_queries: int, group_size: int) -> np.ndarray:
    """int32[B*G]: query index of each row for query-major rows."""
    return np.repeat(np.arange(num_queries, dtype=np.int32), group_size)


def masks_from_layout(attn_mask, query_width: int):
    """(query_mask, response_mask), bool[N, T-1], for the layout above.

    attn_mask: bool[N, T]; query_width: Q, the padded query width (the
    response starts at column Q). A target t is a query position when
    tokens t and t+1 are both real query tokens, a response position when
    token t+1 is a real response token.
    """
    m = np.asarray(attn_mask).astype(bool)
    T = m.shape[1]
    col = np.arange(1, T)[None, :]  # column of the target token
    query = m[:, :-1] & m[:, 1:] & (col < query_width)
    response = m[:, 1:] & (col >= query_width)
    return query, response


def validate_batch(batch: RLBatch, *, needs_ref_logp: bool = False,
                   response_width: int | None = None, group_size: int = 1,
                   allow_empty: bool = False) -> None:
    """Check a batch on the host (numpy values) before it enters the jitted loss.

    Raises ValueError with a sentence naming the field on: mismatched shapes
    or dtypes, query and response masks that overlap, masks that point at
    padding, a batch without any response token, a missing `ref_logp` when
    `needs_ref_logp`, non-finite values where they are read, group ids out of
    range; with `response_width` N, a query target in the last N columns or a
    response target before them (the layout an update built with
    `response_width` relies on); with `group_size` G > 1 (and
    `response_width`), rows that are not consecutive groups of G repeating
    one query (the same tokens and mask before the response columns, what
    an update that runs each group's query once relies on). allow_empty: a
    batch without response tokens passes (a dynamic-sampling step padded
    with flat groups only, whose update is skipped). The jitted loss
    only checks shapes (values are unknown at trace time) and is written to
    stay NaN-free on whatever passes here.
    """
    tokens = np.asarray(batch.tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"RLBatch.tokens must be int[N, T] with T >= 2, got shape {tokens.shape}.")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"RLBatch.tokens must be integer token ids, got dtype {tokens.dtype}.")
    N, T = tokens.shape
    expect = {
        "attn_mask": (N, T), "query_mask": (N, T - 1), "response_mask": (N, T - 1),
        "old_logp": (N, T - 1), "ref_query_logp": (N, T - 1), "query_weight": (N,),
        "group_id": (N,),
    }
    if batch.ref_logp is not None:
        expect["ref_logp"] = (N, T - 1)
    for name, shape in expect.items():
        got = np.shape(getattr(batch, name))
        if got != shape:
            raise ValueError(f"RLBatch.{name} has shape {got}, expected {shape} for tokens of "
                             f"shape {(N, T)} (per-token fields have T-1 columns).")
    adv_shape = np.shape(batch.advantages)
    if adv_shape not in ((N,), (N, T - 1)):
        raise ValueError(f"RLBatch.advantages has shape {adv_shape}; expected {(N,)} (one per "
                         f"response) or {(N, T - 1)} (per token).")
    if needs_ref_logp and batch.ref_logp is None:
        raise ValueError("RLBatch.ref_logp is None but the loss has Policy-KL on "
                         "(beta_policy > 0): pass reference log-probs of the response tokens.")

    attn = np.asarray(batch.attn_mask).astype(bool)
    q = np.asarray(batch.query_mask)
    r = np.asarray(batch.response_mask)
    for name, m in (("query_mask", q), ("response_mask", r)):
        if m.dtype != bool:
            raise ValueError(f"RLBatch.{name} must be bool, got dtype {m.dtype}.")
    if np.any(q & r):
        n, t = np.argwhere(q & r)[0]
        raise ValueError(f"RLBatch.query_mask and response_mask overlap (first at row {n}, "
                         f"position {t}); a target token is either query or response.")
    real = attn[:, :-1] & attn[:, 1:]
    for name, m in (("query_mask", q), ("response_mask", r)):
        if np.any(m & ~real):
            n, t = np.argwhere(m & ~real)[0]
            raise ValueError(f"RLBatch.{name} marks row {n}, position {t}, whose source or "
                             "target token is padding (attn_mask is 0 there).")
    if response_width is not None:
        split = T - 1 - response_width
        if split < 0:
            raise ValueError(f"RLBatch.tokens has T={T} columns, fewer than the "
                             f"{response_width} response slots plus one.")
        for name, bad, first in (("query_mask", q[:, split:], split),
                                 ("response_mask", r[:, :split], 0)):
            if bad.any():
                n, t = np.argwhere(bad)[0]
                t = t + first
                raise ValueError(f"RLBatch.{name} marks row {n}, position {t}, on the wrong side "
                                 f"of the query/response boundary at column {split} (the last "
                                 f"{response_width} columns are the response): the batch does "
                                 "not have the rollout layout this update was built for.")
    if group_size > 1:
        if response_width is None:
            raise ValueError("validate_batch: group_size > 1 needs response_width (the query "
                             "is the columns before the response).")
        check_groups(tokens, attn, group_size, T - response_width)
    if not r.any() and not allow_empty:
        raise ValueError("RLBatch.response_mask has no response tokens; there is nothing to "
                         "train on (drop this batch).")

    def check_finite(name, values, mask):
        v = np.asarray(values)
        if mask is not None:
            v = v[np.broadcast_to(mask, v.shape)] if v.ndim == 2 else v
        if not np.all(np.isfinite(v)):
            raise ValueError(f"RLBatch.{name} has non-finite values where the loss reads it.")

    check_finite("old_logp", batch.old_logp, r)
    check_finite("ref_query_logp", batch.ref_query_logp, q)
    check_finite("advantages", batch.advantages, r if len(adv_shape) == 2 else None)
    check_finite("query_weight", batch.query_weight, None)
    if batch.ref_logp is not None and needs_ref_logp:
        check_finite("ref_logp", batch.ref_logp, r)
    if np.any(np.asarray(batch.query_weight) < 0):
        raise ValueError("RLBatch.query_weight has negative entries; weights must be >= 0.")
    gid = np.asarray(batch.group_id)
    if not np.issubdtype(gid.dtype, np.integer) or gid.min() < 0 or gid.max() >= N:
        raise ValueError(f"RLBatch.group_id must be integers in [0, {N}), got range "
                         f"[{gid.min()}, {gid.max()}] with dtype {gid.dtype}.")


def check_groups(tokens, attn_mask, group_size: int, query_width: int) -> None:
    """Raise ValueError unless the rows are consecutive groups of `group_size`
    whose rows have the same first `query_width` columns of tokens and
    attn_mask (one query, repeated for its G responses)."""
    tokens, attn = np.asarray(tokens), np.asarray(attn_mask).astype(bool)
    N, G = tokens.shape[0], int(group_size)
    if N % G:
        raise ValueError(f"RLBatch has {N} rows, not whole groups of {G} responses per query.")
    for name, a in (("tokens", tokens), ("attn_mask", attn)):
        q = a[:, :query_width].reshape(N // G, G, query_width)
        diff = np.any(q != q[:, :1], axis=-1)                   # [N/G, G]
        if diff.any():
            g, i = np.argwhere(diff)[0]
            raise ValueError(
                f"RLBatch.{name}: row {g * G + i} differs from row {g * G} in the query columns "
                f"[0, {query_width}), but both are in group {g} of {G} consecutive rows. The "
                "update runs each group's query once (model.share_query), so the rows of a "
                "group must repeat one query, query-major as a rollout lays them out; fix the "
                "batch's row order, or set model.share_query=false.")


def as_jax(batch: RLBatch) -> RLBatch:
    """The batch with every field converted to a jax array of its canonical dtype."""
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    return RLBatch(
        tokens=jnp.asarray(batch.tokens, jnp.int32),
        attn_mask=jnp.asarray(batch.attn_mask, bool),
        query_mask=jnp.asarray(batch.query_mask, bool),
        response_mask=jnp.asarray(batch.response_mask, bool),
        old_logp=f32(batch.old_logp),
        advantages=f32(batch.advantages),
        ref_query_logp=f32(batch.ref_query_logp),
        query_weight=f32(batch.query_weight),
        group_id=jnp.asarray(batch.group_id, jnp.int32),
        ref_logp=f32(batch.ref_logp),
    )
