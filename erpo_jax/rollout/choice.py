"""Token choice: the next token of every row from its logits, and its
log-probability (`choose`), with the top-k / top-p truncation and the two
ways of drawing (`SamplingConfig.method`) it uses. Every engine samples
through `choose`, so the same key draws the same token in each.

The log-probability is under softmax(logits / temperature), before the
truncation and the min-new-tokens EOS mask (the convention of `types`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.rollout.types import SamplingConfig


def truncate_logits(z: jax.Array, top_k: int, top_p: float, platform: str = "") -> jax.Array:
    """Set logits outside the top-k, then outside the top-p nucleus, to -inf.

    z: float32[R, V] (already temperature-scaled). top-p is measured on the
    distribution left after top-k (renormalised), as transformers does. The
    most likely token is always kept. Ties at the threshold are all kept.
    top-p alone sorts the whole vocabulary every step; with a top-k it sorts
    only the k survivors, which is much cheaper for large vocabularies.
    platform: the one the program is compiled for (default JAX's backend).
    Top-k alone on the CPU finds the k-th largest logit by `kth_largest`
    rather than `lax.top_k`, which XLA's CPU backend runs as a full sort of
    every row (see experiments/BENCHMARKS.md for the measured decode steps).
    """
    if top_k:
        if top_p < 1.0 or (platform or jax.default_backend()) != "cpu":
            desc = jax.lax.top_k(z, top_k)[0]                  # [R, k], descending
            kth = desc[:, -1:]
        else:
            kth = kth_largest(z, top_k)
        z = jnp.where(z < kth, -jnp.inf, z)
    if top_p < 1.0:
        if not top_k:
            desc = -jnp.sort(-z, axis=-1)                      # [R, V], descending
        probs = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)   # >= 1
        threshold = jnp.take_along_axis(desc, n_keep - 1, axis=-1)
        z = jnp.where(z < threshold, -jnp.inf, z)
    return z


def kth_block(V: int) -> int:
    """Entries per block of `kth_largest`'s candidate pass over rows of V:
    the power of two nearest sqrt(V / 8), at least 8. It balances the pass's
    two costs, finding the kept blocks (~k V / block) and the 32 passes over
    the candidates (~32 k block). Measured, k = 50: [128, 8192] rows 11.8 ms
    with no candidate pass, 3.8 / 6.0 / 10.9 ms with blocks of 32 / 64 / 128;
    [64, 151936] rows 313 ms, 84 / 41 / 30 ms with blocks of 32 / 64 / 128."""
    return max(8, 1 << round(np.log2(np.sqrt(V / 8))))


def kth_largest(z: jax.Array, k: int) -> jax.Array:
    """float32[R, 1]: the k-th largest entry of each row of z float32[R, V]
    (counting repeats), the value `lax.top_k(z, k)[0][:, -1:]` holds.

    Each float is mapped to a 32-bit unsigned key in the same order (for a
    negative float the magnitude bits are flipped, then the sign bit is
    flipped for all), and the key of the k-th largest entry is built one bit
    at a time from the top: bit b is set when at least k keys are >= the
    prefix with it set. 32 compare-and-count passes, with no sort. NaN
    logits are not expected (the sampler never makes them).

    Candidates first, when V >= 4 k b for blocks of b = `kth_block(V)`
    entries. The row is cut into blocks; let M be the k-th largest block
    maximum. Exactly k blocks are kept: every block whose maximum is > M,
    then blocks whose maximum is M, lowest index first. With s the row's k-th largest, M <= s
    (k blocks reach M, so k entries do). Every entry > s is kept (its block's
    maximum is > M). If M < s, so is every entry >= s, k or more of them; if
    M = s, each kept block holds an entry >= s. Either way the candidates
    hold at least k entries >= s and all entries above it, so their k-th
    largest is s. The 32 passes then run over the k b candidates (1,600
    instead of 8,192 at k = 50), after the same search over the block maxima.
    """
    if z.shape[-1] >= 1 << 24:
        raise ValueError(f"kth_largest: rows of {z.shape[-1]} entries; the float32 count is exact "
                         "below 2^24. Use lax.top_k for a vocabulary this large.")
    bits = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.int32)
    ordered = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)              # signed order = float order
    top = jnp.uint32(0x80000000)
    keys = jax.lax.bitcast_convert_type(ordered, jnp.uint32) ^ top      # unsigned order
    R, V = keys.shape
    b = kth_block(V)
    if V >= 4 * k * b:
        nb = -(-V // b)
        # Padding keys are 0, below every float's key: never among the top k.
        blocks = jnp.pad(keys, ((0, 0), (0, nb * b - V))).reshape(R, nb, b)
        bmax = jnp.max(blocks, axis=-1)                                 # [R, nb]
        m = _kth_key(bmax, k)[:, None]
        above, tie = bmax > m, bmax == m
        room = k - jnp.sum(above, axis=-1, keepdims=True)               # >= 1
        keep = above | (tie & (jnp.cumsum(tie, axis=-1) <= room))      # exactly k per row
        rank = jnp.cumsum(keep, axis=-1)                                # j + 1 at the j-th kept
        # The j-th kept block's index: the number of blocks ranked <= j before it.
        # Counted in float32 (exact: nb < 2^24), as in _kth_key.
        idx = jnp.sum((rank[:, None, :] <= jnp.arange(k)[None, :, None]).astype(jnp.float32),
                      axis=-1).astype(jnp.int32)                        # [R, k]
        keys = jnp.take_along_axis(blocks, idx[:, :, None], axis=1).reshape(R, k * b)
    key = _kth_key(keys, k)
    ordered = jax.lax.bitcast_convert_type(key ^ top, jnp.int32)
    bits = jnp.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)[:, None]


def _kth_key(keys: jax.Array, k: int) -> jax.Array:
    """uint32[R]: the k-th largest of each row of keys uint32[R, V], built bit
    by bit from the top (see `kth_largest`)."""
    def add_bit(i, prefix):
        cand = prefix | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        # Counted in float32, exact for any count below 2^24 (a vocabulary of
        # 16M): XLA's CPU backend sums an int32 count by writing the int32
        # comparisons out and reducing them in windows, 1.6x slower here.
        hits = jnp.sum((keys >= cand[:, None]).astype(jnp.float32), axis=-1)
        return jnp.where(hits >= k, cand, prefix)

    return jax.lax.fori_loop(0, 32, add_bit, jnp.zeros(keys.shape[:1], jnp.uint32))


def inverse_cdf_sample(z: jax.Array, u: jax.Array) -> jax.Array:
    """int32[R] draws from softmax(z) given uniforms u float32[R] in [0, 1).

    z: float32[R, V], -inf on excluded tokens. Token t is drawn when u * total
    falls in [cdf[t-1], cdf[t]) of the unnormalised cumulative probabilities.
    The cumulative sum runs in two levels (blocks of about sqrt(V) tokens,
    then within the chosen block), which on the CPU costs a few reductions
    over [R, V] instead of a full-length scan. A token of probability zero is
    never drawn, whatever the float rounding: the target stays below the
    total, and within the chosen block the draw is capped at its last token of
    positive probability.
    """
    R, V = z.shape
    b = block_size(V)
    nb = -(-V // b)
    p = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))               # the argmax has p = 1
    p = jnp.pad(p, ((0, 0), (0, nb * b - V))).reshape(R, nb, b)
    blk, rest = locate_block(jnp.sum(p, axis=-1), u)
    row = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]    # [R, b]
    return (blk * b + index_in_block(row, rest)).astype(jnp.int32)


def locate_block(block_mass: jax.Array, u: jax.Array):
    """The first level of `inverse_cdf_sample`: int32[R], the block whose
    cumulative (unnormalised) mass first passes u x total, from block_mass
    float32[R, blocks], and float32[R], how far into that block's mass the
    target lies. The target stays below the total, whatever the rounding."""
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    total = block_cdf[:, -1]
    target = jnp.minimum(u * total, jnp.nextafter(total, 0.0))         # [R], < total
    blk = jnp.sum(block_cdf[:, :-1] <= target[:, None], axis=-1)      # first block past target
    before = jnp.take_along_axis(block_cdf - block_mass, blk[:, None], axis=1)[:, 0]
    return blk, target - before


def index_in_block(row: jax.Array, rest: jax.Array) -> jax.Array:
    """The second level: int32[R], the entry of row float32[R, b] (the chosen
    block's masses) where the cumulative mass passes rest, capped at the
    block's last entry of positive mass (a zero-probability token is never
    drawn)."""
    within = jnp.sum(jnp.cumsum(row, axis=-1)[:, :-1] <= rest[:, None], axis=-1)
    last = jnp.max(jnp.where(row > 0, jnp.arange(row.shape[-1]), 0), axis=-1)
    return jnp.minimum(within, last)


def choose(logits: jax.Array, keys: jax.Array, uniforms: jax.Array, step: jax.Array,
           sc: SamplingConfig, platform: str = ""):
    """Sampled tokens int32[R] and their logp float32[R] from logits float32[R, V]
    (keys: key[R] per row; uniforms: float32[R, N] per row and step; step:
    int32[] shared by the rows, or int32[R], each row's own step; platform:
    the one the program is compiled for, see `truncate_logits`)."""
    z = logits.astype(jnp.float32) / sc.temperature
    logprobs = jax.nn.log_softmax(z, axis=-1)
    per_row = step.ndim == 1
    early = eos_blocked(step, sc)
    if early is not None:
        is_eos = jnp.zeros(z.shape[-1], bool).at[jnp.array(sc.eos_ids)].set(True)
        z = jnp.where(is_eos & (early[:, None] if per_row else early), -jnp.inf, z)
    if sc.greedy:
        tok = jnp.argmax(z, axis=-1)
    else:
        z = truncate_logits(z, sc.top_k, sc.top_p, platform)
        if sc.method == "gumbel":
            step_keys = jax.vmap(jax.random.fold_in, (0, 0 if per_row else None))(keys, step)
            tok = jax.vmap(jax.random.categorical)(step_keys, z)
        else:
            tok = inverse_cdf_sample(z, step_uniform(uniforms, step))
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logprobs, tok[:, None], axis=-1)[:, 0]


def step_uniform(uniforms: jax.Array, step: jax.Array) -> jax.Array:
    """float32[R]: each row's uniform of this step (uniforms float32[R, N]; step
    int32[] shared by the rows or int32[R], each row's own)."""
    if step.ndim == 1:
        return jnp.take_along_axis(uniforms, step[:, None], axis=1)[:, 0]
    return jax.lax.dynamic_index_in_dim(uniforms, step, axis=1, keepdims=False)


def eos_blocked(step: jax.Array, sc: SamplingConfig) -> jax.Array | None:
    """bool[] or bool[R]: whether EOS is masked out at this step (min_new_tokens);
    None when it never is."""
    if sc.eos_ids and sc.min_new_tokens:
        return step < sc.min_new_tokens
    return None


def block_size(V: int) -> int:
    """The block of `inverse_cdf_sample`'s two-level cumulative sum: about
    sqrt(V) tokens, a power of two in [8, 256]."""
    return int(min(256, max(8, 1 << round(np.log2(np.sqrt(V))))))

