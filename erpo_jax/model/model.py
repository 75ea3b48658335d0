"""A decoder-only transformer covering Llama 3, Qwen2/2.5 and Qwen3, in Flax.

Einsum letters: B batch, T query time, S key time (cache slots), D embed,
H query heads, N kv heads, G query heads per kv head, K head_dim, F mlp,
V vocab, L layers.

Everything jitted is a pure function of a parameter pytree: `forward(params,
cfg, ...)`. The policy and the reference are two pytrees of this one function.

Attention masking. Sequences are left-padded; `attn_mask[b, t]` is 1 for real
tokens. Every sequence shares one time axis of *slots*: a token written at
slot s may attend to key slots <= s whose mask is 1. Prefill and one-token
decode are the same code: with a `KVCache`, the T new tokens are written at
slots [cache.index, cache.index + T) and attend to everything cached so far.

Two ways through the layers. `nn.scan` over the stacked [L, ...] parameters
compiles one layer whatever the depth; unrolled, the layers run one after
another on per-layer slices. `ModelConfig.scan_layers` picks (default: scan
above 4 layers). Unrolled is faster where the model is small and shallow: the
scan stacks each layer's saved activations into [L, ...] buffers for the
backward pass (measured on the CPU: 19% of a 2-layer 0.1M model's gradient).
At 6 layers and 25M parameters it no longer pays: the unrolled forward over
256 x 384 tokens was 17% slower and peaked at 1.8x the memory. The cached
path (sampling) is always unrolled, on per-layer caches: each layer's cache
is its own buffer, updated in place by the decode loop, and with
`unstack_layers(params)` hoisted out of that loop each layer's weights are
separate buffers too. Slicing layer l out of a stacked array
inside a decode loop costs a copy of those weights per step on the CPU
backend (measured: a quarter of a 25M model's decode step). Every path
applies the same `Block` module to the same parameters.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from erpo_jax.runtime import xla_options
from erpo_jax.model import attention, paged_attention
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.dense import dense
from erpo_jax.model.sharding import Sharding, platform as platform_of

NEG_INF = -1e30  # finite, so fully masked (padding) rows give a uniform softmax, not NaN


class KVCache(NamedTuple):
    """Preallocated keys and values, one buffer per layer.

    k: tuple of L arrays [B, N, K, S], v: tuple of L arrays [B, N, S, K], in
    the compute dtype. Head-major, so attention reads them without a
    transpose; keys slot-minor, so one-token decode's scores reduce over K
    with the S slots as the vector lanes (measured on the CPU: a 25M model's
    rollout, 128 rows x 191 slots, 8% faster than with slot-major keys).
    valid: bool[B, S] (slot holds a real token); index: int32[] next slot to
    write, the same for every row. A cache read as a set (`hidden_states`
    with causal_cache=False) lets its rows hold their tokens in any order:
    the continuous rollout engine writes each step's keys at one shared slot
    while each row's sample is at its own step, and marks in `valid` which
    entries are its sample's.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array
    index: jax.Array

    def map_kv(self, fn) -> "KVCache":
        """The cache with fn(buffer, logical axes) applied to every k and v buffer."""
        return self._replace(k=tuple(fn(a, K_CACHE_AXES) for a in self.k),
                             v=tuple(fn(a, V_CACHE_AXES) for a in self.v))


class PagedLayer(NamedTuple):
    """One layer's paged KV cache in a decode step (`decode_paged`): kv_pages
    [pages, page_size, 2 * N, K] (keys and values interleaved, see
    paged_attention.py), the slots' page tables int32[S, pages per
    slot] and lengths int32[S] before this step, and which slots are live."""

    kv_pages: jax.Array
    table: jax.Array
    kv_len: jax.Array
    live: jax.Array
    impl: str


# Logical axes of one layer's key and value buffers.
K_CACHE_AXES = ("rows", "act_kv_heads", None, "cache_length")
V_CACHE_AXES = ("rows", "act_kv_heads", "cache_length", None)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
    dtype = dtype or cfg.jnp_compute_dtype
    N, K = cfg.num_kv_heads, cfg.head_dim
    zeros = lambda shape: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVCache(zeros((batch, N, K, length)), zeros((batch, N, length, K)),
                   jnp.zeros((batch, length), bool), jnp.zeros((), jnp.int32))


# ----------------------------------------------------------------------------- pieces


def _param(module: nn.Module, name: str, shape, logical, init, cfg: ModelConfig):
    return module.param(name, nn.with_logical_partitioning(init, logical), shape,
                        cfg.jnp_param_dtype)


