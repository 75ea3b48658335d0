"""Rollouts: prefill each prompt once, then sample G continuations of it.

Shapes: B prompts, G samples per prompt, R = B * G rows (prompt-major: row
r = b * G + g), P prompt bucket length, N max new tokens, V vocab, S = P + N - 1
cache slots (the last sampled token is never fed back).

One jitted function (`make_sample_fn`) does everything on device:

1. prefill the B left-padded prompts in one forward pass into a KV cache;
2. repeat the cache and the last-position logits to R rows, so the G samples
   of a prompt share its prefill;
3. sample token 0 from those logits, then `lax.while_loop`s of one-token
   decode steps that stop when every row has emitted an EOS id or N tokens
   exist: one loop per phase of the cache's growth (`cache_phase_lengths`),
   each on a cache just long enough for its steps, so the attention of a
   step reads about the filled slots rather than all S.

The log-probability convention. `Rollout.logp[r, t]` is log softmax(logits /
temperature)[token], i.e. under the temperature-scaled distribution BEFORE
top-k / top-p truncation and before the min-new-tokens EOS mask, never
renormalised over the kept set. That is exactly what a teacher-forced
recompute `token_logprobs(params, cfg, tokens, mask, temperature=T)` returns,
so the PPO/GRPO ratio is exactly 1 at the first update on fresh samples. With
`greedy=True` the token is the argmax and its logp is still under
softmax(logits / temperature).

Randomness. Row r's key is fold_in(rng, r). With method 'inverse_cdf' it
draws the row's N uniforms at once, before the decode loop (uniform t decides
token t); with 'gumbel' step t uses the key fold_in(fold_in(rng, r), t). So a
row's random numbers depend only on (rng, global row index, step): sampling
G per prompt equals sampling each prompt repeated G times, and another mesh
gives the same samples, to float rounding: a draw can flip where rounding
moves it across a token boundary. For RL step s pass `rollout_key(seed_key, s)`.

Compilation. The jitted function is specialised on (B, P) and the static
configs; `Sampler` buckets P to powers of two and pads B to a multiple of the
data-parallel size, so an RL run compiles a handful of shapes.

Donation. The KV cache is created, grown and dropped inside the one jitted
call: the while_loop carries it, so XLA updates it in place and it never
crosses the jit boundary; there is no argument left worth donating (the
prompts are a few KB).

Memory. The sampler makes one per-layer copy of the layer weights per call
(`model.unstack_layers`), so while it runs the policy's layer parameters are
held twice; in exchange no decode step copies weights.

Sharding of a decode step (on a mesh). The weights stay where they are
(FSDP- and tensor-sharded) and the activations move: the dense layers run
under `Sharding.weight_stationary`, so each chip multiplies its own weight
shard by every row's hidden state (the contraction's partial sums are
reduced across chips: a few MB per layer for a few hundred rows), and each
row attends on the chip that holds its KV cache. The LM head is a copy made
once per call, split on the vocabulary over every chip (`decode_head`); its
logits go back to their rows' chips for sampling. Under the training rules
a decode step would all-gather every FSDP-sharded weight instead, the whole
model per token (on a v5e-16, 15 GiB of bfloat16 per chip and step for a
7B model, per `erpo plan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

from erpo_jax.runtime import xla_options
from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.dense import dense
from erpo_jax.model.sharding import Sharding, platform as platform_of


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample. Hashable: it is a static argument of the jitted sampler.

    Attributes:
      max_new_tokens: N, the static response length (rows stop early at EOS).
      num_samples: G, samples per prompt (they share the prompt's prefill).
      temperature: divides the logits; > 0.
      top_p: nucleus mass in (0, 1]; 1 = off.
      top_k: keep the k most likely tokens; 0 = off.
      greedy: take the argmax (top_p / top_k / rng are then irrelevant).
      method: how a token is drawn from the (truncated) distribution:
        'inverse_cdf' (one uniform per row, located in the cumulative
        probabilities, blockwise; 2.5x to 35x faster than 'gumbel' on the CPU
        at vocabularies 256 to 152k) or 'gumbel' (argmax of logits plus
        Gumbel noise, one random number per vocabulary entry). Both draw
        exactly from softmax(truncated z); for a given key they give different
        tokens.
      eos_ids: a row is done after emitting any of these (the EOS is kept in
        the response and in its mask).
      min_new_tokens: EOS ids are masked out of the first this-many tokens.
      pad_id: fills prompt padding (left) and response padding (right).
      max_prompt_len: longest accepted prompt; the top length bucket.
      min_bucket: shortest prompt bucket.
      cache_phases: the decode loop runs in up to this many phases on a KV
        cache that grows between them (`cache_phase_lengths`), so a step's
        attention reads about the filled slots, not all of them. Measured on
        the CPU (2 cores, random weights, top-k 50, no EOS), one phase against
        four: peer-small 16 x 8 rows, 64 + 128 tokens, 5.87 -> 5.05 s;
        medium-25m 16 x 8, 64 + 256, 33.4 -> 30.5 s. Each phase compiles the
        decode step once more. Logits and log-probs agree with one phase to
        float rounding (the softmax sums run over fewer masked slots), so a
        draw differs only where rounding moves it across a token boundary.
    """

    max_new_tokens: int = 32
    num_samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    method: str = "inverse_cdf"
    eos_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    pad_id: int = 0
    max_prompt_len: int = 512
    min_bucket: int = 8
    cache_phases: int = 4

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.num_samples < 1:
            raise ValueError(f"SamplingConfig.num_samples must be >= 1, got {self.num_samples}.")
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature}; "
                             "use greedy=True for argmax decoding.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off), got {self.top_k}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"SamplingConfig.min_new_tokens ({self.min_new_tokens}) must be in "
                             f"[0, max_new_tokens={self.max_new_tokens}].")
        if self.method not in ("inverse_cdf", "gumbel"):
            raise ValueError(f"SamplingConfig.method is {self.method!r}; use 'inverse_cdf' or "
                             "'gumbel'.")
        if self.cache_phases < 1:
            raise ValueError(f"SamplingConfig.cache_phases must be >= 1, got {self.cache_phases}.")
        if self.max_prompt_len < 1 or self.min_bucket < 1:
            raise ValueError("SamplingConfig.max_prompt_len and min_bucket must be >= 1, got "
                             f"{self.max_prompt_len} and {self.min_bucket}.")

    def check_model(self, cfg: ModelConfig) -> None:
        """Raise a sentence when a token id or the total length does not fit the model."""
        for name, ids in (("eos_ids", self.eos_ids), ("pad_id", (self.pad_id,))):
            bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
            if bad:
                raise ValueError(f"SamplingConfig.{name} {bad} outside the vocabulary "
                                 f"[0, {cfg.vocab_size}).")
        if self.top_k > cfg.vocab_size:
            raise ValueError(f"SamplingConfig.top_k ({self.top_k}) exceeds the vocabulary "
                             f"size {cfg.vocab_size}.")
        total = self.max_prompt_len + self.max_new_tokens
        if total > cfg.max_position_embeddings:
            raise ValueError(
                f"max_prompt_len + max_new_tokens = {total} (in a run config "
                f"data.max_prompt_len + rollout.max_new_tokens) exceeds the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings}): no KV cache slot "
                "holds a position past it; shorten one of them.")


