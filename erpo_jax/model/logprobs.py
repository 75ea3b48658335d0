"""Per-token log-probabilities and entropies without the full [B, T, V] logits.

The LM head and the log-softmax run over the sequence in chunks of `chunk_size`
positions under `jax.checkpoint`, so at most float32[B, chunk, V] logits exist
at once, forward and backward. With a 152k vocabulary at T=4096 that is the
difference between 2.5 GB per sequence and a few tens of MB.

Vocabulary-parallel head. On a mesh of n > 1 devices whose size divides the
vocabulary, each chunk's hidden states are gathered from the batch-sharded
rows onto every device (the chunk's [B, C, D] activations are small), the
LM-head weight is resharded to columns [D, V/n], and each device computes
the logits of its V/n vocabulary entries for every row; the log-softmax's
max and sums over V are then reductions across devices of [B, C] numbers.
Without it an FSDP mesh all-gathers the whole [D, V] weight for every chunk
and each device forms a full-size [D, V] partial weight gradient of its own
rows before the reduce-scatter: for Qwen2.5-7B's untied 152064 x 3584 head
that is 1 GiB (bfloat16 weight) + 2 GiB (float32 gradient) per chip, what
XLA's TPU compiler showed as the largest temporaries of the update.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding


class TokenLogprobs(NamedTuple):
    """Per next-token statistics of a batch, all float32[B, T-1].

    logp[b, t]: log p_temp(tokens[b, t+1] | tokens[b, :t+1]) at `temperature`.
    entropy[b, t]: entropy of that temperature-scaled next-token distribution.
    logp_t1[b, t]: the same log-probability at temperature 1 (the model's own
      likelihood; equals `logp` when temperature is 1).
    """

    logp: jax.Array
    entropy: jax.Array
    logp_t1: jax.Array


def logprobs_from_logits(logits: jax.Array, targets: jax.Array, temperature=1.0):
    """(logp, entropy), float32[...], of `targets` under softmax(logits / temperature).

    logits: [..., V] (any float dtype, upcast to float32); targets: int[...].

    Nothing of size [..., V] is formed besides the logits and their gradient:
    log p = z_t - logsumexp(z) and H = sum_v p_v (logsumexp(z) - z_v), with
    z = logits / temperature, are reductions over V. The target's logit z_t is
    picked by a masked sum over V (one term and zeros: the same number), not a
    gather: it fuses into the passes over V, its gradient is an elementwise
    select that fuses into the logits' gradient (a gather's is a scatter into
    a fresh [..., V] buffer), and a partitioner can do it on a vocabulary
    sharded across devices.
    """
    z = logits.astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(z, axis=-1, keepdims=True)
    hit = jnp.arange(z.shape[-1], dtype=targets.dtype) == targets[..., None]
    z_t = jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
    gap = logz - z            # -log p_v >= 0
    entropy = jnp.sum(jnp.exp(-gap) * gap, axis=-1)
    return z_t - logz[..., 0], entropy


def token_logprobs(params, cfg: ModelConfig, tokens: jax.Array, attn_mask: jax.Array | None = None,
                   *, temperature=1.0, chunk_size: int | None = 512,
                   positions: jax.Array | None = None,
                   sharding: Sharding | None = None, last: int | None = None,
                   response_columns: int | None = None, group_size: int = 1) -> TokenLogprobs:
    """Log-probabilities of each next token, from one forward pass.

    tokens: int32[B, T] (left padding allowed); attn_mask: [B, T], 1 = real.
    temperature: divides the logits for `logp` and `entropy`; `logp_t1` is
      always at temperature 1.
    chunk_size: sequence positions per LM-head chunk; None = one chunk (only
      for small inputs: it materialises [B, T-1, V]).
    last: score only the last `last` next-token predictions (e.g. a
      rollout's response columns, all a response-side KL needs); the LM head
      and log-softmax then skip the prompt positions, and the other
      T-1-last columns of every output are 0.
    response_columns: the last `response_columns` predictions are a response
      and the ones before it its query (an RLBatch's layout: the query
      targets sit left of column T-1-N for N response slots). Each part gets
      only what a loss reads there: query columns `logp_t1` (Query-KL),
      response columns `logp` and `entropy` at `temperature` (the policy
      gradient, Policy-KL, the entropy bonus); the rest is 0. So no gradient
      flows into the LM head from a query column unless `logp_t1` is
      differentiated, and with temperature != 1 each column takes one
      log-softmax, not two.
    group_size: G > 1 when the rows come in consecutive groups of G that
      repeat one query: the same tokens and mask in the first T-N columns,
      N = `last` or `response_columns` (a rollout's layout: G responses per
      query). Each group's query then runs through the model once, not G
      times (`model.hidden_states_grouped`), and its query columns are
      scored once and repeated to the group's rows. The same function of
      the parameters, with the query part's work divided by G; nothing here
      checks the repetition (`rl.batch.validate_batch` does).
    Returns TokenLogprobs of float32[B, T-1]; values at padded positions are
    finite but meaningless (mask them).
    """
    if tokens.ndim != 2:
        raise ValueError(f"token_logprobs: tokens must be int[B, T], got shape {tokens.shape}.")
    if tokens.shape[1] < 2:
        raise ValueError(f"token_logprobs: need at least 2 tokens per row, got T={tokens.shape[1]}.")
    if group_size > 1:
        if positions is not None:
            raise ValueError("token_logprobs: group_size > 1 takes positions from the mask; "
                             "do not pass `positions`.")
        return _grouped_stats(params, cfg, tokens, attn_mask, temperature, chunk_size,
                              sharding, last, response_columns, group_size)
    h, _ = model_lib.hidden_states(params, cfg, tokens, positions, attn_mask, sharding=sharding)
    h, targets = h[:, :-1], tokens[:, 1:]
    if response_columns is not None:
        if last is not None:
            raise ValueError("token_logprobs: pass `last` or `response_columns`, not both.")
        return _split_stats(params, cfg, h, targets, temperature, chunk_size, sharding,
                            response_columns)
    skip = 0
    if last is not None:
        if not 0 < last <= h.shape[1]:
            raise ValueError(f"token_logprobs: last={last} must be in [1, T-1={h.shape[1]}].")
        skip = h.shape[1] - last
        h, targets = h[:, skip:], targets[:, skip:]
    return _place(_head_stats(params, cfg, h, targets, temperature, chunk_size, sharding), skip)


def _place(resp: TokenLogprobs, split: int, query_t1: jax.Array | None = None) -> TokenLogprobs:
    """TokenLogprobs over all T-1 columns from `resp`, the statistics of the
    columns after the first `split`: logp and entropy are 0 on those; so is
    logp_t1 when query_t1 is None (a `last` pass), else logp_t1 is query_t1
    [B, split] there and 0 on resp's columns (a `response_columns` pass)."""
    pad = lambda a: jnp.pad(a, ((0, 0), (split, 0))) if split else a
    if query_t1 is None:
        return TokenLogprobs(*(pad(a) for a in resp))
    return TokenLogprobs(pad(resp.logp), pad(resp.entropy),
                         jnp.concatenate([query_t1, jnp.zeros_like(resp.logp_t1)], axis=1))


def _split_stats(params, cfg: ModelConfig, h, targets, temperature, chunk_size, sharding,
                 response_columns: int) -> TokenLogprobs:
    """TokenLogprobs with query columns scored at temperature 1 only and
    response columns at `temperature` only (see `token_logprobs`)."""
    Tm1 = h.shape[1]
    if not 0 < response_columns <= Tm1:
        raise ValueError(f"token_logprobs: response_columns={response_columns} must be in "
                         f"[1, T-1={Tm1}].")
    split = Tm1 - response_columns
    resp = _head_stats(params, cfg, h[:, split:], targets[:, split:], temperature, chunk_size,
                       sharding)
    query_t1 = jnp.zeros((h.shape[0], 0), jnp.float32)
    if split:
        query_t1 = _head_stats(params, cfg, h[:, :split], targets[:, :split], 1.0, chunk_size,
                               sharding).logp_t1
    return _place(resp, split, query_t1)


def _grouped_stats(params, cfg: ModelConfig, tokens, attn_mask, temperature, chunk_size,
                   sharding, last, response_columns, G: int) -> TokenLogprobs:
    """`token_logprobs` of rows in groups of G that repeat their query (see there)."""
    B, T = tokens.shape
    if (last is None) == (response_columns is None):
        raise ValueError("token_logprobs: group_size > 1 needs exactly one of `last` and "
                         "`response_columns` (the response width: the columns before it are "
                         "the query the group shares).")
    N = last if last is not None else response_columns
    if not 0 < N <= T - 1:
        name = "last" if last is not None else "response_columns"
        raise ValueError(f"token_logprobs: {name}={N} must be in [1, T-1={T - 1}].")
    if B % G:
        raise ValueError(f"token_logprobs: {B} rows are not whole groups of group_size={G}.")
    Q = T - N
    hq, hr = model_lib.hidden_states_grouped(params, cfg, tokens, attn_mask, group_size=G,
                                             query_width=Q, sharding=sharding)
    # Column Q-1 (the query's last token predicting the first response token)
    # is a response column whose hidden state is the group's.
    h_resp = jnp.concatenate([jnp.repeat(hq[:, -1:], G, axis=0), hr[:, :-1]], axis=1)
    resp = _head_stats(params, cfg, h_resp, tokens[:, Q:], temperature, chunk_size, sharding)
    if last is not None:
        return _place(resp, Q - 1)
    query_t1 = jnp.zeros((B, 0), jnp.float32)
    if Q > 1:   # the query's own columns, scored once per group
        query = _head_stats(params, cfg, hq[:, :-1], tokens[::G, 1:Q], 1.0, chunk_size, sharding)
        query_t1 = jnp.repeat(query.logp_t1, G, axis=0)
    return _place(resp, Q - 1, query_t1)


def _head_stats(params, cfg: ModelConfig, h, targets, temperature, chunk_size,
                sharding) -> TokenLogprobs:
    """TokenLogprobs of hidden states h [B, T', D] predicting targets [B, T']."""
    B, Tm1, D = h.shape
    same_temp = isinstance(temperature, (int, float)) and float(temperature) == 1.0
    parallel = vocab_parallel(cfg, sharding)

    def chunk_stats(h_c, t_c):
        if parallel:
            logits = _vocab_parallel_logits(params, cfg, h_c, sharding)
            t_c = sharding.constrain(t_c, (None, None))
        else:
            logits = model_lib.head_logits(params, cfg, h_c, sharding)
        logp, ent = logprobs_from_logits(logits, t_c, temperature)
        logp_t1 = (logp if same_temp else
                   logprobs_from_logits(logits, t_c, 1.0)[0])
        out = (logp, ent, logp_t1)
        if parallel:  # back to the rows' own devices
            out = tuple(sharding.constrain(a, ("batch", None)) for a in out)
        return out

    C = Tm1 if chunk_size is None else min(int(chunk_size), Tm1)
    if C <= 0:
        raise ValueError(f"token_logprobs: chunk_size must be positive, got {chunk_size}.")
    if C == Tm1:
        return TokenLogprobs(*chunk_stats(h, targets))
    n = -(-Tm1 // C)
    pad = n * C - Tm1
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hs = h.reshape(B, n, C, D).swapaxes(0, 1)
    ts = targets.reshape(B, n, C).swapaxes(0, 1)

    body = jax.checkpoint(chunk_stats)
    _, out = jax.lax.scan(lambda carry, x: (carry, body(*x)), None, (hs, ts))
    unchunk = lambda a: a.swapaxes(0, 1).reshape(B, n * C)[:, :Tm1]
    return TokenLogprobs(*(unchunk(a) for a in out))


def vocab_parallel(cfg: ModelConfig, sharding: Sharding | None) -> bool:
    """Whether the log-prob pass computes the LM head vocabulary-parallel (see
    the module docstring): a mesh of several devices whose size divides V."""
    n = 1 if sharding is None else sharding.mesh.size
    return n > 1 and cfg.vocab_size % n == 0


def _vocab_parallel_logits(params, cfg: ModelConfig, h, sharding: Sharding):
    """float32 logits [B, C, V] of hidden states h [B, C, D], sharded on V over
    the whole mesh, from every row's hidden states on every device."""
    w = model_lib.head_weight(params, cfg).astype(h.dtype)
    w = sharding.constrain(w, (None, "head_vocab"))                      # [D, V/n] per device
    h = sharding.constrain(h, (None, None, None))                         # all rows, every device
    return sharding.constrain(model_lib.lm_logits(h, w, sharding), (None, None, "head_vocab"))