def _adapter(module: nn.Module, name: str, x, w_shape, logical, n_in: int, cfg: ModelConfig,
             mm):
    """The low-rank update (x . A) . (s B) of projection `name` (model/lora.py),
    or None when it carries no adapter. A [*in, r] and B [r, *out] are float32
    parameters of `module` beside the kernel, sharded as its input and output
    axes; they are cast to the compute dtype for the two matmuls."""
    if name not in cfg.lora_target_names:
        return None
    from erpo_jax.model import lora
    r, dt = cfg.lora_rank, cfg.jnp_compute_dtype
    a = module.param(name + lora.A_SUFFIX, nn.with_logical_partitioning(
        lora.a_init, tuple(logical[:n_in]) + (None,)), tuple(w_shape[:n_in]) + (r,), jnp.float32)
    b = module.param(name + lora.B_SUFFIX, nn.with_logical_partitioning(
        nn.initializers.zeros, (None,) + tuple(logical[n_in:])), (r,) + tuple(w_shape[n_in:]),
        jnp.float32)
    xa = mm(x, a.astype(dt), n_in)
    return dense(xa, (b * lora.scale(cfg)).astype(dt), 1, platform=getattr(mm, "keywords",
                                                                            {}).get("platform"))


def _project(module: nn.Module, name: str, x, w, logical, n_in: int, cfg: ModelConfig, mm):
    """x . W over W's first n_in axes, plus projection `name`'s adapter update."""
    y = mm(x, w.astype(cfg.jnp_compute_dtype), n_in)
    d = _adapter(module, name, x, w.shape, logical, n_in, cfg, mm)
    return y if d is None else y + d


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype) -> jax.Array:
    """RMSNorm computed in float32, as HF does, then scaled in the compute dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return xf.astype(dtype) * weight.astype(dtype)


class RMSNorm(nn.Module):
    cfg: ModelConfig
    dim: int
    logical: str = "act_embed"

    @nn.compact
    def __call__(self, x):
        w = _param(self, "scale", (self.dim,), (None,), nn.initializers.ones, self.cfg)
        return rms_norm(x, w, self.cfg.rms_norm_eps, self.cfg.jnp_compute_dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """float32[K/2] inverse frequencies, with linear or llama3 scaling."""
    k = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k))
    sc = cfg.rope_scaling
    if sc.kind == "linear":
        inv = inv / sc.factor
    elif sc.kind == "llama3":
        low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
        high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
        wavelen = 2 * jnp.pi / inv
        smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
            sc.high_freq_factor - sc.low_freq_factor)
        scaled = jnp.where(wavelen > low_wavelen, inv / sc.factor, inv)
        mid = (1 - smooth) * scaled / sc.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = jnp.where(is_mid, mid, scaled)
    return inv


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin: float32[B, T, K] for rotate-half RoPE."""
    freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, heads, K]; rotate-half convention (HF's)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rot * sin[:, :, None, :]
    return out.astype(x.dtype)


class Attention(nn.Module):
    cfg: ModelConfig
    sharding: Sharding | None = None

    @nn.compact
    def __call__(self, x, cos, sin, bias, layer_cache, cache_index, prefix=None,
                 kv_out: bool = False):
        """Attention output [B, T, D] and the updated cache (None without one;
        with kv_out, this call's own keys and values [B, T, N, K] instead).

        prefix: None, or keys and values [B, Sp, N, K] (after RoPE) of Sp
        earlier slots that every query sees ahead of this call's own T
        (cacheless only; bias is then [B, T, Sp + T]): how the responses of
        a group attend to the query run once for the group
        (`hidden_states_grouped`)."""
        cfg, dt = self.cfg, self.cfg.jnp_compute_dtype
        D, H, N, K = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = nn.initializers.normal(0.02)
        plat = platform_of(self.sharding)
        mm = functools.partial(dense, platform=plat)
        q_ax, kv_ax = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        o_ax = ("heads", "head_dim", "embed")
        wq = _param(self, "q_proj", (D, H, K), q_ax, init, cfg)
        wk = _param(self, "k_proj", (D, N, K), kv_ax, init, cfg)
        wv = _param(self, "v_proj", (D, N, K), kv_ax, init, cfg)
        wo = _param(self, "o_proj", (H, K, D), o_ax, init, cfg)
        q = _project(self, "q_proj", x, wq, q_ax, 1, cfg, mm)
        k = _project(self, "k_proj", x, wk, kv_ax, 1, cfg, mm)
        v = _project(self, "v_proj", x, wv, kv_ax, 1, cfg, mm)
        out_proj = lambda o: _project(self, "o_proj", o, wo, o_ax, 2, cfg, mm)
        if layer_cache is not None and (prefix is not None or kv_out):
            raise ValueError("Attention: prefix and kv_out are for the cacheless pass only.")
        if layer_cache is not None and self.sharding is not None:
            # Projected where x is (under a weight-stationary decode: every
            # row on every chip, the contraction's partial sums reduced), not
            # where the cache is: that would gather the weights instead.
            c = self.sharding.constrain
            q = c(q, ("batch", "length", "act_heads", None))
            k, v = (c(a, ("batch", "length", "act_kv_heads", None)) for a in (k, v))
        if cfg.qkv_bias:
            zeros = nn.initializers.zeros
            q = q + _param(self, "q_bias", (H, K), ("heads", "head_dim"), zeros, cfg).astype(dt)
            k = k + _param(self, "k_bias", (N, K), ("kv_heads", "head_dim"), zeros, cfg).astype(dt)
            v = v + _param(self, "v_bias", (N, K), ("kv_heads", "head_dim"), zeros, cfg).astype(dt)
        if cfg.qk_norm:
            q = RMSNorm(cfg, K, name="q_norm")(q)
            k = RMSNorm(cfg, K, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        constrain = self.sharding.constrain if self.sharding is not None else lambda x, _: x
        if isinstance(layer_cache, PagedLayer):
            c = layer_cache
            rows = lambda a, heads: constrain(a[:, 0], ("rows", heads, None))
            out, pages = paged_attention.decode(
                rows(q, "act_heads"), rows(k, "act_kv_heads"), rows(v, "act_kv_heads"),
                c.kv_pages, c.table, c.kv_len, c.live, sharding=self.sharding, impl=c.impl)
            out = constrain(out[:, None], ("batch", "length", "act_heads", None))
            return out_proj(out), pages
        if layer_cache is not None:
            # This layer's buffers (keys [B, N, K, S], values [B, N, S, K]):
            # write the T new keys/values at cache_index in place and attend
            # over all S slots.
            ck, cv = layer_cache
            ck = jax.lax.dynamic_update_slice(ck, k.transpose(0, 2, 3, 1).astype(ck.dtype),
                                              (0, 0, 0, cache_index))
            cv = jax.lax.dynamic_update_slice(cv, v.transpose(0, 2, 1, 3).astype(cv.dtype),
                                              (0, 0, cache_index, 0))
            k, v = constrain(ck, K_CACHE_AXES), constrain(cv, V_CACHE_AXES)
            new_cache, ks, vs = (k, v), "bnks", "bnsk"
            # Each row attends on the chip that holds its cache; under a
            # weight-stationary decode ("batch" not split like "rows") the
            # queries go to those chips and the outputs come back.
            rows = "rows"
            back = lambda o: constrain(o, ("batch", "length", "act_heads", None))
        else:
            new_cache = (k, v) if kv_out else None
            if prefix is not None:
                k = jnp.concatenate([prefix[0].astype(k.dtype), k], axis=1)
                v = jnp.concatenate([prefix[1].astype(v.dtype), v], axis=1)
            k = constrain(k, ("batch", "length", "act_kv_heads", None))
            v = constrain(v, ("batch", "length", "act_kv_heads", None))
            ks, vs = "bsnk", "bsnk"
            rows, back = "batch", lambda o: o
        q = constrain(q, (rows, "length", "act_heads", None))

        B, T = q.shape[:2]
        qg = q.reshape(B, T, N, H // N, K)
        if T == 1 and layer_cache is not None and plat == "cpu":
            # One-token decode on the CPU, in float32: the scores reduce over K
            # with the slot-minor keys' S slots as vector lanes. Measured:
            # [G, K] x [K, S] products on slot-major keys decoded 4x slower
            # (512 rows x 383 slots), a multiply-reduce on them 10% slower
            # (128 rows x 191 slots).
            f32 = jnp.float32
            scores = jnp.einsum("bngk,bnks->bngs", qg[:, 0].astype(f32),
                                k.astype(f32))[:, :, :, None] * (K ** -0.5)   # [B, N, G, 1, S]
            probs = jax.nn.softmax(scores + bias[:, None, None], axis=-1)
            out = jnp.einsum("bngs,bnsk->bngk", probs[:, :, :, 0], v.astype(f32))
            out = out.astype(dt).reshape(B, 1, H, K)
            return out_proj(back(out)), new_cache
        if layer_cache is None and plat == "cpu":
            # Head-major operands on the CPU (see attention's module
            # docstring): one transpose each of q, k and v, and the output
            # projection reads the head-major result.
            out = attention.attend(qg.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3),
                                   v.transpose(0, 2, 1, 3), bias, "bnsk", "bnsk",
                                   jnp.dtype(dt).name, plat, "bngtk")          # [B, N, G, T, K]
            wo_h = wo.astype(dt).reshape(N, H // N, K, D)
            y = jnp.einsum("bngtk,ngkd->btd", out, wo_h)
            if "o_proj" in cfg.lora_target_names:   # the adapter reads the same layout
                head_major = lambda o, a, n: jnp.einsum("bngtk,ngkr->btr", o, a.reshape(
                    N, H // N, K, a.shape[-1]))
                y = y + _adapter(self, "o_proj", out, wo.shape, o_ax, 2, cfg, head_major)
            return y, new_cache
        out = attention.attend_blocked(qg, k, v, bias, ks, vs, jnp.dtype(dt).name, plat,
                                       attention.query_block(T, plat))
        return out_proj(back(out.reshape(B, T, H, K))), new_cache


class MLP(nn.Module):
    cfg: ModelConfig
    sharding: Sharding | None = None

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        D, F = cfg.hidden_size, cfg.intermediate_size
        init = nn.initializers.normal(0.02)
        up_ax, down_ax = ("embed", "mlp"), ("mlp", "embed")
        wg = _param(self, "gate_proj", (D, F), up_ax, init, cfg)
        wu = _param(self, "up_proj", (D, F), up_ax, init, cfg)
        wd = _param(self, "down_proj", (F, D), down_ax, init, cfg)
        mm = functools.partial(dense, platform=platform_of(self.sharding))
        h = (jax.nn.silu(_project(self, "gate_proj", x, wg, up_ax, 1, cfg, mm))
             * _project(self, "up_proj", x, wu, up_ax, 1, cfg, mm))
        if self.sharding is not None:
            h = self.sharding.constrain(h, ("batch", "length", "act_mlp"))
        return _project(self, "down_proj", h, wd, down_ax, 1, cfg, mm)


class Block(nn.Module):
    """One pre-norm decoder layer: the body of the layer scan, and what the
    cached path applies layer by layer.

    carry = (x, layer_cache): hidden states and either None or this layer's
    (k, v) buffers (see KVCache), returned updated. prefix / kv_out: see
    `Attention`; with kv_out the carry's second slot comes back as the
    layer's own (k, v).
    """

    cfg: ModelConfig
    sharding: Sharding | None = None

    @nn.compact
    def __call__(self, carry, cos, sin, bias, cache_index, prefix=None, kv_out: bool = False):
        cfg = self.cfg
        x, layer_cache = carry
        h, new_cache = Attention(cfg, self.sharding, name="attn")(
            RMSNorm(cfg, cfg.hidden_size, name="input_norm")(x), cos, sin, bias, layer_cache,
            cache_index, prefix, kv_out)
        x = x + h
        x = x + MLP(cfg, self.sharding, name="mlp")(
            RMSNorm(cfg, cfg.hidden_size, name="post_attn_norm")(x))
        if self.sharding is not None:
            x = self.sharding.constrain(x, ("batch", "length", "act_embed"))
        return (x, new_cache), None


class Transformer(nn.Module):
    cfg: ModelConfig
    sharding: Sharding | None = None

    def setup(self):
        cfg = self.cfg
        self.embedding = _param(self, "embed", (cfg.vocab_size, cfg.hidden_size),
                                ("vocab", "embed"), nn.initializers.normal(0.02), cfg)
        block = Block
        if cfg.remat:
            block = nn.remat(Block, prevent_cse=False, static_argnums=())
        self.layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg, self.sharding, name="layers")
        self.final_norm = RMSNorm(cfg, cfg.hidden_size, name="final_norm")
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size),
                                  ("embed", "vocab"), nn.initializers.normal(0.02), cfg)

    def hidden(self, tokens, positions, attn_mask):
        """Final-normed hidden states [B, T, D] of a cacheless pass (layer scan)."""
        x, cos, sin, bias, _ = _layer_inputs(self.embedding, self.cfg, self.sharding, tokens,
                                             positions, attn_mask, None)
        (x, _), _ = self.layers((x, None), cos, sin, bias, jnp.zeros((), jnp.int32))
        return self.final_norm(x)

    def logits(self, h):
        """float32 logits for hidden states h [..., D] -> [..., V] (`lm_logits`)."""
        return lm_logits(h, self.embedding.T if self.cfg.tie_word_embeddings else self.lm_head,
                         self.sharding)

    def __call__(self, tokens, positions, attn_mask):
        return self.logits(self.hidden(tokens, positions, attn_mask))


def _layer_inputs(embedding, cfg: ModelConfig, sharding: Sharding | None, tokens, positions,
                  attn_mask, cache: KVCache | None, causal_cache: bool = True):
    """What every layer takes: embedded tokens x [B, T, D], RoPE cos/sin, the
    additive attention bias float32[B, T, S], and the cache's key-valid mask
    with the new tokens written in (None without a cache). causal_cache=False:
    a query attends to every valid cache entry, wherever it lies (keys carry
    their positions in their RoPE rotation, so attention does not depend on
    the entries' order); for one-token steps, whose valid entries are all
    earlier tokens."""
    x = jnp.take(embedding, tokens, axis=0).astype(cfg.jnp_compute_dtype)
    if sharding is not None:
        x = sharding.constrain(x, ("batch", "length", "act_embed"))
    cos, sin = rope_tables(cfg, positions)
    T = tokens.shape[1]
    mask = attn_mask.astype(bool)
    if cache is None:
        q_slot, key_valid = jnp.arange(T), mask
    else:
        q_slot = cache.index + jnp.arange(T)
        key_valid = jax.lax.dynamic_update_slice(cache.valid, mask, (0, cache.index))
    if not causal_cache:
        if T != 1:
            raise ValueError(f"causal_cache=False is for one-token decode steps, got {T} tokens.")
        q_slot = jnp.full((T,), key_valid.shape[1] - 1, jnp.int32)   # every entry is allowed
    bias = _attention_bias(q_slot, key_valid)
    return x, cos, sin, bias, (None if cache is None else key_valid)


def _attention_bias(q_slot: jax.Array, key_valid: jax.Array) -> jax.Array:
    """float32[B, T, S]: 0 where the query at slot q_slot[t] may attend key
    slot s (s <= q_slot[t] and key_valid[b, s]), NEG_INF elsewhere."""
    k_slot = jnp.arange(key_valid.shape[1])
    allowed = (k_slot[None, :] <= q_slot[:, None])[None] & key_valid[:, None, :]
    return jnp.where(allowed, 0.0, NEG_INF).astype(jnp.float32)


# ----------------------------------------------------------------------------- pure API


def positions_from_mask(attn_mask: jax.Array) -> jax.Array:
    """int32[B, T] positions for a left-padded batch: 0 at each row's first real token."""
    m = attn_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


@functools.lru_cache(maxsize=None)
def _module(cfg: ModelConfig, sharding: Sharding | None) -> Transformer:
    return Transformer(cfg, sharding)


@functools.lru_cache(maxsize=None)
def _block(cfg: ModelConfig, sharding: Sharding | None) -> Block:
    return Block(cfg, sharding)


def unstack_layers(params) -> dict:
    """params with the stacked [L, ...] layer subtree replaced by a tuple of L
    per-layer subtrees (copies). Call it once, outside a decode loop, and pass
    the result to the cached `forward`/`hidden_states`: the loop then reads
    each layer's weights in place instead of slicing them every step. The
    split's gradient is one concatenation back into the stacked arrays."""
    layers = params["layers"]
    if isinstance(layers, tuple):
        return params
    leaves, treedef = jax.tree_util.tree_flatten(layers)
    n = leaves[0].shape[0]
    parts = [[p[0] for p in jnp.split(a, n, axis=0)] for a in leaves]
    return {**params, "layers": tuple(jax.tree_util.tree_unflatten(treedef, [p[l] for p in parts])
                                      for l in range(n))}


# Each MLP kernel's hidden (intermediate-size) axis, in its per-layer shape.
_MLP_HIDDEN_AXIS = {"gate_proj": 1, "up_proj": 1, "down_proj": 0}


def _hidden_split(name: str, axes) -> P:
    spec = [None, None]
    spec[_MLP_HIDDEN_AXIS[name]] = axes
    return P(*spec)


def decode_weight_spec(path, spec: P, cfg: ModelConfig, sharding: Sharding) -> P:
    """The PartitionSpec of one per-layer weight (`unstack_layers`' leaf at
    path, whose training-layout spec is spec) in the weights a decode step
    reads: the MLP kernels split their hidden axis over
    `Sharding.decode_mlp_axes` and nothing else; every other leaf keeps its
    spec. The step runs under `sharding.weight_stationary(those axes)`."""
    keys = [getattr(k, "key", None) for k in path]
    mlp = sharding.decode_mlp_axes(cfg.intermediate_size)
    if mlp is None or len(keys) < 2 or keys[-2] != "mlp" or keys[-1] not in _MLP_HIDDEN_AXIS:
        return spec
    return _hidden_split(keys[-1], mlp)


def decode_layout(params, cfg: ModelConfig, sharding: Sharding | None):
    """params (per-layer, `unstack_layers`) with the MLP kernels laid out as
    `decode_weight_spec` says, the same numbers: made once per rollout call,
    with the compute-dtype copy the decode loop reads."""
    mlp = None if sharding is None else sharding.decode_mlp_axes(cfg.intermediate_size)
    if mlp is None:
        return params

    def lay(layer):
        put = lambda name, w: jax.lax.with_sharding_constraint(
            w, NamedSharding(sharding.mesh, _hidden_split(name, mlp)))
        kernels = {k: put(k, w) for k, w in layer["mlp"].items() if k in _MLP_HIDDEN_AXIS}
        return {**layer, "mlp": {**layer["mlp"], **kernels}}

    return {**params, "layers": tuple(map(lay, params["layers"]))}


def decode_sharding(cfg: ModelConfig, sharding: Sharding | None) -> Sharding | None:
    """The rules one decode step runs under, on weights from `decode_layout`:
    weight-stationary (`Sharding.weight_stationary`), the MLP's hidden
    activations split as its kernels' hidden axis."""
    if sharding is None:
        return None
    return sharding.weight_stationary(sharding.decode_mlp_axes(cfg.intermediate_size))


def in_compute_dtype(params, cfg: ModelConfig) -> Any:
    """params with every floating-point leaf wider than the compute dtype cast
    to it (the other leaves as they are). Every use in the model casts its
    weight to the compute dtype first, so the model computes the same
    numbers from either pytree; a decode loop given this copy (made once,
    outside the loop) reads bfloat16 weights each step instead of reading
    float32 ones and casting them again."""
    from erpo_jax.model.lora import is_adapter
    dt = jnp.dtype(cfg.jnp_compute_dtype)
    # Adapters stay float32: the model scales B before its cast (`_adapter`).
    cast = lambda path, x: (x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating)
                            and x.dtype.itemsize > dt.itemsize
                            and not is_adapter(str(getattr(path[-1], "key", ""))) else x)
    return jax.tree_util.tree_map_with_path(cast, params)


def _hidden_unrolled(params, cfg: ModelConfig, tokens, positions, attn_mask,
                     cache: KVCache | None, sharding: Sharding | None,
                     causal_cache: bool = True):
    """The layers one after another (each on its own cache buffers with a
    cache); returns final-normed hidden states and the updated cache."""
    layers = unstack_layers(params)["layers"]
    if len(layers) != cfg.num_layers or (cache is not None and len(cache.k) != cfg.num_layers):
        got = "no" if cache is None else len(cache.k)
        raise ValueError(f"forward: {len(layers)} parameter layers and {got} cache layers "
                         f"for a {cfg.num_layers}-layer model.")
    x, cos, sin, bias, key_valid = _layer_inputs(params["embed"], cfg, sharding, tokens,
                                                 positions, attn_mask, cache, causal_cache)
    block = _block(cfg, sharding)
    index = jnp.zeros((), jnp.int32) if cache is None else cache.index

    def layer(lp, x, kv):
        (x, kv), _ = block.apply({"params": lp}, (x, kv), cos, sin, bias, index)
        return x, kv

    if cfg.remat and cache is None:
        layer = jax.checkpoint(layer, prevent_cse=False)
    kvs = zip(cache.k, cache.v) if cache is not None else [None] * len(layers)
    ks, vs = [], []
    for lp, kv in zip(layers, kvs):
        x, kv = layer(lp, x, kv)
        if kv is not None:
            ks.append(kv[0])
            vs.append(kv[1])
    x = rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps, cfg.jnp_compute_dtype)
    if cache is None:
        return x, None
    return x, KVCache(tuple(ks), tuple(vs), key_valid, cache.index + tokens.shape[1])