class Rollout(NamedTuple):
    """B x G sampled sequences (R = B * G rows, prompt-major).

    prompt_tokens: int32[R, P] left-padded with pad_id.
    prompt_mask: bool[R, P], True on real prompt tokens.
    response_tokens: int32[R, N] right-padded with pad_id after the EOS.
    response_mask: bool[R, N], True on sampled tokens (EOS included).
    logp: float32[R, N], log-prob of each sampled token under softmax(logits /
      temperature), before top-k/top-p (see the module docstring); 0 on padding.
    lengths: int32[R], number of response tokens (= response_mask.sum(-1)).
    truncated: bool[R], True when the row hit max_new_tokens without an EOS.
    num_steps: int32[], tokens sampled per row before the loop stopped (<= N).
    """

    prompt_tokens: Any
    prompt_mask: Any
    response_tokens: Any
    response_mask: Any
    logp: Any
    lengths: Any
    truncated: Any
    num_steps: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerState:
    """The while_loop carry.

    tokens: int32[R, N] response so far; logps: float32[R, N];
    cache: KVCache over R rows and S slots; positions: int32[R] RoPE position
    of the next sampled token; done: bool[R]; lengths: int32[R];
    step: int32[] tokens sampled so far; rng: key[R], one key per row;
    uniforms: float32[R, N], row r's uniform for each step (method
    'inverse_cdf'; [R, 0] otherwise).
    """

    tokens: jax.Array
    logps: jax.Array
    cache: model_lib.KVCache
    positions: jax.Array
    done: jax.Array
    lengths: jax.Array
    step: jax.Array
    rng: jax.Array
    uniforms: jax.Array


