"""The `static` rollout engine: a call's prompts prefill once together, then
their G continuations each decode until the longest of the call ends.

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

Tokens are chosen by `choice.choose`, under the log-probability convention
and the keys of `types`: row r's key is fold_in(rng, r); with method
'inverse_cdf' it draws the row's N uniforms at once, before the decode loop.

Compilation. The jitted function is specialised on (B, P) and the static
configs; `StaticEngine` buckets P to powers of two and pads B to a multiple
of the data-parallel size (`prompts`), so an RL run compiles a handful of
shapes.

Donation. The KV cache is created, grown and dropped inside the one jitted
call: the while_loop carries it, so XLA updates it in place and it never
crosses the jit boundary; there is no argument left worth donating (the
prompts are a few KB).

Memory. The engine makes one per-layer copy of the layer weights per call
(`model.unstack_layers`), so while it runs the policy's layer parameters are
held twice; in exchange no decode step copies weights.

Sharding of a decode step (on a mesh). The weights stay where they are
(FSDP- and tensor-sharded) and the activations move: the dense layers run
under `Sharding.weight_stationary`, so each chip multiplies its own weight
shard by every row's hidden state (the contraction's partial sums are
reduced across chips: a few MB per layer for a few hundred rows), and each
row attends on the chip that holds its KV cache. The LM head is a copy made
once per call, split on the vocabulary over every chip (`head.decode_head`);
its logits go back to their rows' chips for sampling. Under the training
rules a decode step would all-gather every FSDP-sharded weight instead, the
whole model per token (on a v5e-16, 15 GiB of bfloat16 per chip and step
for a 7B model, per `erpo plan`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

from erpo_jax.runtime import xla_options
from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding, platform as platform_of
from erpo_jax.rollout.choice import choose
from erpo_jax.rollout.head import decode_head, decode_head_axes, head_choose, head_logits
from erpo_jax.rollout.prompts import batch_shape, prepare_prompts
from erpo_jax.rollout.types import (DecodeLoop, EngineProgram, Rollout, SamplingConfig,
                                    join_rollouts, rollout_stats)


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


def _record(state: SamplerState, tok: jax.Array, logp: jax.Array,
            sc: SamplingConfig) -> SamplerState:
    """Record token `state.step` (tok int32[R], its logp float32[R], drawn by
    `choose` or `head_choose`) for every row not yet done, and advance."""
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


def decode_step(params, s: SamplerState, cfg: ModelConfig, sc: SamplingConfig,
                sharding: Sharding | None = None, head: jax.Array | None = None) -> SamplerState:
    """One step of the decode loop: feed the last sampled token, sample the next
    (params: per-layer, as `model.unstack_layers` returns them; head: from
    `decode_head`, default made here). See the module docstring for its
    sharding."""
    head = decode_head(params, cfg, sharding) if head is None else head
    last = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)     # [R, 1]
    stationary = model_lib.decode_sharding(cfg, sharding)
    h, cache = model_lib.hidden_states(params, cfg, last, s.positions[:, None],
                                       jnp.ones_like(last, bool), cache=s.cache,
                                       sharding=stationary)
    s = dataclasses.replace(s, cache=cache, positions=s.positions + 1)
    tok, logp = head_choose(h[:, 0], head, s.rng, s.uniforms, s.step, sc, cfg, sharding,
                            platform_of(sharding))
    return _record(s, tok, logp, sc)


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
                         f"size {sharding.data_size}; pad the batch (StaticEngine does).")
    constrain = (lambda x, axes: sharding.constrain(x, axes)) if sharding else (lambda x, axes: x)
    prompt_mask = prompt_mask.astype(bool)

    # Per-layer weight buffers in the compute dtype, made once here so the
    # decode loop neither slices the stacked [L, ...] arrays nor reads and
    # casts float32 weights every step (model.unstack_layers,
    # model.in_compute_dtype: the same numbers).
    params = model_lib.decode_layout(
        model_lib.unstack_layers(model_lib.in_compute_dtype(params, cfg)), cfg, sharding)
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
    state = _record(state, *choose(logits, state.rng, state.uniforms, state.step, sc,
                                   platform_of(sharding)), sc)

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


class StaticEngine:
    """The `static` rollout engine (`types.Engine`): validates token-id
    prompts, pads them to a length bucket, runs the jitted sampler and
    returns numpy arrays.

    engine = StaticEngine(cfg, SamplingConfig(max_new_tokens=256, num_samples=8,
                                              eos_ids=(eos,)), sharding)
    out = engine(params, [[1, 2, 3], [4, 5]], rollout_key(seed_key, step))
    out.response_tokens  # int32[2 * 8, 256]

    `num_traces` counts how often the jitted function was traced. A call's
    rows are prefilled together and decode until the last of them ends.
    """

    name = "static"

    def __init__(self, cfg: ModelConfig, sampling: SamplingConfig,
                 sharding: Sharding | None = None):
        self.cfg, self.sampling, self.sharding = cfg, sampling, sharding
        self.num_traces = 0
        self.last_stats: dict = {}
        self._fn = make_sample_fn(cfg, sampling, sharding, on_trace=self._count_trace)

    @classmethod
    def from_config(cls, cfg: ModelConfig, sampling: SamplingConfig, sharding: Sharding | None,
                    rollout, rows_per_call: int) -> StaticEngine:
        """The engine of a run (`types.Engine.from_config`): no setting of its
        own beyond the sampling."""
        return cls(cfg, sampling, sharding)

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

        def unstacked(path, a):   # a stacked [L, ...] leaf's per-layer slice: spec minus L,
            spec = model_lib.decode_weight_spec(                     # in the decode layout
                path, jax.sharding.PartitionSpec(*tuple(a.sharding.spec)[1:]), cfg, sh)
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype,
                                        sharding=jax.sharding.NamedSharding(sh.mesh, spec))

        # The loop's loop-invariant inputs, as `sample_rollout` makes them: the
        # weights in the compute dtype, one subtree per layer, and the head.
        cd, L, Nk, K = cfg.jnp_compute_dtype, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        narrowed = jax.eval_shape(lambda p: model_lib.in_compute_dtype(p, cfg), params)
        params = jax.tree_util.tree_map(   # eval_shape drops the shardings: put them back
            lambda a, n: jax.ShapeDtypeStruct(a.shape, n.dtype, sharding=a.sharding),
            params, narrowed)
        layer = jax.tree_util.tree_map_with_path(unstacked, params["layers"])
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

    # ------------------------------------------------------------------ plan

    def step_programs(self, params, num_prompts: int, longest_prompt: int,
                      max_prompts: int = 0, brief: bool = False) -> list[EngineProgram]:
        """The one program of a call of max_prompts prompts (num_prompts when
        0) whose longest has longest_prompt tokens: the prefill and the decode
        loop, one `DecodeLoop` per cache phase (`cache_phases`,
        `lower_decode_step`), every row running to max_new_tokens. brief
        changes nothing: a call is one program."""
        per_call = max_prompts or num_prompts
        B, P = self.batch_shape(per_call, longest_prompt)
        G, N = self.sampling.num_samples, self.sampling.max_new_tokens
        phases = self.cache_phases(per_call, longest_prompt)
        loops = tuple(DecodeLoop(f"cache {L}", B * G, L, n, lambda L=L: self.lower_decode_step(
                          params, per_call, longest_prompt, cache_length=L), j == len(phases) - 1)
                      for j, (L, n) in enumerate(phases))
        return [EngineProgram("", f"{B} prompts x {G} samples, {P} prompt + {N} new tokens",
                              lambda: self.lower(params, per_call, longest_prompt), B * G,
                              B * G * (P + N), loops)]

    def plan_estimate(self, lengths, num_prompts: int, longest_prompt: int, max_prompts: int,
                      run_ms, step_ms, step_cost=None, roofline_ms=None,
                      prompt_lengths=None) -> dict | None:
        """`erpo plan`'s rollout time (`types.Engine.plan_estimate`): each call
        of max_prompts prompts, in sample order, runs its program once (the
        prefill, and each phase's loop body once) plus, for its longest
        response, one decode step per token after the first, each on its
        cache phase's step."""
        lengths = np.asarray(lengths)
        per_prompt = max_prompts or num_prompts
        per_call = per_prompt * self.sampling.num_samples
        call = run_ms("")
        phases = [(n, step_ms(f"cache {L}")) for L, n in self.cache_phases(per_prompt,
                                                                           longest_prompt)]
        if call is None or any(ms is None for _, ms in phases):
            return None
        total, steps = 0.0, 0
        for i in range(0, lengths.size, per_call):
            left = int(lengths[i:i + per_call].max()) - 1
            steps += left
            total += call
            for n, ms in phases:
                k = min(left, n)
                total += k * ms
                left -= k
        useful = int((lengths - 1).sum())
        return {"decode_steps": steps, "slot_utilization": useful / (per_call * steps),
                "estimated_ms": total, "rows_per_call": per_call,
                "calls": -(-lengths.size // per_call),
                "static_steps_check": static_steps(lengths, per_call)}


def static_steps(lengths: Sequence[int], rows_per_call: int) -> int:
    """The decode steps the static engine runs for samples of these lengths
    in calls of `rows_per_call` rows: each call runs to its longest."""
    lengths = np.asarray(lengths, np.int64)
    return int(sum(max(int(lengths[i:i + rows_per_call].max()) - 1, 0)
                   for i in range(0, lengths.size, rows_per_call)))