def decode_paged(params, cfg: ModelConfig, tokens, positions, pages: tuple, table, kv_len,
                 live, *, sharding: Sharding | None = None, impl: str = "auto"):
    """One decode step over a paged KV cache: tokens, positions int32[S] (one
    per slot), pages a tuple of L `PagedLayer.kv_pages` arrays, table / kv_len
    / live as `PagedLayer`'s. Returns final-normed hidden states [S, D] and
    the pages with each live slot's new key and value written at entry
    kv_len of its sequence. Weights: `unstack_layers`'s per-layer tree."""
    layers = unstack_layers(params)["layers"]
    x = jnp.take(params["embed"], tokens[:, None], axis=0).astype(cfg.jnp_compute_dtype)
    if sharding is not None:
        x = sharding.constrain(x, ("batch", "length", "act_embed"))
    cos, sin = rope_tables(cfg, positions[:, None])
    block = _block(cfg, sharding)
    out = []
    for lp, kv in zip(layers, pages):
        (x, kv), _ = block.apply({"params": lp}, (x, PagedLayer(kv, table, kv_len, live, impl)),
                                 cos, sin, None, None)
        out.append(kv)
    x = rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps, cfg.jnp_compute_dtype)
    return x[:, 0], tuple(out)


def _defaults(tokens, positions, attn_mask):
    if attn_mask is None:
        attn_mask = jnp.ones(tokens.shape, bool)
    if positions is None:
        positions = positions_from_mask(attn_mask)
    return positions, attn_mask


