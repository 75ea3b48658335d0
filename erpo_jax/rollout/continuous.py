"""The continuous-batching rollout engine: a fixed pool of decode slots, each
finished slot refilled by the next pending (prompt, sample) pair.

The static engine (`static.StaticEngine`) prefills a call's B x G rows together
and decodes until the last of them ends, so every call costs its longest
response. Here `slots` rows decode together; a sample leaves its slot when it
ends and the next pending sample takes the slot, until all of the call's
samples are done. Each slot holds its own sample at its own step, in a KV
cache read as a set (`model.hidden_states(causal_cache=False)`): entries
[0, P) hold the slot's prompt, and decode step s writes every slot's new
key and value at the one shared entry P + s mod N, an in-place slice write
as in the static engine (a sample feeds at most N - 1 consecutive steps, so
it never meets its own earlier entries), while `valid` marks which entries
are the slot's sample's. Keys carry their positions in their RoPE rotation,
so the order of the entries does not matter.

Three jitted programs, and a host loop between them:

  start    the pool, empty, and every sample's key;
  insert   prefill the prompts the next samples need, at the shortest of a
           few lengths that holds them (`prefill_lengths`: not the whole
           bucket, which the call's longest prompt set), copy each prompt's
           keys and values into the free slots its samples take (a prompt's
           G samples share one prefill: the last prompt, whose samples may
           not all have fitted, is kept in a one-prompt stash for the next
           insert), and sample each new sample's token 0;
  decode   one-token decode steps of the whole pool in a `lax.while_loop`,
           until `refill` slots are free (or, with nothing pending, until
           every slot is done).

The host sees only which slots are live (slots booleans) after each decode
call: it never touches a token. Tokens, log-probs, lengths and EOS flags are
scattered into [R, N] buffers on the device, indexed by sample, and come
back as a `types.Rollout` in the static engine's row order.

Exactness. A sample's slot holds the static engine's prompt layout (left-
padded to the call's bucket P) and RoPE positions. Its randomness is the
static engine's: sample
r = b * G + g (chunk c's local index with `max_prompts`) has the key
fold_in(rng, r) (fold_in(fold_in(rng, c), r)), its N uniforms drawn from it
at once (method 'inverse_cdf'), or fold_in(key, t) at its own step t
('gumbel'). So whatever the pool size and the order of refills, it draws
the static engine's samples: the same samples, to float rounding (the
softmax sums run over the same keys in another order, among another number
of masked entries): the log-probs agree to rounding, and a draw can flip
where rounding moves it across a token boundary.
Tokens are chosen by `choice.choose`; the log-prob convention is the
`types` module's.

What a decode step reads. Every slot's cache has P + N entries (rounded up,
`cache_length`) and each step's attention reads all of them, masked where
invalid (the static engine's cache phases do not carry over: the slots of a
pool sit at every step at once). On TPU the step compiles to XLA's
dense attention over S slots (see experiments/BENCHMARKS.md for `erpo plan`
on it).

Sharding. Slots lie over the data axes like the static engine's rows; the
decode step is weight-stationary, as there. The per-sample output buffers
are replicated (a step scatters slots tokens into them).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding, platform as platform_of
from erpo_jax.rollout.choice import choose
from erpo_jax.rollout.head import decode_head, decode_head_axes, head_choose, head_logits
from erpo_jax.rollout.prompts import batch_shape, prepare_prompts
from erpo_jax.rollout.types import (DecodeLoop, EngineProgram, Rollout, SamplingConfig,
                                    rollout_stats)
from erpo_jax.runtime import xla_options
from erpo_jax.runtime.distributed import to_host


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Stash:
    """One prefilled prompt kept for the next insert: keys and values (tuples
    of L arrays [1, Nk, K, P] and [1, Nk, P, K]), valid bool[1, P], the
    last position's logits float32[1, V] and its real length int32[1]."""

    k: tuple
    v: tuple
    valid: jax.Array
    logits: jax.Array
    length: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PoolState:
    """The pool between programs (slots rows, R samples, N new tokens).

    cache: KVCache over the slots (index: the entry step `steps` writes);
    last: int32[slots], the
    token fed next; positions: int32[slots], its RoPE position; t:
    int32[slots], tokens its sample has so far; live: bool[slots]; sample:
    int32[slots], the slot's sample (R when empty); keys: key[slots];
    uniforms: float32[slots, N] ('inverse_cdf'; [slots, 0] otherwise);
    stash: the last prompt prefilled; tokens / logp: [R, N]; lengths:
    int32[R]; ended: bool[R], True after an EOS; sample_keys: key[R];
    steps: int32[] decode steps run; useful: int32[] tokens they sampled.
    """

    cache: model_lib.KVCache
    last: jax.Array
    positions: jax.Array
    t: jax.Array
    live: jax.Array
    sample: jax.Array
    keys: jax.Array
    uniforms: jax.Array
    stash: Stash
    tokens: jax.Array
    logp: jax.Array
    lengths: jax.Array
    ended: jax.Array
    sample_keys: jax.Array
    steps: jax.Array
    useful: jax.Array


def pool_slots(slots: int, sharding: Sharding | None, rows_per_call: int) -> int:
    """rollout.slots, or (0) rows_per_call rounded up to the data-parallel size."""
    if slots:
        return slots
    dp = sharding.data_size if sharding is not None else 1
    return -(-max(rows_per_call, 1) // dp) * dp


def sample_keys(rng: jax.Array, num_samples: int, group: int, per_call: int) -> jax.Array:
    """key[R]: sample r's key as the static engine draws it. per_call > 0:
    prompts come in calls of that many (call c keyed fold_in(rng, c)), each
    call's samples indexed from 0."""
    r = jnp.arange(num_samples, dtype=jnp.int32)
    if per_call <= 0:
        return jax.vmap(jax.random.fold_in, (None, 0))(rng, r)
    rows = per_call * group
    call_keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, r // rows)
    return jax.vmap(jax.random.fold_in)(call_keys, r % rows)


def _uniforms(keys: jax.Array, sc: SamplingConfig) -> jax.Array:
    if sc.method == "inverse_cdf" and not sc.greedy:
        return jax.vmap(lambda k: jax.random.uniform(k, (sc.max_new_tokens,)))(keys)
    return jnp.zeros((keys.shape[0], 0), jnp.float32)


def _hit_eos(tok: jax.Array, sc: SamplingConfig) -> jax.Array:
    if not sc.eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.array(sc.eos_ids, jnp.int32))