def rollout_key(seed_key: jax.Array, rl_step: int | jax.Array) -> jax.Array:
    """The sampling key of RL step `rl_step`: fold_in(seed_key, rl_step)."""
    return jax.random.fold_in(seed_key, rl_step)


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
    b = int(min(256, max(8, 1 << round(np.log2(np.sqrt(V))))))
    nb = -(-V // b)
    p = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))               # the argmax has p = 1
    p = jnp.pad(p, ((0, 0), (0, nb * b - V))).reshape(R, nb, b)
    block_mass = jnp.sum(p, axis=-1)                                  # [R, nb]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    total = block_cdf[:, -1]
    target = jnp.minimum(u * total, jnp.nextafter(total, 0.0))         # [R], < total
    blk = jnp.sum(block_cdf[:, :-1] <= target[:, None], axis=-1)      # first block past target
    row = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]    # [R, b]
    before = jnp.take_along_axis(block_cdf - block_mass, blk[:, None], axis=1)[:, 0]
    within = jnp.sum(jnp.cumsum(row, axis=-1)[:, :-1] <= (target - before)[:, None], axis=-1)
    last = jnp.max(jnp.where(row > 0, jnp.arange(b), 0), axis=-1)
    return (blk * b + jnp.minimum(within, last)).astype(jnp.int32)


def _choose(logits: jax.Array, keys: jax.Array, uniforms: jax.Array, step: jax.Array,
            sc: SamplingConfig, platform: str = ""):
    """Sampled tokens int32[R] and their logp float32[R] from logits float32[R, V]
    (keys: key[R] per row; uniforms: float32[R, N] per row and step; step:
    int32[] shared by the rows, or int32[R], each row's own step)."""
    z = logits.astype(jnp.float32) / sc.temperature
    logprobs = jax.nn.log_softmax(z, axis=-1)
    per_row = step.ndim == 1
    if sc.eos_ids and sc.min_new_tokens:
        is_eos = jnp.zeros(z.shape[-1], bool).at[jnp.array(sc.eos_ids)].set(True)
        early = (step < sc.min_new_tokens)[:, None] if per_row else step < sc.min_new_tokens
        z = jnp.where(is_eos & early, -jnp.inf, z)
    if sc.greedy:
        tok = jnp.argmax(z, axis=-1)
    else:
        z = truncate_logits(z, sc.top_k, sc.top_p, platform)
        if sc.method == "gumbel":
            step_keys = jax.vmap(jax.random.fold_in, (0, 0 if per_row else None))(keys, step)
            tok = jax.vmap(jax.random.categorical)(step_keys, z)
        elif per_row:
            u = jnp.take_along_axis(uniforms, step[:, None], axis=1)[:, 0]
            tok = inverse_cdf_sample(z, u)
        else:
            u = jax.lax.dynamic_index_in_dim(uniforms, step, axis=1, keepdims=False)
            tok = inverse_cdf_sample(z, u)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logprobs, tok[:, None], axis=-1)[:, 0]


def _record(state: SamplerState, logits: jax.Array, sc: SamplingConfig,
            platform: str = "") -> SamplerState:
    """Sample token `state.step` for every row not yet done, and advance."""
    tok, logp = _choose(logits, state.rng, state.uniforms, state.step, sc, platform)
    live = ~state.done
    tok = jnp.where(live, tok, sc.pad_id)
    logp = jnp.where(live, logp, 0.0)
    if sc.eos_ids:
        hit = jnp.isin(tok, jnp.array(sc.eos_ids, jnp.int32))
    else:
        hit = jnp.zeros_like(live)
    at = (0, state.step)
    return dataclasses.replace(
        state,
        tokens=jax.lax.dynamic_update_slice(state.tokens, tok[:, None], at),
        logps=jax.lax.dynamic_update_slice(state.logps, logp[:, None], at),
        done=state.done | (live & hit),
        lengths=state.lengths + live.astype(jnp.int32),
        step=state.step + 1,
    )