def forward(params, cfg: ModelConfig, tokens, positions=None, attn_mask=None,
            cache: KVCache | None = None, sharding: Sharding | None = None):
    """Logits float32[B, T, V] and the updated cache (None without a cache).

    tokens: int32[B, T]; positions: int32[B, T] (default: from the mask);
    attn_mask: [B, T], 1 for real tokens (default: all ones). With a cache,
    params may come from `unstack_layers`.
    """
    h, cache = hidden_states(params, cfg, tokens, positions, attn_mask, cache, sharding)
    return head_logits(params, cfg, h, sharding), cache


def hidden_states(params, cfg: ModelConfig, tokens, positions=None, attn_mask=None,
                  cache: KVCache | None = None, sharding: Sharding | None = None,
                  causal_cache: bool = True):
    """Final-normed hidden states [B, T, D] (compute dtype) and the updated
    cache. causal_cache=False (one-token steps): the cache is read as a set,
    every valid entry attended to wherever it lies (`KVCache`)."""
    positions, attn_mask = _defaults(tokens, positions, attn_mask)
    if cache is not None or not cfg.scans_layers:
        return _hidden_unrolled(params, cfg, tokens, positions, attn_mask, cache, sharding,
                                causal_cache)
    return _module(cfg, sharding).apply({"params": params}, tokens, positions, attn_mask,
                                        method=Transformer.hidden), None


