"""The LM head as a decode step uses it: one copy per call, placed so that no
step gathers it (`decode_head`), the logits of each row's last hidden state
on the chips of its row (`head_logits`), and a decode step's next tokens
straight from the hidden states (`head_choose`). The product itself is the
model's (`model.lm_logits`), as in the training forward and `logprobs`.

On a mesh the head copy is split on the vocabulary over every chip (when the
mesh's size divides V), so each chip multiplies its slice of the vocabulary
for every row. `head_logits` then sends the logits back to their rows' chips;
`head_choose` instead draws on the slices where they are (`split_draw`), so a
decode step never moves or re-reads a [rows, V] array: on the 1.5B v4-8 plan
the logits' all-to-all, layout copy, log-softmax and padding were about 17
passes over a 19 MB float32 array, 0.33 GiB of a 1.87 GiB paged step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding
from erpo_jax.rollout.choice import (block_size, choose, eos_blocked, index_in_block,
                                     locate_block, step_uniform)
from erpo_jax.rollout.types import SamplingConfig


def decode_head(params, cfg: ModelConfig, sharding: Sharding | None = None) -> jax.Array:
    """The LM head weight [D, V] as the engines use it (made once per call):
    on a mesh whose size divides V, split on V over every chip, so no decode
    step gathers the [D, V] weight."""
    w = model_lib.head_weight(params, cfg).astype(cfg.jnp_compute_dtype)
    axes = decode_head_axes(cfg, sharding)
    return w if axes is None else sharding.constrain(w, axes)


def decode_head_axes(cfg: ModelConfig, sharding: Sharding | None):
    """The logical axes of `decode_head`'s [D, V] weight (None: as it is)."""
    if sharding is None or sharding.mesh.size == 1:
        return None
    if cfg.vocab_size % sharding.mesh.size:
        return ("embed", "vocab")
    return (None, "head_vocab")


def head_logits(h: jax.Array, head: jax.Array, cfg: ModelConfig,
                sharding: Sharding | None = None) -> jax.Array:
    """float32 logits [R, V] of final hidden states h [R, D] (head: from
    `decode_head`), on the chips of their rows. With a vocabulary-split head
    every chip computes its slice of the vocabulary for every row, then each
    row's logits go to its chip (an all-to-all of R x V / chips floats)."""
    axes = decode_head_axes(cfg, sharding)
    split = axes is not None and axes[1] == "head_vocab"
    if split:
        h = sharding.constrain(h, (None, None))
    logits = model_lib.lm_logits(h, head, sharding)
    if axes is None:
        return logits
    if split:
        logits = sharding.constrain(logits, (None, "head_vocab"))
    return sharding.constrain(logits, ("rows", None))


def head_choose(h: jax.Array, head: jax.Array, keys: jax.Array, uniforms: jax.Array,
                step: jax.Array, sc: SamplingConfig, cfg: ModelConfig,
                sharding: Sharding | None = None, platform: str = ""):
    """Each row's next token int32[R] and its logp float32[R] from final hidden
    states h [R, D]: `choose` of `head_logits` (keys, uniforms, step and
    platform as `choose` takes them). With a vocabulary-split head and plain
    sampling (inverse CDF, no top-k, no top-p, not greedy: an RL rollout's),
    the draw runs on the vocabulary slices (`split_draw`): the same
    distribution and the same uniforms, summed in blocks that end at each
    slice's end, so a token can differ from `choose`'s only where float
    rounding moves its uniform across a token boundary."""
    axes = decode_head_axes(cfg, sharding)
    plain = (not sc.greedy and sc.method == "inverse_cdf" and not sc.top_k
             and sc.top_p >= 1.0)
    if axes is None or axes[1] != "head_vocab" or not plain:
        return choose(head_logits(h, head, cfg, sharding), keys, uniforms, step, sc, platform)
    u = step_uniform(uniforms, step)
    blocked = eos_blocked(step, sc)
    blocked = jnp.zeros(u.shape, bool) if blocked is None else jnp.broadcast_to(blocked, u.shape)
    tok, logp = split_draw(h, head, u, blocked, sc, cfg, sharding)
    return sharding.constrain(tok, ("rows",)), sharding.constrain(logp, ("rows",))


def split_draw(h: jax.Array, head: jax.Array, u: jax.Array, blocked: jax.Array,
               sc: SamplingConfig, cfg: ModelConfig, sharding: Sharding):
    """`inverse_cdf_sample` over a vocabulary split on every chip, under
    `shard_map`: tokens int32[R] and logp float32[R], replicated.

    Each chip holds every row's logits for its slice of V / C tokens. It sums
    exp(z - m) (m: the rows' maximum over all chips) in blocks of
    `block_size(V)` within its slice, and the chips exchange only these block
    masses ([R, C x blocks], not [R, V]). Every chip then finds each row's
    block in the cumulative masses from its uniform; the chip that holds the
    block finds the token in it, and a sum over chips hands the token and its
    logit to all. logp = z_t - (m + log of the total mass before the EOS mask),
    as `choose`'s log-softmax before truncation and mask."""
    from jax.sharding import PartitionSpec as P
    ax = sharding.spec((None, "head_vocab"))[1]
    V, T = cfg.vocab_size, sc.temperature
    b = block_size(V)
    eos = jnp.asarray(sc.eos_ids or (-1,), jnp.int32)

    def local(h, w, u, blocked):
        c = jax.lax.axis_index(ax)
        Vc = w.shape[1]
        nb = -(-Vc // b)
        z = model_lib.lm_logits(h, w, sharding) / T                         # [R, Vc] float32
        m = jax.lax.pmax(jnp.max(z, axis=-1), ax)                           # [R]
        p = jnp.exp(z - m[:, None])
        ids = c * Vc + jnp.arange(Vc, dtype=jnp.int32)
        if sc.eos_ids and sc.min_new_tokens:
            is_eos = jnp.any(ids[:, None] == eos[None, :], axis=-1)
            q = jnp.where(is_eos[None, :] & blocked[:, None], 0.0, p)
        else:
            q = p
        total = jax.lax.psum(jnp.sum(p, axis=-1), ax)                      # before the mask
        qb = jnp.pad(q, ((0, 0), (0, nb * b - Vc))).reshape(-1, nb, b)
        mass = jax.lax.all_gather(jnp.sum(qb, axis=-1), ax, axis=1, tiled=True)   # [R, C nb]
        blk, rest = locate_block(mass, u)                                   # [R], global block
        mine = blk // nb == c
        lb = blk % nb
        row = jnp.take_along_axis(qb, lb[:, None, None], axis=1)[:, 0]      # [R, b]
        lt = jnp.minimum(lb * b + index_in_block(row, rest), Vc - 1)        # local token
        zt = jnp.take_along_axis(z, lt[:, None], axis=1)[:, 0]
        tok = jax.lax.psum(jnp.where(mine, c * Vc + lt, 0), ax)
        zt = jax.lax.psum(jnp.where(mine, zt, 0.0), ax)
        return tok.astype(jnp.int32), zt - (m + jnp.log(total))

    return jax.shard_map(local, mesh=sharding.mesh,
                         in_specs=(P(None, None), P(None, ax), P(None), P(None)),
                         out_specs=(P(None), P(None)), check_vma=False)(h, head, u, blocked)