def decode_head(params, cfg: ModelConfig, sharding: Sharding | None = None) -> jax.Array:
    """The LM head weight [D, V] as the sampler uses it (made once per call):
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
    logits = dense(h, head, preferred_element_type=jnp.float32, platform=platform_of(sharding))
    if axes is None:
        return logits
    if split:
        logits = sharding.constrain(logits, (None, "head_vocab"))
    return sharding.constrain(logits, ("rows", None))


def decode_step(params, s: SamplerState, cfg: ModelConfig, sc: SamplingConfig,
                sharding: Sharding | None = None, head: jax.Array | None = None) -> SamplerState:
    """One step of the decode loop: feed the last sampled token, sample the next
    (params: per-layer, as `model.unstack_layers` returns them; head: from
    `decode_head`, default made here). See the module docstring for its
    sharding."""
    head = decode_head(params, cfg, sharding) if head is None else head
    last = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)     # [R, 1]
    stationary = None if sharding is None else sharding.weight_stationary()
    h, cache = model_lib.hidden_states(params, cfg, last, s.positions[:, None],
                                       jnp.ones_like(last, bool), cache=s.cache,
                                       sharding=stationary)
    s = dataclasses.replace(s, cache=cache, positions=s.positions + 1)
    return _record(s, head_logits(h[:, 0], head, cfg, sharding), sc, platform_of(sharding))


def sample_rollout(params, prompt_tokens: jax.Array, prompt_mask: jax.Array, rng: jax.Array, *,
                   cfg: ModelConfig, sc: SamplingConfig,
                   sharding: Sharding | None = None) -> Rollout:
    """Sample G continuations of each of B left-padded prompts (traceable; see
    `make_sample_fn` for the jitted version).

    prompt_tokens: int32[B, P]; prompt_mask: bool[B, P], True on real tokens,
    each row left-padded with at least one real token; rng: a PRNG key.
    Returns a Rollout over R = B * G rows.
    """
    B, P = prompt_tokens.shape
    G, N = sc.num_samples, sc.max_new_tokens
    R = B * G
    if sharding is not None and B % sharding.data_size:
        raise ValueError(f"sample_rollout: {B} prompts are not divisible by the data-parallel "
                         f"size {sharding.data_size}; pad the batch (Sampler does).")
    constrain = (lambda x, axes: sharding.constrain(x, axes)) if sharding else (lambda x, axes: x)
    prompt_mask = prompt_mask.astype(bool)

    # Per-layer weight buffers in the compute dtype, made once here so the
    # decode loop neither slices the stacked [L, ...] arrays nor reads and
    # casts float32 weights every step (model.unstack_layers,
    # model.in_compute_dtype: the same numbers).
    params = model_lib.unstack_layers(model_lib.in_compute_dtype(params, cfg))
    head = decode_head(params, cfg, sharding)

    # The cache grows in phases (`cache_phase_lengths`): each phase's decode
    # loop runs on a cache just long enough for its steps, so a step's
    # attention streams about the filled slots rather than all S of them.
    lengths = cache_phase_lengths(P, N, sc.cache_phases, platform_of(sharding))

    # Prefill the B prompts once; only the last position's logits are needed.
    cache = model_lib.init_cache(cfg, B, lengths[0])
    h, cache = model_lib.hidden_states(params, cfg, prompt_tokens,
                                       model_lib.positions_from_mask(prompt_mask), prompt_mask,
                                       cache=cache, sharding=sharding)
    logits = head_logits(h[:, -1], head, cfg, sharding)                      # [B, V]

    # Share the prefill: row b * G + g continues prompt b.
    rep = lambda x, axis: jnp.repeat(x, G, axis=axis) if G > 1 else x
    cache = cache.map_kv(lambda a, axes: constrain(rep(a, 0), axes))
    cache = cache._replace(valid=constrain(rep(cache.valid, 0), ("rows", "cache_length")))
    logits = constrain(rep(logits, 0), ("rows", None))
    row_mask = rep(prompt_mask, 0)
    rows = constrain(jnp.arange(R, dtype=jnp.int32), ("batch",))
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, rows)
    if sc.method == "inverse_cdf" and not sc.greedy:   # all of a row's draws in one go
        uniforms = jax.vmap(lambda k: jax.random.uniform(k, (N,)))(row_keys)
    else:
        uniforms = jnp.zeros((R, 0), jnp.float32)

    state = SamplerState(
        tokens=constrain(jnp.full((R, N), sc.pad_id, jnp.int32), ("batch", None)),
        logps=constrain(jnp.zeros((R, N), jnp.float32), ("batch", None)),
        cache=cache,
        positions=jnp.sum(row_mask, axis=-1, dtype=jnp.int32),
        done=jnp.zeros((R,), bool),
        lengths=jnp.zeros((R,), jnp.int32),
        step=jnp.zeros((), jnp.int32),
        rng=row_keys,
        uniforms=constrain(uniforms, ("batch", None)),
    )
    state = _record(state, logits, sc, platform_of(sharding))

    body = lambda s: decode_step(params, s, cfg, sc, sharding, head)
    for j, L in enumerate(lengths):
        if j:
            state = dataclasses.replace(state, cache=_grow_cache(state.cache, L, constrain))
        stop = _phase_stop(L, P, N)
        state = jax.lax.while_loop(lambda s: (s.step < stop) & ~jnp.all(s.done), body, state)

    response_mask = jnp.arange(N)[None, :] < state.lengths[:, None]
    return Rollout(
        prompt_tokens=rep(prompt_tokens.astype(jnp.int32), 0),
        prompt_mask=row_mask,
        response_tokens=state.tokens,
        response_mask=response_mask,
        logp=state.logps,
        lengths=state.lengths,
        truncated=~state.done,
        num_steps=state.step,
    )


MIN_PHASE_TOKENS = 16


def cache_phase_lengths(P: int, N: int, phases: int, platform: str = "") -> tuple[int, ...]:
    """The KV-cache lengths of the decode loop's phases for P prompt slots
    and N new tokens: at most `phases` lengths, increasing, the last
    S = P + N - 1. A phase feeds at least MIN_PHASE_TOKENS tokens (below that
    the saved reads do not pay for the extra compilation: peer-tiny's 32 new
    tokens decoded no faster in four phases and compiled in 1.7x the time).
    The N - 1 fed tokens are split evenly between the phases,
    each length rounded up to a multiple of 8 on the CPU, 128 elsewhere (the
    keys' slot axis is the vector lane axis). One phase: one loop on the whole
    cache. More phases read less of the cache (with n phases a step reads on
    average about P + (N / 2)(1 + 1 / n) slots, against S), and compile the
    decode step n times."""
    S = P + N - 1
    if phases < 1:
        raise ValueError(f"SamplingConfig.cache_phases must be >= 1, got {phases}.")
    phases = max(1, min(phases, (N - 1) // MIN_PHASE_TOKENS))
    align = 8 if (platform or jax.default_backend()) == "cpu" else 128
    out: list[int] = []
    for j in range(1, phases + 1):
        L = min(S, -(-(P + -(-j * (N - 1) // phases)) // align) * align)
        if not out or L > out[-1]:
            out.append(L)
    return tuple(out)


def _phase_stop(L: int, P: int, N: int) -> int:
    """The first decode step a phase with a cache of L slots cannot run: step
    s feeds token s - 1 into slot P + s - 1, so the phase runs the steps whose
    slot is below L (and none past N - 1)."""
    return min(N, L - P + 1)


def _grow_cache(cache: model_lib.KVCache, length: int, constrain) -> model_lib.KVCache:
    """The cache with its slot axis padded to `length` (empty, invalid slots)."""
    def pad(a, axes):
        axis = axes.index("cache_length")
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, length - a.shape[axis])
        return constrain(jnp.pad(a, widths), axes)

    cache = cache.map_kv(pad)
    return cache._replace(valid=pad(cache.valid, ("rows", "cache_length")))


def rollout_shardings(sharding: Sharding) -> Rollout:
    """NamedShardings of a Rollout: rows over the data axes, num_steps replicated."""
    rows2, rows1 = sharding.named(("batch", None)), sharding.named(("batch",))
    return Rollout(rows2, rows2, rows2, rows2, rows2, rows1, rows1, sharding.replicated())


def make_sample_fn(cfg: ModelConfig, sc: SamplingConfig, sharding: Sharding | None = None,
                   on_trace=None):
    """The jitted sampler: fn(params, prompt_tokens int32[B, P], prompt_mask
    bool[B, P], rng) -> Rollout over B * G rows (see `sample_rollout`).

    Parameters are used where they are (no host round trip); with `sharding`
    the outputs are sharded over the data axes. `on_trace()` is called each
    time the function is traced, for recompilation guards.
    """
    sc.check_model(cfg)

    def rollout_fn(params, prompt_tokens, prompt_mask, rng):
        if on_trace is not None:
            on_trace()
        return sample_rollout(params, prompt_tokens, prompt_mask, rng, cfg=cfg, sc=sc,
                              sharding=sharding)

    options = xla_options.for_steps()
    if sharding is None:
        return jax.jit(rollout_fn, compiler_options=options)
    return jax.jit(rollout_fn, out_shardings=rollout_shardings(sharding),
                   compiler_options=options)


# ----------------------------------------------------------------------------- host side


def bucket_length(n: int, min_bucket: int, max_len: int) -> int:
    """The padded prompt length for a longest prompt of n tokens: the next power
    of two, at least min_bucket, at most max_len."""
    b = max(min_bucket, 1 << max(0, int(n) - 1).bit_length())
    return min(b, max_len)


def batch_shape(sc: SamplingConfig, sharding: Sharding | None, num_prompts: int,
                longest_prompt: int) -> tuple[int, int]:
    """(B', P) of a padded prompt batch: B' = num_prompts rounded up to the
    data-parallel size, P = the length bucket of the longest prompt."""
    dp = sharding.data_size if sharding is not None else 1
    return (-(-num_prompts // dp) * dp,
            bucket_length(longest_prompt, sc.min_bucket, sc.max_prompt_len))


def prepare_prompts(prompts: Sequence[Sequence[int]], sc: SamplingConfig, vocab_size: int,
                    sharding: Sharding | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate and left-pad: (tokens int32[B', P], mask bool[B', P], B).

    B' >= B is B rounded up to the data-parallel size (extra rows repeat the
    last prompt and are dropped from the result). Raises ValueError naming
    the offending prompt's index.
    """
    V = vocab_size
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if prompts is None or len(prompts) == 0:
        raise ValueError("Sampler: the prompt list is empty; pass at least one prompt.")
    arrays = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1:
            raise ValueError(f"Sampler: prompt {i} must be a flat list of token ids, "
                             f"got shape {a.shape}.")
        if a.size == 0:
            raise ValueError(f"Sampler: prompt {i} is empty; every prompt needs at least "
                             "one token.")
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"Sampler: prompt {i} has dtype {a.dtype}; token ids must be "
                             "integers.")
        if a.size > sc.max_prompt_len:
            raise ValueError(f"Sampler: prompt {i} has {a.size} tokens, more than "
                             f"max_prompt_len={sc.max_prompt_len}.")
        bad = a[(a < 0) | (a >= V)]
        if bad.size:
            raise ValueError(f"Sampler: prompt {i} holds token id {int(bad[0])} outside the "
                             f"vocabulary [0, {V}).")
        arrays.append(a.astype(np.int32))
    B = len(arrays)
    Bp, P = batch_shape(sc, sharding, B, max(a.size for a in arrays))
    tokens = np.full((Bp, P), sc.pad_id, np.int32)
    mask = np.zeros((Bp, P), bool)
    for i in range(Bp):
        a = arrays[min(i, B - 1)]
        tokens[i, P - a.size:] = a
        mask[i, P - a.size:] = True
    return tokens, mask, B


class Sampler:
    """Host-side entry point: validates token-id prompts, pads them to a length
    bucket, runs the jitted sampler and returns numpy arrays.

    sampler = Sampler(cfg, SamplingConfig(max_new_tokens=256, num_samples=8,
                                          eos_ids=(eos,)), sharding)
    out = sampler(params, [[1, 2, 3], [4, 5]], rollout_key(seed_key, step))
    out.response_tokens  # int32[2 * 8, 256]

    `num_traces` counts how often the jitted function was traced. This is the
    `static` rollout engine (`rollout.engine`; `continuous.ContinuousEngine`
    is the other): a call's rows are prefilled together and decode until the
    last of them ends.
    """

    name = "static"

    def __init__(self, cfg: ModelConfig, sampling: SamplingConfig,
                 sharding: Sharding | None = None):
        self.cfg, self.sampling, self.sharding = cfg, sampling, sharding
        self.num_traces = 0
        self.last_stats: dict = {}
        self._fn = make_sample_fn(cfg, sampling, sharding, on_trace=self._count_trace)

    def _count_trace(self):
        self.num_traces += 1

    def batch_shape(self, num_prompts: int, longest_prompt: int) -> tuple[int, int]:
        """(B', P) of the padded prompt batch: B' = num_prompts rounded up to
        the data-parallel size, P = the length bucket of the longest prompt."""
        return batch_shape(self.sampling, self.sharding, num_prompts, longest_prompt)

    def prepare(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, int]:
        """Validate and left-pad: (tokens int32[B', P], mask bool[B', P], B)
        (see `prepare_prompts`)."""
        return prepare_prompts(prompts, self.sampling, self.cfg.vocab_size, self.sharding)

    def lower(self, params, num_prompts: int, longest_prompt: int):
        """The jitted sampler lowered for `num_prompts` prompts whose longest
        has `longest_prompt` tokens (params may be arrays or ShapeDtypeStructs)."""
        B, P = self.batch_shape(num_prompts, longest_prompt)
        rows = None if self.sharding is None else self.sharding.named(("batch", None))
        abstract = lambda dtype: jax.ShapeDtypeStruct((B, P), dtype, sharding=rows)
        key = jax.eval_shape(lambda: jax.random.key(0))
        return self._fn.lower(params, abstract(jnp.int32), abstract(jnp.bool_), key)

    def cache_phases(self, num_prompts: int, longest_prompt: int) -> list[tuple[int, int]]:
        """(cache length, decode steps run on it) of each phase of the decode
        loop at the shapes of `lower`, when every row runs to max_new_tokens
        (the N - 1 steps after token 0; see `cache_phase_lengths`)."""
        _, P = self.batch_shape(num_prompts, longest_prompt)
        sc = self.sampling
        out, start = [], 1
        for L in cache_phase_lengths(P, sc.max_new_tokens, sc.cache_phases,
                                     platform_of(self.sharding)):
            stop = _phase_stop(L, P, sc.max_new_tokens)
            out.append((L, stop - start))
            start = stop
        return out

    def lower_decode_step(self, params, num_prompts: int, longest_prompt: int,
                          cache_length: int | None = None):
        """One step of the decode loop (`decode_step`) lowered for the shapes of
        `lower`, with what the loop gives it: the compute-dtype per-layer
        weights and the head of `sample_rollout`, the carry in its shardings
        and donated, the KV cache in layouts of the compiler's choice (params:
        ShapeDtypeStructs with NamedShardings). cache_length: the cache's slots
        (a phase's length, `cache_phases`; default the whole P + N - 1). For
        `erpo plan`, whose cost analysis counts a loop body once."""
        B, P = self.batch_shape(num_prompts, longest_prompt)
        sc, cfg, sh = self.sampling, self.cfg, self.sharding
        G, N = sc.num_samples, sc.max_new_tokens
        R, S = B * G, cache_length or P + N - 1

        def put(shape, dtype, logical):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sh.named(logical))

        def unstacked(a):   # a stacked [L, ...] leaf's per-layer slice, same spec minus L
            spec = jax.sharding.PartitionSpec(*tuple(a.sharding.spec)[1:])
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype,
                                        sharding=jax.sharding.NamedSharding(sh.mesh, spec))

        # The loop's loop-invariant inputs, as `sample_rollout` makes them: the
        # weights in the compute dtype, one subtree per layer, and the head.
        cd, L, Nk, K = cfg.jnp_compute_dtype, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        narrowed = jax.eval_shape(lambda p: model_lib.in_compute_dtype(p, cfg), params)
        params = jax.tree_util.tree_map(   # eval_shape drops the shardings: put them back
            lambda a, n: jax.ShapeDtypeStruct(a.shape, n.dtype, sharding=a.sharding),
            params, narrowed)
        layer = jax.tree_util.tree_map(unstacked, params["layers"])
        per_layer = {**params, "layers": (layer,) * cfg.num_layers}
        head = jax.ShapeDtypeStruct((cfg.hidden_size, cfg.vocab_size), cd,
                                    sharding=sh.named(decode_head_axes(cfg, sh)))

        cache = model_lib.KVCache(
            tuple(put((R, Nk, K, S), cd, model_lib.K_CACHE_AXES) for _ in range(L)),
            tuple(put((R, Nk, S, K), cd, model_lib.V_CACHE_AXES) for _ in range(L)),
            put((R, S), jnp.bool_, ("rows", "cache_length")), put((), jnp.int32, ()))
        key = jax.eval_shape(lambda: jax.random.key(0))
        rows = lambda shape, dtype: put((R, *shape), dtype, ("batch", None)[:1 + len(shape)])
        state = SamplerState(
            tokens=rows((N,), jnp.int32), logps=rows((N,), jnp.float32), cache=cache,
            positions=rows((), jnp.int32), done=rows((), jnp.bool_),
            lengths=rows((), jnp.int32), step=put((), jnp.int32, ()),
            rng=put((R,), key.dtype, ("batch",)),
            uniforms=rows((N if sc.method == "inverse_cdf" and not sc.greedy else 0,),
                          jnp.float32))
        # The KV cache in the layouts the compiler picks (inside the while_loop
        # it picks them too): a fixed entry layout would add a relayout copy of
        # the whole cache per step that the loop never makes.
        auto = lambda a: Format(Layout.AUTO, a.sharding)
        formats = jax.tree_util.tree_map(lambda a: a.sharding, state)
        formats = dataclasses.replace(formats, cache=formats.cache._replace(
            k=tuple(map(auto, cache.k)), v=tuple(map(auto, cache.v))))
        shardings = jax.tree_util.tree_map(lambda a: a.sharding, (per_layer, head))
        fn = jax.jit(lambda p, h, s: decode_step(p, s, cfg, sc, sh, h), donate_argnums=(2,),
                     in_shardings=(*shardings, formats), out_shardings=formats,
                     compiler_options=xla_options.for_steps())
        return fn.lower(per_layer, head, state)

    def compile(self, params, num_prompts: int, longest_prompt: int) -> None:
        """Compile ahead of time (see `lower`); a later call with those shapes
        reuses the executable."""
        self.lower(params, num_prompts, longest_prompt).compile()

    def compile_sample(self, params, prompts: Sequence[Sequence[int]], max_prompts: int = 0):
        """Compile what `sample(params, prompts, key, max_prompts)` runs: one
        program per distinct shape of its calls."""
        step = max_prompts if max_prompts > 0 else len(prompts)
        shapes = {self.batch_shape(len(c), max(len(p) for p in c))
                  for c in (prompts[i:i + step] for i in range(0, len(prompts), step))}
        for B, P in sorted(shapes):
            self.compile(params, B, P)

    def run(self, params, prompts: Sequence[Sequence[int]], rng: jax.Array) -> tuple[Rollout, int]:
        """(Rollout of device arrays over B' * G rows, number of real rows B * G).

        For a training step that consumes the rollout on device: rows past the
        real count are padding to the data-parallel size.
        """
        tokens, mask, B = self.prepare(prompts)
        if self.sharding is not None:
            rows = self.sharding.named(("batch", None))
            tokens, mask = jax.device_put(tokens, rows), jax.device_put(mask, rows)
        return self._fn(params, tokens, mask, rng), B * self.sampling.num_samples

    def __call__(self, params, prompts: Sequence[Sequence[int]], rng: jax.Array) -> Rollout:
        """Rollout of numpy arrays over exactly len(prompts) * G rows."""
        out, n = self.run(params, prompts, rng)
        out = jax.device_get(out)
        return Rollout(*(np.asarray(a)[:n] if np.ndim(a) else np.asarray(a) for a in out))

    def sample(self, params, prompts: Sequence[Sequence[int]], key: jax.Array,
               max_prompts: int = 0) -> Rollout:
        """A Rollout of numpy arrays over exactly len(prompts) * G rows, on
        every host (the rollout-engine entry point, `rollout.engine`).

        max_prompts > 0 samples at most that many prompts per call (chunk c
        uses the key fold_in(key, c)), bounding the KV cache to
        max_prompts * G rows; chunks are joined with their prompts
        left-padded to one width. `last_stats` then holds the decode steps
        the calls ran and their token-slot utilisation.
        """
        from erpo_jax.runtime.distributed import to_host
        chunks = ([(prompts, key)] if max_prompts <= 0 or len(prompts) <= max_prompts else
                  [(prompts[i:i + max_prompts], jax.random.fold_in(key, c))
                   for c, i in enumerate(range(0, len(prompts), max_prompts))])
        parts, slot_steps = [], 0
        for chunk, k in chunks:
            out, n = self.run(params, chunk, k)
            rows = out.lengths.shape[0]
            out = to_host(out)
            out = Rollout(*(a[:n] if np.ndim(a) else a for a in out))
            slot_steps += rows * max(int(out.num_steps) - 1, 0)
            parts.append(out)
        out = parts[0] if len(parts) == 1 else join_rollouts(parts, self.sampling.pad_id)
        self.last_stats = rollout_stats(out.lengths, sum(max(int(p.num_steps) - 1, 0)
                                                         for p in parts), slot_steps)
        return out