def hidden_states_grouped(params, cfg: ModelConfig, tokens, attn_mask, *, group_size: int,
                          query_width: int, sharding: Sharding | None = None):
    """Final-normed hidden states of rows that come in groups sharing a query,
    with each group's query run once: (h_query [B/G, Q, D], h_rest [B, T-Q, D]).

    tokens, attn_mask: [B, T], B = P * group_size rows, rows g*G .. g*G+G-1
    one group whose first Q = query_width columns (tokens and mask) are the
    same: the G responses of one left-padded query, as a rollout lays them
    out. The query's Q columns go through the layers once per group (P rows);
    the other T-Q columns of every row attend to the group's query keys and
    values, repeated to the group's rows, ahead of their own. This is the
    cacheless `hidden_states` of the B rows, h[::G, :Q] and h[:, Q:], as a
    function (the same positions, masks and weights), with the query part's
    work and activations divided by G; its gradient sums each group's
    repeated keys and values back onto the one query. The caller checks that
    the rows of a group do repeat their query (`rl.batch.validate_batch`
    with `group_size`): nothing here can.

    Layers scan over stacked parameters (or run unrolled on `unstack_layers`
    output, or when `scan_layers` is off), each under `jax.checkpoint` with
    `remat`, as in `hidden_states`.
    """
    B, T = tokens.shape
    G, Q = int(group_size), int(query_width)
    if G < 1 or B % G:
        raise ValueError(f"hidden_states_grouped: {B} rows are not whole groups of "
                         f"group_size={G}.")
    if not 0 < Q < T:
        raise ValueError(f"hidden_states_grouped: query_width={Q} must be in [1, T-1={T - 1}].")
    positions, attn_mask = _defaults(tokens, None, attn_mask)
    mask = attn_mask.astype(bool)
    first = lambda a: a[::G, :Q]
    xq, cos_q, sin_q, bias_q, _ = _layer_inputs(params["embed"], cfg, sharding, first(tokens),
                                                first(positions), first(mask), None)
    xr, cos_r, sin_r, _, _ = _layer_inputs(params["embed"], cfg, sharding, tokens[:, Q:],
                                           positions[:, Q:], mask[:, Q:], None)
    bias_r = _attention_bias(Q + jnp.arange(T - Q), mask)                 # [B, T-Q, T]
    block = _block(cfg, sharding)
    zero = jnp.zeros((), jnp.int32)
    repeat = lambda a: jnp.repeat(a, G, axis=0) if G > 1 else a

    def layer(lp, xq, xr):
        (xq, kv), _ = block.apply({"params": lp}, (xq, None), cos_q, sin_q, bias_q, zero,
                                  kv_out=True)
        prefix = tuple(repeat(a) for a in kv)
        if sharding is not None:
            prefix = tuple(sharding.constrain(a, ("batch", "length", "act_kv_heads", None))
                           for a in prefix)
        (xr, _), _ = block.apply({"params": lp}, (xr, None), cos_r, sin_r, bias_r, zero,
                                 prefix=prefix)
        return xq, xr

    if cfg.remat:
        layer = jax.checkpoint(layer, prevent_cse=False)
    layers = params["layers"]
    if isinstance(layers, tuple) or not cfg.scans_layers:
        for lp in unstack_layers(params)["layers"]:
            xq, xr = layer(lp, xq, xr)
    else:
        (xq, xr), _ = jax.lax.scan(lambda c, lp: (layer(lp, *c), None), (xq, xr), layers)
    norm = lambda x: rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps,
                              cfg.jnp_compute_dtype)
    return norm(xq), norm(xr)