def _logical_axes(state_like: PoolState, cache_axes) -> PoolState:
    """The logical axes of every PoolState leaf (None: replicated), the
    cache's being `cache_axes`."""
    L = len(state_like.stash.k)
    slot1, slot2 = ("batch",), ("batch", None)
    rep = lambda nd: (None,) * nd
    return PoolState(
        cache=cache_axes,
        last=slot1, positions=slot1, t=slot1, live=slot1, sample=slot1, keys=slot1,
        uniforms=slot2,
        stash=Stash((rep(4),) * L, (rep(4),) * L, rep(2), rep(2), rep(1)),
        tokens=rep(2), logp=rep(2), lengths=rep(1), ended=rep(1), sample_keys=rep(1),
        steps=(), useful=())


class ContinuousEngine:
    """The `continuous` rollout engine (`types.Engine`; see the module docstring).

    engine = ContinuousEngine(cfg, SamplingConfig(max_new_tokens=256, num_samples=8,
                                                  eos_ids=(eos,)), sharding, slots=64)
    out = engine.sample(params, prompts, rollout_key(seed_key, step), max_prompts)

    slots: decode slots, a multiple of the data-parallel size. refill: free
    slots that end a decode call while samples are pending (0: slots / 16,
    at least 1). `last_stats` holds the last call's decode steps and token-slot
    utilisation; `num_traces` counts traces of its programs.
    """

    name = "continuous"
    prefill_floor = 128     # shortest prefill an insert compiles (`prefill_lengths`)

    def __init__(self, cfg: ModelConfig, sampling: SamplingConfig,
                 sharding: Sharding | None = None, slots: int = 0, refill: int = 0):
        sampling.check_model(cfg)
        dp = sharding.data_size if sharding is not None else 1
        slots = slots or 0
        if slots < 1:
            raise ValueError(f"rollout.slots is {slots}; the continuous engine needs at least "
                             "one decode slot (set rollout.slots, e.g. to the static engine's "
                             "rows per call).")
        if slots % dp:
            raise ValueError(f"rollout.slots ({slots}) is not a multiple of the data-parallel "
                             f"size {dp}: the slots lie over the data axes. Set it to "
                             f"{-(-slots // dp) * dp}.")
        self.cfg, self.sampling, self.sharding = cfg, sampling, sharding
        self.slots, self.refill = slots, refill or max(1, slots // 16)
        self.num_traces = 0
        self.last_stats: dict = {}
        self.last_inserts: dict = {}      # the last call's {(prompts, prefill length): inserts}
        self._programs: dict = {}

    @classmethod
    def from_config(cls, cfg: ModelConfig, sampling: SamplingConfig, sharding: Sharding | None,
                    rollout, rows_per_call: int) -> ContinuousEngine:
        """The engine of a run (`types.Engine.from_config`): rollout.slots
        decode slots (0: rows_per_call, the static engine's rows per call,
        rounded up to the data-parallel size) and rollout.refill."""
        return cls(cfg, sampling, sharding, slots=pool_slots(rollout.slots, sharding,
                                                             rows_per_call),
                   refill=rollout.refill)

    # ------------------------------------------------------------------ shapes

    def batch_shape(self, num_prompts: int, longest_prompt: int) -> tuple[int, int]:
        return batch_shape(self.sampling, self.sharding, num_prompts, longest_prompt)

    def prepare(self, prompts):
        return prepare_prompts(prompts, self.sampling, self.cfg.vocab_size, self.sharding)

    def _constrain(self, x, logical):
        return x if self.sharding is None else self.sharding.constrain(x, logical)

    def _named(self, logical):
        return None if self.sharding is None else self.sharding.named(logical)

    def _state_shardings(self, like: PoolState):
        if self.sharding is None:
            return None
        axes = _logical_axes(like, self._cache_axes(self.cfg.num_layers))
        return jax.tree_util.tree_map(lambda ax: self.sharding.named(ax), axes,
                                      is_leaf=lambda x: isinstance(x, tuple) and all(
                                          a is None or isinstance(a, str) for a in x))

    def _cache_axes(self, L: int) -> model_lib.KVCache:
        """The logical axes of the pool's cache (L layers)."""
        return model_lib.KVCache((model_lib.K_CACHE_AXES,) * L, (model_lib.V_CACHE_AXES,) * L,
                                 ("rows", "cache_length"), ())

    def _query_buckets(self, num_prompts: int) -> list[int]:
        """Prompt counts an insert is compiled for: 0, then the data-parallel
        size times powers of two up to what one insert can need. An insert
        into k free slots prefills at most ceil(k / G) prompts: when the next
        sample starts a prompt, its k samples span that many; when it does
        not, its prompt is the stashed one."""
        dp = self.sharding.data_size if self.sharding is not None else 1
        need = min(num_prompts, -(-self.slots // self.sampling.num_samples))
        out, q = [0], dp
        while True:
            out.append(q)
            if q >= need:
                return out
            q *= 2

    # ------------------------------------------------------------------ programs

    def _count(self):
        self.num_traces += 1

    def _program(self, name: str, R: int, P: int, per_call: int = 0, Q: int = 0,
                 n: int = 0):
        """The jitted program `name` for R samples at prompt bucket P (Q:
        prompts an insert prefills, at any of `prefill_lengths`, one trace
        each; n: the pool size, default `slots`)."""
        key = (name, R, P, per_call, Q, n or self.slots)
        if key not in self._programs:
            self._programs[key] = getattr(self, "_make_" + name)(R, P, per_call, Q,
                                                                 n or self.slots)
        return self._programs[key]

    def prefill_lengths(self, P: int) -> list[int]:
        """Lengths an insert's prefill is compiled for at prompt bucket P,
        shortest first: P and its halves down to P / 8, none shorter than
        `prefill_floor` tokens. An insert prefills its prompts (left-padded
        to P: their last T columns hold every real token) at the shortest of
        these that holds the longest of them, so the ~100-token prompts of a
        batch whose longest prompt set the bucket to 1,024 cost a prefill of
        128, not 1,024. Below the floor a prefill of a few prompts reads the
        weights more than it computes: a shorter one saves nothing and
        compiles another program."""
        out, t = [P], P // 2
        while t >= max(self.prefill_floor, P // 8, 1):
            out.insert(0, t)
            t //= 2
        return out

    def prefill_length(self, P: int, longest: int) -> int:
        """The prefill length (`prefill_lengths`) for prompts of at most
        `longest` real tokens."""
        return next(t for t in self.prefill_lengths(P) if t >= longest)

    def pool_sizes(self) -> list[int]:
        """The pool's sizes, largest first. Once nothing is pending, the pool
        halves whenever at most half its slots are live (their samples move to
        the smaller pool), down to slots / 8 and no lower than the
        data-parallel size: the drain at the end of a call decodes fewer idle
        slots."""
        dp = self.sharding.data_size if self.sharding is not None else 1
        out, n = [self.slots], self.slots
        while n % 2 == 0 and (n // 2) % dp == 0 and n // 2 >= max(1, self.slots // 8):
            n //= 2
            out.append(n)
        return out

    def schedule(self, lengths: Sequence[int], num_prompts: int,
                 prompt_lengths: Sequence[int] | None = None, P: int = 0) -> dict:
        """`schedule` of samples of these lengths with this engine's settings
        (prompt_lengths at bucket P: the inserts' prefill lengths)."""
        prefill = (None if prompt_lengths is None else
                   lambda longest: self.prefill_length(P, longest))
        return schedule(lengths, self.slots, self.refill, self.pool_sizes(),
                        self.sampling.num_samples, self._query_buckets(num_prompts),
                        prompt_lengths, prefill)

    def plan_estimate(self, lengths, num_prompts: int, longest_prompt: int, max_prompts: int,
                      run_ms, step_ms, step_cost=None, roofline_ms=None,
                      prompt_lengths=None) -> dict | None:
        """`erpo plan`'s rollout time (`types.Engine.plan_estimate`): the
        `schedule` of these lengths, its decode steps at each pool size each
        costed as one step of that pool's decode loop, its inserts at each
        prompt count each as a call of that insert program."""
        P, plen = self._plan_prompts(num_prompts, longest_prompt, prompt_lengths)
        sched = self.schedule(lengths, num_prompts, plen, P)
        step = {n: step_ms(f"decode {n}") for n in sched["steps_by_size"]}
        insert, inserts = self._costed_inserts(sched["inserts"], P, run_ms)
        if None in step.values() or insert is None:
            return None
        decode = sum(k * step[n] for n, k in sched["steps_by_size"].items())
        useful = int((np.asarray(lengths) - 1).sum())
        return {"decode_steps": sched["steps"], "slot_utilization": useful / sched["slot_steps"],
                "estimated_ms": decode + insert, "decode_ms": decode, "insert_ms": insert,
                "slots": self.slots,
                "steps_by_size": {str(k): v for k, v in sched["steps_by_size"].items()},
                "inserts": inserts, "mean_prompt_length": float(plen.mean())}

    def _plan_prompts(self, num_prompts: int, longest_prompt: int, prompt_lengths):
        """(P, real tokens of each prompt) `plan_estimate` replays: the
        bucket of the longest prompt, and prompt_lengths capped at it
        (default: every prompt longest_prompt long)."""
        _, P = self.batch_shape(num_prompts, longest_prompt)
        plen = (np.full(num_prompts, longest_prompt) if prompt_lengths is None
                else np.minimum(np.asarray(prompt_lengths), P))
        return P, plen

    @staticmethod
    def _costed_inserts(inserts: dict, P: int, run_ms) -> tuple[float | None, dict]:
        """(ms, {program name less 'insert ': calls}) of a schedule's inserts
        {(prompts, prefill length): calls}, each call costed as its program
        (`insert_part`); ms None where a program was not compiled."""
        parts = {qt: insert_part(*qt, P) for qt in inserts}
        call = {qt: run_ms(part) for qt, part in parts.items()}
        ms = None if None in call.values() else sum(k * call[qt] for qt, k in inserts.items())
        return ms, {parts[qt][len("insert "):]: k for qt, k in inserts.items()}

    def kv_entry_bytes(self) -> float:
        """Bytes of one KV entry over all layers, per chip: key and value of
        the KV heads a chip holds (all of them unless the tensor axis divides
        them), divided over the data shards' chips that hold slots."""
        heads, shards = self._kv_split()
        item = jnp.dtype(self.cfg.jnp_compute_dtype).itemsize
        return self.cfg.num_layers * 2 * heads * self.cfg.head_dim * item / shards

    def kv_entry_flops(self) -> float:
        """FLOPs a decode step's attention spends on one KV entry over all
        layers, per chip (as `kv_entry_bytes`): q . k and p . v, 2 x 2 x
        head_dim, for each query head of the KV heads the chip holds."""
        heads, shards = self._kv_split()
        per_kv = self.cfg.num_heads // self.cfg.num_kv_heads
        return self.cfg.num_layers * 4 * heads * per_kv * self.cfg.head_dim / shards

    def _kv_split(self) -> tuple[int, int]:
        """(KV heads a chip holds, data shards the slots are split over)."""
        cfg, sh = self.cfg, self.sharding
        if sh is None:
            return cfg.num_kv_heads, 1
        from erpo_jax.model.sharding import axis_size
        t = axis_size(sh.mesh, sh.spec(("act_kv_heads",))[0])
        return (cfg.num_kv_heads // t if cfg.num_kv_heads % t == 0 else cfg.num_kv_heads,
                sh.data_size)

    def pool_capacity(self, P: int, free_bytes: float) -> dict:
        """The largest pool (rollout.slots) a chip's `free_bytes` more HBM
        would hold: each slot's cache entries (`cache_length`) over all
        layers, per chip, in steps of the data-parallel size. `erpo plan`
        gives it the room its compiled rollout programs leave, so it is an
        extrapolation from the compiled peak (the pool's cache is what grows
        with the slots; a slot's logits row and state are left out, a few
        hundred KiB against its cache's MiB): `erpo plan rollout.slots=N`
        checks it with the compiler."""
        dp = self.sharding.data_size if self.sharding is not None else 1
        slot = self.cache_length(P) * self.kv_entry_bytes()   # per chip, averaged over dp
        more = int(free_bytes // (dp * slot)) * dp if free_bytes > 0 else 0
        return {"slots": self.slots + more, "slots_now": self.slots, "slot_bytes": slot}

    def cache_length(self, P: int) -> int:
        """Entries of each slot's KV cache for prompts of bucket P: P for the
        prompt and N for the ring of response entries, rounded up to a
        multiple of 8 on the CPU and of 128 elsewhere. The pool's cache crosses its programs' boundaries, so
        its layout there is the default one; on TPU the loop's own layout
        (slots of 128 lanes) is that default only at a multiple of 128,
        where otherwise every decode call would copy the whole cache into it
        and back (`erpo plan`: 43.6 of a 1.5B decode call's bytes on v4-8 at
        4095 entries)."""
        align = 8 if platform_of(self.sharding) == "cpu" else 128
        return -(-(P + self.sampling.max_new_tokens) // align) * align

    def _abstract_state(self, R: int, P: int, n: int = 0) -> PoolState:
        return jax.eval_shape(lambda: self._empty(jax.random.key(0), R, P, 0, n))

    def _abstract_pool(self, R: int, P: int, n: int = 0) -> PoolState:
        """`_abstract_state` with each leaf's sharding on a mesh (the
        arguments the programs are lowered with)."""
        like = self._abstract_state(R, P, n)
        if self.sharding is None:
            return like
        return jax.tree_util.tree_map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), like,
            self._state_shardings(like))

    def _empty(self, rng, R: int, P: int, per_call: int, n: int = 0) -> PoolState:
        cfg, sc, n = self.cfg, self.sampling, n or self.slots
        N, G, L = sc.max_new_tokens, sc.num_samples, cfg.num_layers
        cache = self._empty_cache(n, P)
        cd, Nk, K = cfg.jnp_compute_dtype, cfg.num_kv_heads, cfg.head_dim
        stash = Stash(tuple(jnp.zeros((1, Nk, K, P), cd) for _ in range(L)),
                      tuple(jnp.zeros((1, Nk, P, K), cd) for _ in range(L)),
                      jnp.zeros((1, P), bool), jnp.zeros((1, cfg.vocab_size), jnp.float32),
                      jnp.zeros((1,), jnp.int32))
        keys = sample_keys(rng, R, G, per_call)
        zeros = lambda dtype: jnp.zeros((n,), dtype)
        return PoolState(
            cache=cache, last=zeros(jnp.int32), positions=zeros(jnp.int32), t=zeros(jnp.int32),
            live=zeros(bool), sample=jnp.full((n,), R, jnp.int32),
            keys=jax.random.split(jax.random.key(0), n),
            uniforms=_uniforms(jax.random.split(jax.random.key(0), n), sc),
            stash=stash, tokens=jnp.full((R, N), sc.pad_id, jnp.int32),
            logp=jnp.zeros((R, N), jnp.float32), lengths=jnp.zeros((R,), jnp.int32),
            ended=jnp.zeros((R,), bool), sample_keys=keys, steps=jnp.zeros((), jnp.int32),
            useful=jnp.zeros((), jnp.int32))

    def _empty_cache(self, n: int, P: int):
        """The pool's KV cache, empty: n slots of `cache_length(P)` entries."""
        return model_lib.init_cache(self.cfg, n, self.cache_length(P))

    def _jit(self, fn, like: PoolState, donate: bool, extra_out=None):
        shardings = self._state_shardings(like)
        out = shardings if extra_out is None or shardings is None else (shardings, extra_out)
        kw = dict(compiler_options=xla_options.for_steps())
        if donate:
            kw["donate_argnums"] = (0,)
        if out is not None:
            kw["out_shardings"] = out
        return jax.jit(fn, **kw)

    def _make_start(self, R, P, per_call, Q, n):
        def start(rng):
            self._count()
            return self._empty(rng, R, P, per_call)
        return self._jit(start, self._abstract_state(R, P), donate=False)

    def _make_weights(self, R, P, per_call, Q, n):
        cfg, sh = self.cfg, self.sharding

        def weights(params):
            self._count()
            params = model_lib.decode_layout(
                model_lib.unstack_layers(model_lib.in_compute_dtype(params, cfg)), cfg, sh)
            return params, decode_head(params, cfg, sh)
        kw = {}
        if sh is not None:
            placed = jax.tree_util.tree_map(
                lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=p),
                model_lib.abstract_params(cfg), model_lib.param_shardings(cfg, sh))
            kw["out_shardings"] = jax.tree_util.tree_map(lambda a: a.sharding,
                                                         self._abstract_weights(placed))
        return jax.jit(weights, compiler_options=xla_options.for_steps(), **kw)

    def _abstract_weights(self, params):
        """(per-layer compute-dtype weights, decode head) as ShapeDtypeStructs,
        in the shardings the `weights` program gives them: each layer's
        slice keeps its stacked parameter's sharding (the MLP kernels the decode
        layout, `model.decode_weight_spec`), the head
        `head.decode_head_axes`'s."""
        cfg, sh = self.cfg, self.sharding
        narrowed = jax.eval_shape(lambda p: model_lib.in_compute_dtype(p, cfg), params)
        w = jax.eval_shape(model_lib.unstack_layers, narrowed)
        head = jax.ShapeDtypeStruct((cfg.hidden_size, cfg.vocab_size), cfg.jnp_compute_dtype)
        if sh is None:
            return w, head

        def unstacked(path, a, n):   # the stacked leaf's spec minus L, in the decode layout
            spec = model_lib.decode_weight_spec(
                path, jax.sharding.PartitionSpec(*tuple(a.sharding.spec)[1:]), cfg, sh)
            return jax.ShapeDtypeStruct(n.shape, n.dtype,
                                        sharding=jax.sharding.NamedSharding(sh.mesh, spec))

        same = lambda a, n: jax.ShapeDtypeStruct(n.shape, n.dtype, sharding=a.sharding)
        w = {**jax.tree_util.tree_map(same, {k: v for k, v in params.items() if k != "layers"},
                                      {k: v for k, v in w.items() if k != "layers"}),
             "layers": tuple(jax.tree_util.tree_map_with_path(unstacked, params["layers"], layer)
                             for layer in w["layers"])}
        axes = decode_head_axes(cfg, sh)   # None on a one-device mesh
        head = jax.ShapeDtypeStruct(head.shape, head.dtype, sharding=sh.replicated()
                                    if axes is None else sh.named(axes))
        return w, head

    def _make_insert(self, R, P, per_call, Q, n):
        c = self._constrain

        def insert(s: PoolState, params, head, tokens, mask, src, sample, keep):
            """tokens / mask [Q, T]: the prompts to prefill, the last T
            columns of their rows of the call's [B', P]; src int32[slots]:
            where each slot's new sample's prompt is (-1 none, 0 the stash,
            1 + q the q-th prompt); sample int32[slots]: its sample (R: none);
            keep: the row of [stash, prompts] to stash next."""
            self._count()
            st = self._prefill(s.stash, params, head, tokens, mask, Q, P)
            new = src >= 0
            at = jnp.maximum(src, 0)
            take = lambda a: jnp.take(a, at, axis=0)

            def put(buf, part, axis, axes):   # slots' first P cache entries from the prompts
                head_part = jax.lax.slice_in_dim(buf, 0, P, axis=axis)
                shape = (n,) + (1,) * (buf.ndim - 1)
                part = jnp.where(new.reshape(shape), take(part).astype(buf.dtype), head_part)
                return c(jax.lax.dynamic_update_slice_in_dim(buf, part, 0, axis=axis), axes)

            cache = s.cache
            valid = jnp.where(new[:, None], False, cache.valid)
            cache = model_lib.KVCache(
                tuple(put(b, p, 3, model_lib.K_CACHE_AXES) for b, p in zip(cache.k, st.k)),
                tuple(put(b, p, 2, model_lib.V_CACHE_AXES) for b, p in zip(cache.v, st.v)),
                put(valid, st.valid, 1, ("rows", "cache_length")), cache.index)
            return self._begin(dataclasses.replace(s, cache=cache), st, src, sample, keep, R, n)

        return self._jit(insert, self._abstract_state(R, P), donate=True)

    def _prefill(self, st: Stash, params, head, tokens, mask, Q: int, P: int) -> Stash:
        """[stash, Q prompts]: the stash with the prompts' prefill (keys,
        values, valid, last logits, real length) after it (Q = 0: the stash).
        tokens / mask [Q, T], T <= P: the prompts' last T columns, prefilled
        at T and their keys, values and valid padded on the left to P, the
        bucket's layout (the entries before T are padding either way).
        Weight-stationary, as a decode step (`model.decode_sharding`): an
        insert's few prompts are activations far smaller than the weights an
        FSDP prefill would gather (`erpo plan`, 7B on v5p-8, an insert of 4
        prompts at 128 tokens: 35 -> 9.7 GB of HBM traffic per chip)."""
        cfg, sh = self.cfg, self.sharding
        if not Q:
            return st
        T = tokens.shape[1]
        cache = model_lib.init_cache(cfg, Q, T)
        h, cache = model_lib.hidden_states(params, cfg, tokens, model_lib.positions_from_mask(mask),
                                           mask, cache=cache,
                                           sharding=model_lib.decode_sharding(cfg, sh))
        logits = head_logits(h[:, -1], head, cfg, sh)

        def widen(a, axis):
            pad = [(0, 0)] * a.ndim
            pad[axis] = (P - T, 0)
            return jnp.pad(a, pad) if T < P else a
        cat = lambda a, b: jnp.concatenate([a, b.astype(a.dtype)], axis=0)
        return Stash(tuple(cat(a, widen(b, 3)) for a, b in zip(st.k, cache.k)),
                     tuple(cat(a, widen(b, 2)) for a, b in zip(st.v, cache.v)),
                     cat(st.valid, widen(mask, 1)), cat(st.logits, logits),
                     cat(st.length, jnp.sum(mask, axis=-1, dtype=jnp.int32)))

    def _begin(self, s: PoolState, st: Stash, src, sample, keep, R: int, n: int) -> PoolState:
        """s with each new slot's (src >= 0) sample started: its key and
        uniforms, token 0 chosen from its prompt's logits (row src of
        [stash, prompts] st), its position after the prompt; row keep of st
        stashed for the next insert."""
        sc, N = self.sampling, self.sampling.max_new_tokens
        new = src >= 0
        take = lambda a: jnp.take(a, jnp.maximum(src, 0), axis=0)
        keys = _select_keys(new, s.sample_keys, sample, R, s.keys)
        uniforms = jnp.where(new[:, None], _uniforms(keys, sc), s.uniforms)
        tok, lp = choose(take(st.logits), keys, uniforms, jnp.zeros((n,), jnp.int32), sc,
                         platform_of(self.sharding))
        hit = _hit_eos(tok, sc)
        row = jnp.where(new, sample, R)          # R: dropped by the scatters
        keep_stash = jax.tree_util.tree_map(
            lambda a: jax.lax.dynamic_slice_in_dim(a, keep, 1, axis=0), st)
        return dataclasses.replace(
            s, last=jnp.where(new, tok, s.last),
            positions=jnp.where(new, take(st.length), s.positions),
            t=jnp.where(new, 1, s.t),
            live=jnp.where(new, ~hit & (N > 1), s.live),
            sample=jnp.where(new, sample, s.sample),
            keys=keys, uniforms=uniforms, stash=keep_stash,
            tokens=s.tokens.at[row, 0].set(tok, mode="drop"),
            logp=s.logp.at[row, 0].set(lp, mode="drop"),
            lengths=s.lengths.at[row].set(1, mode="drop"),
            ended=s.ended.at[row].set(hit, mode="drop"))

    def _make_shrink(self, R, P, per_call, Q, n):
        """The pool of n slots halved: keep int32[n / 2], the slots that stay."""
        def shrink(s: PoolState, keep):
            self._count()
            take = lambda a: jnp.take(a, keep, axis=0)
            cache = s.cache
            return take_slots(s, take, model_lib.KVCache(
                tuple(map(take, cache.k)), tuple(map(take, cache.v)), take(cache.valid),
                cache.index))
        # Not donated: the smaller pool cannot reuse the larger one's buffers.
        return self._jit(shrink, self._abstract_state(R, P, n // 2), donate=False)

    def _step(self, R: int, P: int, n: int):
        """One decode step of a pool of n slots: step(params, head, state)."""
        cfg, sc, sh = self.cfg, self.sampling, self.sharding
        N = sc.max_new_tokens
        stationary = model_lib.decode_sharding(cfg, sh)

        def step(params, head, s: PoolState) -> PoolState:
            # Every slot writes at one entry of the response ring; `valid`
            # keeps to each slot's own sample (reset by its insert).
            ring = s.cache._replace(index=P + s.steps % N)
            h, cache = model_lib.hidden_states(params, cfg, s.last[:, None],
                                               s.positions[:, None],
                                               jnp.ones((n, 1), bool), cache=ring,
                                               sharding=stationary, causal_cache=False)
            return self._advance(s, h[:, 0], head, cache, R)

        return step

    def _advance(self, s: PoolState, h, head, cache, R: int) -> PoolState:
        """s after one decode step: each live slot's next token chosen from its
        final hidden state h [slots, D] through the head (`head_choose`) and
        recorded, the slot ended at EOS or N tokens."""
        sc, N = self.sampling, self.sampling.max_new_tokens
        tok, lp = head_choose(h, head, s.keys, s.uniforms, jnp.minimum(s.t, N - 1), sc,
                              self.cfg, self.sharding, platform_of(self.sharding))
        live = s.live
        row = jnp.where(live, s.sample, R)
        at = jnp.minimum(s.t, N - 1)
        t = s.t + live.astype(jnp.int32)
        hit = _hit_eos(tok, sc) & live
        return dataclasses.replace(
            s, cache=cache, last=jnp.where(live, tok, s.last),
            positions=s.positions + live.astype(jnp.int32), t=t,
            live=live & ~hit & (t < N),
            tokens=s.tokens.at[row, at].set(tok, mode="drop"),
            logp=s.logp.at[row, at].set(lp, mode="drop"),
            lengths=s.lengths.at[row].set(t, mode="drop"),
            ended=s.ended.at[row].set(hit, mode="drop"),
            steps=s.steps + 1, useful=s.useful + jnp.sum(live, dtype=jnp.int32))

    def lower_decode_step(self, params, num_prompts: int, longest_prompt: int, n: int = 0):
        """One decode step of the pool of n slots (default `slots`) lowered by
        itself, as `StaticEngine.lower_decode_step` lowers the static one: the
        compute-dtype per-layer weights and the head as the `weights`
        program makes them, the state donated, the KV cache in layouts of
        the compiler's choice. For `erpo plan`, whose cost analysis counts a
        loop body once: the decode program's own numbers also count what the
        compiler stages around its loop."""
        from jax.experimental.layout import Format, Layout
        B, P = self.batch_shape(num_prompts, longest_prompt)
        R, n = B * self.sampling.num_samples, n or self.slots
        like = self._abstract_state(R, P, n)
        w, head = self._abstract_weights(params)
        step = self._step(R, P, n)
        if self.sharding is None:
            return jax.jit(step, donate_argnums=(2,)).lower(w, head, like)
        shardings = self._state_shardings(like)
        auto = lambda a: Format(Layout.AUTO, a)
        formats = dataclasses.replace(shardings, cache=shardings.cache._replace(
            k=tuple(map(auto, shardings.cache.k)), v=tuple(map(auto, shardings.cache.v))))
        state = jax.tree_util.tree_map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), like, shardings)
        fn = jax.jit(step, donate_argnums=(2,),
                     in_shardings=(jax.tree_util.tree_map(lambda a: a.sharding, w),
                                   head.sharding, formats),
                     out_shardings=formats, compiler_options=xla_options.for_steps())
        return fn.lower(w, head, state)

    def _make_decode(self, R, P, per_call, Q, n):
        sh = self.sharding
        step = self._step(R, P, n)

        def decode(s: PoolState, params, head, refill):
            """Decode steps until `refill` slots are free or none is live."""
            self._count()
            run = lambda s: (jnp.sum(~s.live) < refill) & jnp.any(s.live)
            s = jax.lax.while_loop(run, lambda s: step(params, head, s), s)
            return s, (self._constrain(s.live, (None,)), s.steps)

        like = self._abstract_state(R, P, n)
        rep = None if sh is None else sh.replicated()
        return self._jit(decode, like, donate=True, extra_out=None if sh is None else (rep, rep))

    # ------------------------------------------------------------------ host loop

    def compile(self, params, num_prompts: int, longest_prompt: int, max_prompts: int = 0):
        """Compile the programs a call of `num_prompts` prompts runs (params:
        arrays or ShapeDtypeStructs)."""
        for name, lowered in self.lower(params, num_prompts, longest_prompt, max_prompts):
            lowered.compile()

    def compile_sample(self, params, prompts: Sequence[Sequence[int]], max_prompts: int = 0):
        """Compile what `sample(params, prompts, key, max_prompts)` runs."""
        self.compile(params, len(prompts), max(len(p) for p in prompts), max_prompts)

    def lower(self, params, num_prompts: int, longest_prompt: int, max_prompts: int = 0):
        """[(name, Lowered)] of every program a call runs at these shapes."""
        return [(name, lower()) for name, _, lower in
                self.programs(params, num_prompts, longest_prompt, max_prompts, every=True)]

    def programs(self, params, num_prompts: int, longest_prompt: int, max_prompts: int = 0,
                 every: bool = False) -> list:
        """[(name, shapes, lower function)] of the programs a call of these
        shapes runs (params: arrays or ShapeDtypeStructs): each insert size
        and the decode loop at each pool size; every=True adds the small ones
        (start, weights and the pool's shrinks), which `erpo plan` leaves out."""
        B, P = self.batch_shape(num_prompts, longest_prompt)
        R = B * self.sampling.num_samples
        per_call = max_prompts if 0 < max_prompts < num_prompts else 0
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        state = lambda n: self._abstract_pool(R, P, n)
        w, head = self._abstract_weights(params)
        out = []
        if every:
            out += self._setup_programs(params, R, P, per_call)
        for Q, T in self._insert_shapes(B, P):
            rows = lambda dtype, Q=Q, T=T: jax.ShapeDtypeStruct(
                (Q, T), dtype, sharding=self._named(("batch", None)) if Q else None)
            out.append((insert_part(Q, T, P), f"{Q} prompts x {T} tokens into {self.slots} slots",
                        lambda Q=Q, rows=rows: self._program("insert", R, P, 0, Q).lower(
                            state(self.slots), w, head, rows(jnp.int32), rows(jnp.bool_),
                            i32(self.slots), i32(self.slots), i32())))
        return out + self._pool_programs(R, P, state, w, head, every)

    def _pool_programs(self, R: int, P: int, state, w, head, every: bool) -> list:
        """[(name, shapes, lower function)] of the decode loop at each pool
        size and (every) the pool's shrinks; state(n): the abstract state of
        a pool of n slots."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        sizes, out = self.pool_sizes(), []
        for n in sizes:
            out.append((f"decode {n}", self._decode_shapes(n, P, R),
                        lambda n=n: self._program("decode", R, P, n=n).lower(
                            state(n), w, head, i32())))
            if every and n > sizes[-1]:
                out.append((f"shrink {n}", f"{n} -> {n // 2} slots",
                            lambda n=n: self._program("shrink", R, P, n=n).lower(
                                *self._shrink_args(state(n), i32(n // 2)))))
        return out

    def _decode_shapes(self, n: int, P: int, R: int) -> str:
        return f"{n} slots x {self.cache_length(P)} cache entries, {R} samples"

    def _shrink_args(self, state: PoolState, keep) -> tuple:
        """The shrink program's arguments: the state of the larger pool, keep."""
        return state, keep

    def _insert_shapes(self, num_prompts: int, P: int) -> list[tuple[int, int]]:
        """(prompts, prefill length) of every insert program of a call: each
        prompt count (`_query_buckets`) at each prefill length
        (`prefill_lengths`); the insert of 0 prompts prefills nothing."""
        return [(Q, T) for Q in self._query_buckets(num_prompts)
                for T in (self.prefill_lengths(P) if Q else [P])]

    def step_programs(self, params, num_prompts: int, longest_prompt: int,
                      max_prompts: int = 0, brief: bool = False) -> list[EngineProgram]:
        """`programs` of a call of num_prompts prompts keyed in chunks of
        max_prompts (`types.Engine.step_programs`), each decode program with
        its loop's step (`lower_decode_step`) as a `DecodeLoop` whose steps
        the schedule decides; brief: the largest insert and the full pool's
        decode only."""
        parts = self.programs(params, num_prompts, longest_prompt, max_prompts)
        if brief:
            inserts = [p for p in parts if p[0].startswith("insert")]
            parts = [inserts[-1], next(p for p in parts if p[0].startswith("decode"))]
        _, P = self.batch_shape(num_prompts, longest_prompt)
        N, S = self.sampling.max_new_tokens, self.cache_length(P)
        pools = {f"decode {n}": n for n in self.pool_sizes()}
        out = []
        for part, shapes, lower in parts:
            n = pools.get(part)
            loops = () if n is None else (DecodeLoop(
                part, n, S, None, lambda n=n: self.lower_decode_step(
                    params, num_prompts, longest_prompt, n), n == self.slots),)
            out.append(EngineProgram(part, shapes, lower, self.slots, self.slots * (P + N),
                                     loops))
        return out

    def _setup_programs(self, params, R: int, P: int, per_call: int) -> list:
        """[(name, shapes, lower function)] of `start` and `weights`."""
        key = jax.eval_shape(lambda: jax.random.key(0))
        return [("start", f"{R} samples", lambda: self._program(
                    "start", R, P, per_call).lower(key)),
                ("weights", "per-layer weights", lambda: self._program(
                    "weights", R, P).lower(params))]

    def run(self, params, prompts: Sequence[Sequence[int]], rng: jax.Array,
            max_prompts: int = 0) -> tuple[Rollout, int]:
        """(Rollout of device arrays over B' * G rows, number of real rows B * G),
        as `StaticEngine.run`; max_prompts keys the samples as the static engine's
        calls of that many prompts."""
        tokens, mask, B = self.prepare(prompts)
        self.last_inserts = {}
        Bp, P = tokens.shape
        sc, n = self.sampling, self.slots
        G = sc.num_samples
        R, real = Bp * G, B * G
        per_call = max_prompts if 0 < max_prompts < B else 0
        state = self._program("start", R, P, per_call)(rng)
        w, head = self._program("weights", R, P)(params)
        buckets = self._query_buckets(Bp)
        live = np.zeros(n, bool)
        nxt, stashed, steps, slot_steps = 0, -1, 0, 0
        sizes = self.pool_sizes()
        while True:
            free, inserted = np.flatnonzero(~live), False
            if nxt < real and free.size:
                k = min(free.size, real - nxt)
                ids = np.arange(nxt, nxt + k)
                prompt = ids // G
                fresh = np.unique(prompt[prompt != stashed])
                Q = next(q for q in buckets if q >= fresh.size)
                src = np.full(n, -1, np.int32)
                src[free[:k]] = np.where(prompt == stashed, 0,
                                         1 + np.searchsorted(fresh, prompt))
                sample = np.full(n, R, np.int32)
                sample[free[:k]] = ids
                keep = 0 if prompt[-1] == stashed else 1 + int(np.searchsorted(fresh, prompt[-1]))
                q_tok, q_mask = self._insert_rows(tokens, mask, fresh, Q)
                state = self._program("insert", R, P, 0, Q)(
                    state, w, head, q_tok, q_mask, src, sample, np.int32(keep))
                stashed, nxt = int(prompt[-1]), nxt + k
                inserted = True
            pending = real - nxt
            if not pending and not inserted:
                # The drain: halve the pool while at most half of it is live
                # (`live` is the last decode's: an insert's new slots are not in it).
                while n > sizes[-1] and live.sum() <= n // 2:
                    keep = np.concatenate([np.flatnonzero(live), np.flatnonzero(~live)])[:n // 2]
                    state = self._program("shrink", R, P, n=n)(state, keep.astype(np.int32))
                    live, n = live[keep], n // 2
            smaller = n > sizes[-1]
            refill = (min(self.refill, pending) if pending else
                      n - n // 2 if smaller else n + 1)
            state, (live_dev, steps_dev) = self._program("decode", R, P, n=n)(
                state, w, head, np.int32(refill))
            live, total = to_host((live_dev, steps_dev))
            slot_steps += (int(total) - steps) * n
            steps = int(total)
            if nxt == real and not live.any():
                break
        return self._collect(state, tokens, mask, real, steps, slot_steps), real

    def _insert_rows(self, tokens, mask, fresh, Q: int):
        """(tokens, mask) [Q, T] an insert of the prompts `fresh` (rows of
        the call's [B', P]) takes: Q rows (the last prompt repeated), their
        last T columns (`prefill_length` of the longest), on the data axes;
        counted in `last_inserts`."""
        P = tokens.shape[1]
        rows = np.concatenate([fresh, np.full(Q - fresh.size, fresh[-1] if fresh.size
                                              else 0)]).astype(int)
        longest = int(mask[rows].sum(axis=1).max()) if Q else P
        T = self.prefill_length(P, longest)
        q_tok, q_mask = tokens[rows, P - T:], mask[rows, P - T:]
        if Q and self.sharding is not None:
            put = self.sharding.named(("batch", None))
            q_tok, q_mask = jax.device_put(q_tok, put), jax.device_put(q_mask, put)
        qt = (Q, T if Q else 0)
        self.last_inserts[qt] = self.last_inserts.get(qt, 0) + 1
        return q_tok, q_mask

    def _collect(self, state: PoolState, tokens, mask, real: int, steps: int,
                 slot_steps: int) -> Rollout:
        """The call's Rollout (device arrays, the static engine's row order)
        from the pool's per-sample buffers; sets `last_stats`."""
        G, N = self.sampling.num_samples, self.sampling.max_new_tokens
        lengths = state.lengths
        response_mask = jnp.arange(N)[None, :] < lengths[:, None]
        rep = lambda a: np.repeat(a, G, axis=0)
        self.last_stats = rollout_stats(to_host(lengths)[:real], steps, slot_steps)
        return Rollout(
            prompt_tokens=rep(tokens), prompt_mask=rep(mask), response_tokens=state.tokens,
            response_mask=response_mask, logp=state.logp, lengths=lengths,
            truncated=~state.ended & (lengths > 0), num_steps=jnp.max(lengths))

    def sample(self, params, prompts: Sequence[Sequence[int]], key: jax.Array,
               max_prompts: int = 0) -> Rollout:
        """A Rollout of numpy arrays over exactly len(prompts) * G rows on every
        host: the same samples as `StaticEngine.sample` with that key and max_prompts,
        to float rounding (a draw can flip where rounding moves it across a
        token boundary)."""
        out, real = self.run(params, prompts, key, max_prompts)
        out = to_host(out)
        return Rollout(*(a[:real] if np.ndim(a) else a for a in out))


def take_slots(s: PoolState, take, cache) -> PoolState:
    """The pool's per-slot leaves through take (the rows of the slots that
    stay when the pool shrinks), with `cache` the smaller pool's cache."""
    return dataclasses.replace(
        s, cache=cache, last=take(s.last), positions=take(s.positions), t=take(s.t),
        live=take(s.live), sample=take(s.sample), keys=take(s.keys), uniforms=take(s.uniforms))


def _select_keys(new, sample_keys, sample, R, keys):
    """The slots' keys: each new sample's own (sample_keys[sample]), else kept."""
    picked = jnp.take(sample_keys, jnp.minimum(sample, R - 1), axis=0)
    data = jax.random.key_data
    return jax.random.wrap_key_data(jnp.where(new[:, None], data(picked), data(keys)))


def insert_part(Q: int, T: int, P: int) -> str:
    """The name of the insert program of Q prompts prefilled at length T
    (prompt bucket P): 'insert Q', or 'insert Q at T' below the bucket."""
    return f"insert {Q}" if not Q or T >= P else f"insert {Q} at {T}"


def schedule(lengths: Sequence[int], slots: int, refill: int = 0,
             sizes: Sequence[int] | None = None, group: int = 1,
             buckets: Sequence[int] = (0, 1), prompt_lengths: Sequence[int] | None = None,
             prefill=None) -> dict:
    """What `ContinuousEngine` runs for samples of these response lengths (in
    sample order, `group` per prompt) over `slots` slots: its host loop,
    replayed without a model (`erpo plan` estimates a rollout from it).

    refill, sizes (`pool_sizes()`), buckets (`_query_buckets`): the engine's;
    prefill (longest prompt -> prefill length, the engine's `prefill_length`
    at its bucket) with prompt_lengths (real tokens of each prompt): the
    length each insert prefills at.
    Returns {'steps': decode steps, 'slot_steps': the pool's size summed over
    them (utilisation's denominator), 'steps_by_size': {pool size: steps},
    'inserts': {(prompts prefilled, prefill length or 0 without prefill):
    insert calls}}.
    """
    refill = refill or max(1, slots // 16)
    sizes = list(sizes or [slots])
    need = np.maximum(np.asarray(lengths, np.int64) - 1, 0)   # token 0 comes from the prefill
    left = np.zeros(slots, np.int64)          # decode steps each slot's sample still needs
    nxt, total, n, stashed = 0, len(need), slots, -1
    by_size, inserts = {}, {}
    while True:
        free, inserted = np.flatnonzero(left == 0), False
        if nxt < total and free.size:
            k = min(free.size, total - nxt)
            prompt = np.arange(nxt, nxt + k) // group
            fresh = np.unique(prompt[prompt != stashed])
            q = next(b for b in buckets if b >= fresh.size)
            t = (prefill(int(np.max(np.asarray(prompt_lengths)[fresh])))
                 if q and prefill is not None else 0)
            inserts[q, t] = inserts.get((q, t), 0) + 1
            left[free[:k]] = need[nxt:nxt + k]
            nxt, stashed, inserted = nxt + k, int(prompt[-1]), True
        pending = total - nxt
        if not pending and not inserted:
            while n > sizes[-1] and (left > 0).sum() <= n // 2:
                left, n = np.sort(left)[::-1][:n // 2].copy(), n // 2
        stop = (min(refill, pending) if pending else n - n // 2 if n > sizes[-1] else n + 1)
        live = left > 0
        if live.any() and np.sum(~live) < stop:
            # Run until `stop` slots are free or none is live, in one jump.
            ends = np.sort(left[live])
            run = int(ends[min(stop - int(np.sum(~live)), ends.size) - 1])
            left = np.maximum(left - run, 0)
            by_size[n] = by_size.get(n, 0) + run
        if nxt == total and not (left > 0).any():
            return {"steps": sum(by_size.values()),
                    "slot_steps": sum(k * v for k, v in by_size.items()),
                    "steps_by_size": by_size, "inserts": inserts}