def rollout_stats(lengths: np.ndarray, decode_steps: int, slot_steps: int) -> dict:
    """What a rollout cost: decode steps run (forward passes after each
    sample's first token, which comes from the prefill), and token-slot
    utilisation, the tokens those steps sampled over the row slots they ran
    (slots x steps); with both counts, so the statistics of several
    rollouts add up (`dynamic_sampling.engine_stats`)."""
    useful = int(np.maximum(np.asarray(lengths) - 1, 0).sum())
    return {"decode_steps": int(decode_steps),
            "slot_utilization": useful / slot_steps if slot_steps else 1.0,
            "slot_steps": int(slot_steps), "useful_tokens": useful}


def join_rollouts(parts: Sequence[Rollout], pad_id: int) -> Rollout:
    """numpy Rollouts of several calls as one, their prompts left-padded to
    one width; num_steps is the largest."""
    width = max(p.prompt_tokens.shape[1] for p in parts)

    def left_pad(a, fill):
        return np.pad(a, ((0, 0), (width - a.shape[1], 0)), constant_values=fill)

    parts = [p._replace(prompt_tokens=left_pad(p.prompt_tokens, pad_id),
                        prompt_mask=left_pad(p.prompt_mask, False)) for p in parts]
    joined = {f: np.concatenate([getattr(p, f) for p in parts])
              for f in Rollout._fields if f != "num_steps"}
    return Rollout(**joined, num_steps=max(int(p.num_steps) for p in parts))