def head_weight(params, cfg: ModelConfig) -> jax.Array:
    """The LM head's [D, V] weight: the embedding's transpose when tied."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def head_logits(params, cfg: ModelConfig, h, sharding: Sharding | None = None):
    """float32 logits [..., V] from hidden states [..., D] (`lm_logits`)."""
    return lm_logits(h, head_weight(params, cfg), sharding)


def lm_logits(h, w, sharding: Sharding | None = None):
    """float32 logits [..., V] of final hidden states h [..., D] through the LM
    head's weight w [D, V] (`head_weight`, or a copy of it placed for its
    caller), cast to h's dtype: the one place the head is applied, for the
    model, the log-prob pass (`logprobs`) and the rollout engines
    (`rollout.head`). Shardings are the caller's."""
    return dense(h, w.astype(h.dtype), preferred_element_type=jnp.float32,
                 platform=platform_of(sharding))


def _boxed_init(cfg: ModelConfig, rng, sharding: Sharding | None = None):
    tokens = jnp.zeros((1, 1), jnp.int32)
    return _module(cfg, sharding).init(rng, tokens, tokens, tokens)["params"]


def param_logical_axes(cfg: ModelConfig) -> Any:
    """Pytree (same structure as params) of logical-axis tuples."""
    boxed = jax.eval_shape(functools.partial(_boxed_init, cfg), jax.random.key(0))
    specs = nn.get_partition_spec(boxed)
    return jax.tree_util.tree_map(lambda s: tuple(s), specs,
                                  is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def abstract_params(cfg: ModelConfig) -> Any:
    """ShapeDtypeStructs of the parameters; nothing is allocated."""
    return nn.unbox(jax.eval_shape(functools.partial(_boxed_init, cfg), jax.random.key(0)))


def param_shardings(cfg: ModelConfig, sharding: Sharding) -> Any:
    """NamedShardings of every parameter (checks divisibility with a clear error)."""
    from erpo_jax.model.sharding import tree_shardings
    return tree_shardings(param_logical_axes(cfg), abstract_params(cfg), sharding)


def init_params(cfg: ModelConfig, rng, sharding: Sharding | None = None) -> Any:
    """Random parameters, created directly in their sharding (abstract-first)."""
    init = lambda r: nn.unbox(_boxed_init(cfg, r))
    # Inside a trace (e.g. jax.eval_shape of a planning function) this jit is
    # nested, and a nested jit takes no compiler options.
    options = None if isinstance(rng, jax.core.Tracer) else xla_options.for_once()
    if sharding is None:
        return jax.jit(init, compiler_options=options)(rng)
    return jax.jit(init, out_shardings=param_shardings(cfg, sharding),
                   compiler_options=options)(rng)
