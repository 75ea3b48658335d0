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
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding

NEG_INF = -1e30  # finite, so fully masked (padding) rows give a uniform softmax, not NaN


class KVCache(NamedTuple):
    """Preallocated keys and values for all layers.

    k, v: [L, B, S, N, K] in the compute dtype; valid: bool[B, S] (slot holds a
    real token); index: int32[] next slot to write.
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
    dtype = dtype or cfg.jnp_compute_dtype
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((batch, length), bool), jnp.zeros((), jnp.int32))


# ----------------------------------------------------------------------------- pieces


def _param(module: nn.Module, name: str, shape, logical, init, cfg: ModelConfig):
    return module.param(name, nn.with_logical_partitioning(init, logical), shape,
                        cfg.jnp_param_dtype)


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
    def __call__(self, x, cos, sin, bias, layer_cache, cache_index):
        cfg, dt = self.cfg, self.cfg.jnp_compute_dtype
        D, H, N, K = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = nn.initializers.normal(0.02)
        wq = _param(self, "q_proj", (D, H, K), ("embed", "heads", "head_dim"), init, cfg)
        wk = _param(self, "k_proj", (D, N, K), ("embed", "kv_heads", "head_dim"), init, cfg)
        wv = _param(self, "v_proj", (D, N, K), ("embed", "kv_heads", "head_dim"), init, cfg)
        wo = _param(self, "o_proj", (H, K, D), ("heads", "head_dim", "embed"), init, cfg)
        q = jnp.einsum("btd,dhk->bthk", x, wq.astype(dt))
        k = jnp.einsum("btd,dnk->btnk", x, wk.astype(dt))
        v = jnp.einsum("btd,dnk->btnk", x, wv.astype(dt))
        if cfg.qkv_bias:
            zeros = nn.initializers.zeros
            q = q + _param(self, "q_bias", (H, K), ("heads", "head_dim"), zeros, cfg).astype(dt)
            k = k + _param(self, "k_bias", (N, K), ("kv_heads", "head_dim"), zeros, cfg).astype(dt)
            v = v + _param(self, "v_bias", (N, K), ("kv_heads", "head_dim"), zeros, cfg).astype(dt)
        if cfg.qk_norm:
            q = RMSNorm(cfg, K, name="q_norm")(q)
            k = RMSNorm(cfg, K, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if layer_cache is not None:
            # Write this layer's new keys/values into the all-layer cache in
            # place and read the layer back; the cache is a scan carry, so no
            # per-step copy of the whole cache (see Transformer.hidden).
            ck, cv, layer = layer_cache
            at = (layer, 0, cache_index, 0, 0)
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype)[None], at)
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype)[None], at)
            k = jax.lax.dynamic_index_in_dim(ck, layer, keepdims=False)
            v = jax.lax.dynamic_index_in_dim(cv, layer, keepdims=False)
            new_cache = (ck, cv, layer)
        else:
            new_cache = None
        if self.sharding is not None:
            q = self.sharding.constrain(q, ("batch", "length", "act_heads", None))
            k = self.sharding.constrain(k, ("batch", "cache_length", "act_kv_heads", None))
            v = self.sharding.constrain(v, ("batch", "cache_length", "act_kv_heads", None))

        B, T = q.shape[:2]
        qg = q.reshape(B, T, N, H // N, K)
        scores = jnp.einsum("btngk,bsnk->bngts", qg, k.astype(dt),
                            preferred_element_type=jnp.float32) * (K ** -0.5)
        probs = jax.nn.softmax(scores + bias[:, None, None], axis=-1).astype(dt)
        out = jnp.einsum("bngts,bsnk->btngk", probs, v.astype(dt)).reshape(B, T, H, K)
        return jnp.einsum("bthk,hkd->btd", out, wo.astype(dt)), new_cache


class MLP(nn.Module):
    cfg: ModelConfig
    sharding: Sharding | None = None

    @nn.compact
    def __call__(self, x):
        cfg, dt = self.cfg, self.cfg.jnp_compute_dtype
        D, F = cfg.hidden_size, cfg.intermediate_size
        init = nn.initializers.normal(0.02)
        wg = _param(self, "gate_proj", (D, F), ("embed", "mlp"), init, cfg)
        wu = _param(self, "up_proj", (D, F), ("embed", "mlp"), init, cfg)
        wd = _param(self, "down_proj", (F, D), ("mlp", "embed"), init, cfg)
        h = jax.nn.silu(x @ wg.astype(dt)) * (x @ wu.astype(dt))
        if self.sharding is not None:
            h = self.sharding.constrain(h, ("batch", "length", "act_mlp"))
        return h @ wd.astype(dt)


class Block(nn.Module):
    """One pre-norm decoder layer; the scan body.

    carry = (x, cache): hidden states and either None or (k [L,B,S,N,K],
    v [L,B,S,N,K], layer int32[]). The whole cache rides in the carry and is
    updated in place at [layer, :, cache_index]: scanning it as per-layer xs/ys
    would make XLA copy every layer's cache on every decode step.
    """

    cfg: ModelConfig
    sharding: Sharding | None = None

    @nn.compact
    def __call__(self, carry, cos, sin, bias, cache_index):
        cfg = self.cfg
        x, layer_cache = carry
        h, new_cache = Attention(cfg, self.sharding, name="attn")(
            RMSNorm(cfg, cfg.hidden_size, name="input_norm")(x), cos, sin, bias, layer_cache,
            cache_index)
        x = x + h
        x = x + MLP(cfg, self.sharding, name="mlp")(
            RMSNorm(cfg, cfg.hidden_size, name="post_attn_norm")(x))
        if self.sharding is not None:
            x = self.sharding.constrain(x, ("batch", "length", "act_embed"))
        if new_cache is not None:
            new_cache = (new_cache[0], new_cache[1], new_cache[2] + 1)
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

    def hidden(self, tokens, positions, attn_mask, cache: KVCache | None):
        """Final-normed hidden states [B, T, D] and the updated cache."""
        cfg = self.cfg
        x = jnp.take(self.embedding, tokens, axis=0).astype(cfg.jnp_compute_dtype)
        if self.sharding is not None:
            x = self.sharding.constrain(x, ("batch", "length", "act_embed"))
        cos, sin = rope_tables(cfg, positions)
        T = tokens.shape[1]
        mask = attn_mask.astype(bool)
        if cache is None:
            q_slot = jnp.arange(T)
            key_valid = mask
            layer_caches, index = None, jnp.zeros((), jnp.int32)
        else:
            index = cache.index
            q_slot = index + jnp.arange(T)
            key_valid = jax.lax.dynamic_update_slice(cache.valid, mask, (0, index))
            layer_caches = (cache.k, cache.v, jnp.zeros((), jnp.int32))
        k_slot = jnp.arange(key_valid.shape[1])
        allowed = (k_slot[None, :] <= q_slot[:, None])[None] & key_valid[:, None, :]
        bias = jnp.where(allowed, 0.0, NEG_INF).astype(jnp.float32)  # [B, T, S]
        (x, new_layer_caches), _ = self.layers((x, layer_caches), cos, sin, bias, index)
        x = self.final_norm(x)
        new_cache = None
        if cache is not None:
            new_cache = KVCache(new_layer_caches[0], new_layer_caches[1], key_valid, index + T)
        return x, new_cache

    def logits(self, h):
        """float32 logits for hidden states h [..., D] -> [..., V]."""
        w = self.embedding.T if self.cfg.tie_word_embeddings else self.lm_head
        return jnp.matmul(h, w.astype(h.dtype), preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions, attn_mask, cache=None):
        h, cache = self.hidden(tokens, positions, attn_mask, cache)
        return self.logits(h), cache


# ----------------------------------------------------------------------------- pure API


def positions_from_mask(attn_mask: jax.Array) -> jax.Array:
    """int32[B, T] positions for a left-padded batch: 0 at each row's first real token."""
    m = attn_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


@functools.lru_cache(maxsize=None)
def _module(cfg: ModelConfig, sharding: Sharding | None) -> Transformer:
    return Transformer(cfg, sharding)


def forward(params, cfg: ModelConfig, tokens, positions=None, attn_mask=None,
            cache: KVCache | None = None, sharding: Sharding | None = None):
    """Logits float32[B, T, V] and the updated cache (None without a cache).

    tokens: int32[B, T]; positions: int32[B, T] (default: from the mask);
    attn_mask: [B, T], 1 for real tokens (default: all ones).
    """
    if attn_mask is None:
        attn_mask = jnp.ones(tokens.shape, bool)
    if positions is None:
        positions = positions_from_mask(attn_mask)
    return _module(cfg, sharding).apply({"params": params}, tokens, positions, attn_mask, cache)


def hidden_states(params, cfg: ModelConfig, tokens, positions=None, attn_mask=None,
                  cache: KVCache | None = None, sharding: Sharding | None = None):
    """Final-normed hidden states [B, T, D] (compute dtype) and the updated cache."""
    if attn_mask is None:
        attn_mask = jnp.ones(tokens.shape, bool)
    if positions is None:
        positions = positions_from_mask(attn_mask)
    return _module(cfg, sharding).apply({"params": params}, tokens, positions, attn_mask, cache,
                                        method=Transformer.hidden)


def head_logits(params, cfg: ModelConfig, h, sharding: Sharding | None = None):
    """float32 logits [..., V] from hidden states [..., D]."""
    return _module(cfg, sharding).apply({"params": params}, h, method=Transformer.logits)


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
    if sharding is None:
        return jax.jit(init)(rng)
    return jax.jit(init, out_shardings=param_shardings(cfg, sharding))(rng)
