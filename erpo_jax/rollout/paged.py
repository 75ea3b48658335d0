"""The paged rollout engine: the continuous engine's pool of slots over a KV
cache in pages, where a prompt's G samples share its prompt's pages and a
decode step's attention reads only the pages a slot has filled.

The cache of one layer is `kv_pages[pages, page_size, 2 * Nk, K]`
(model/paged_attention.py), split over the data shards: each shard owns
`pages_per_shard` pages and the slots that lie on it, and a slot's page
table names pages of its own shard. A slot's sequence is its prompt's real
tokens (not the bucket's padding) followed by its response:

  prompt pages   the prompt's whole pages, written once per shard by the
                 insert that first needs them there (from the prefill, or
                 from the one-prompt stash of the continuous engine) and
                 shared by every sample of the prompt on that shard; only
                 read after;
  own pages      the sample's: the first starts with a copy of the prompt's
                 last, partial page, then its response entries. Taken at
                 insert for the sample's longest possible response, given
                 back when it ends.

The host keeps the page book (free pages per shard, each prompt's pages and
how many samples on the shard still use them): it places each pending
sample, in sample order, in a free slot of a shard with pages for it, and
inserting waits while no shard has them. A sample takes its pages at
insert, so a pool whose pages cannot hold every slot's longest response
(`rollout.kv_pages` below `slots` x that) runs fewer samples at once than
it has slots; its decode step still reads only what its slots hold.

Programs: `start`, `weights` (the continuous engine's), `insert Q` (prefill
Q prompts, write the prompt pages and the slots' first pages, set the new
slots' page tables, choose token 0), `decode` (one-token steps in a
`lax.while_loop` until `refill` slots are free or none is live) and
`shrink`. An empty slot's attention reads nothing, but the rest of its
step does not shrink with it: each slot's activations cost about 5.8 MB of
HBM traffic per step on the 7B plan (v5p-8), 0.75 GB of a 128-slot step's
4.3 GB besides the KV. So the pool drains as the continuous engine's does
(`pool_sizes`): once nothing is pending, it halves while every shard has
at most half its slots live. Only the slots' rows move (their page tables
with them, each slot staying on its shard, whose pages its table names);
the pages stay where they are.

Exactness: the continuous engine's. A slot attends to the same keys (its
prompt's real tokens and its own earlier tokens, in another order) with the
same sample keys and uniforms, so for the same key every sample's tokens are
the static engine's, to float rounding, whatever the page size, the pages or
the order of refills.

Attention: `paged_attention.decode`, run per data shard under `shard_map`:
on TPU jax's Pallas kernel `ragged_paged_attention` (reads pages
[0, ceil(len / page_size)) of each slot), elsewhere a pure-JAX gather over
the same pages (`rollout.paged_attention`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.model import model as model_lib
from erpo_jax.model import paged_attention
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding, platform as platform_of
from erpo_jax.rollout.continuous import (ContinuousEngine, PoolState, insert_part, pool_slots,
                                         take_slots)
from erpo_jax.rollout.types import Rollout, SamplingConfig
from erpo_jax.runtime import xla_options
from erpo_jax.runtime.distributed import to_host


class PagedCache(NamedTuple):
    """pages: tuple of L kv_pages arrays [shards * pages_per_shard, page_size,
    2 * Nk, K]; table: int32[slots, pages per slot], page ids local to the
    slot's shard; kv_len: int32[slots], entries the slot's sequence holds."""

    pages: tuple
    table: jax.Array
    kv_len: jax.Array


def _without_pages(state: PoolState) -> PoolState:
    """The pool's state with its cache's pages left out (they pass through a
    shrink separately, donated)."""
    return dataclasses.replace(state, cache=state.cache._replace(pages=()))


def shard_keep(live, shards: int):
    """The slots a pool of len(live) slots over `shards` shards keeps when it
    halves: on each shard its live slots, then idle ones, to half its slots
    (page ids are local to a shard, so a slot stays on its own); None while
    some shard has more than half its slots live."""
    live = np.asarray(live, bool)
    per = live.size // shards
    out = []
    for d in range(shards):
        own = np.arange(d * per, (d + 1) * per)
        if live[own].sum() > per // 2:
            return None
        out.append(np.concatenate([own[live[own]], own[~live[own]]])[:per // 2])
    return np.concatenate(out)


def own_pages(page_size: int, max_new_tokens: int) -> int:
    """Pages a sample takes at insert: its prompt's partial last page (at most
    page_size - 1 entries) and its longest response (max_new_tokens - 1 fed
    tokens; the last token is never written)."""
    return -(-(page_size - 1 + max(max_new_tokens - 1, 1)) // page_size)


class PagedEngine(ContinuousEngine):
    """The `paged` rollout engine (see the module docstring).

    engine = PagedEngine(cfg, SamplingConfig(...), sharding, slots=64, page_size=16,
                         kv_pages=4096)
    out = engine.sample(params, prompts, rollout_key(seed_key, step), max_prompts)

    kv_pages: pages over all data shards (a multiple of the data-parallel
    size; 0: enough for every slot's longest response and prompt, the
    continuous engine's memory). kv_memory: instead, the share of each
    chip's memory the pages take (`pages_in_memory`; 0: off). attention:
    'auto' (the Pallas kernel on TPU, the pure-JAX path elsewhere),
    'kernel' or 'dense'.
    """

    name = "paged"

    def __init__(self, cfg: ModelConfig, sampling: SamplingConfig,
                 sharding: Sharding | None = None, slots: int = 0, refill: int = 0,
                 page_size: int = 16, kv_pages: int = 0, attention: str = "auto",
                 kv_memory: float = 0.0):
        super().__init__(cfg, sampling, sharding, slots, refill)
        check_page_size(page_size)
        self.page_size = page_size
        if kv_memory:
            kv_pages = self.pages_in_memory(kv_memory)
        check_pages(page_size, kv_pages, sampling, sharding)
        paged_attention.resolve_impl(attention, sharding, cfg.head_dim)
        self.kv_pages, self.attention = kv_pages, attention
        self.last_pages: dict = {}

    @classmethod
    def from_config(cls, cfg: ModelConfig, sampling: SamplingConfig, sharding: Sharding | None,
                    rollout, rows_per_call: int) -> PagedEngine:
        """The engine of a run (`types.Engine.from_config`): the continuous
        engine's slots and refill, and rollout.page_size, rollout.kv_pages (or
        rollout.kv_memory) and rollout.paged_attention."""
        return cls(cfg, sampling, sharding, slots=pool_slots(rollout.slots, sharding,
                                                             rows_per_call),
                   refill=rollout.refill,
                   page_size=rollout.page_size, kv_pages=rollout.kv_pages,
                   attention=rollout.paged_attention, kv_memory=rollout.kv_memory)

    def pages_in_memory(self, share: float) -> int:
        """The pages (over all data shards, a multiple of their number) that
        take `share` of one chip's memory (`runtime.mesh.chip_memory_bytes`:
        what the runtime reports, or a TPU's HBM by its kind when `erpo plan`
        compiles for it), in pages of `page_bytes`. The share is of the whole chip, weights and
        activations not taken off: `erpo plan` checks that the run fits."""
        from erpo_jax.runtime.mesh import chip_memory_bytes
        devices = (self.sharding.mesh.devices.flat if self.sharding is not None
                   else jax.devices()[:1])
        memory = chip_memory_bytes(next(iter(devices)))
        if memory is None:
            raise ValueError(f"rollout.kv_memory is {share}, a share of a chip's memory, but "
                             "this device reports none (the CPU): set rollout.kv_pages "
                             "instead.")
        page = self.page_bytes()
        pages = int(share * memory // (self.shards * page)) * self.shards
        need = sample_pages(self.page_size, self.sampling)
        if pages // self.shards < need:
            raise ValueError(
                f"rollout.kv_memory is {share}: {share:g} of a chip's {memory / 2**30:.1f} GiB "
                f"holds {pages // self.shards} pages of {self.page_size} entries per data shard, "
                f"and one sample needs {need}: raise it to at least "
                f"{need * self.shards * page / memory:.2g}.")
        return pages

    # ------------------------------------------------------------------ shapes

    @property
    def shards(self) -> int:
        return self.sharding.data_size if self.sharding is not None else 1

    def prompt_pages(self, P: int) -> int:
        """Whole pages of the longest prompt of bucket P."""
        return P // self.page_size

    def pages_per_slot(self, P: int) -> int:
        return self.prompt_pages(P) + own_pages(self.page_size, self.sampling.max_new_tokens)

    def pages_per_shard(self, P: int) -> int:
        """Pages of each shard: kv_pages / shards, or (kv_pages = 0) every
        slot's own pages and one prompt's pages per slot."""
        if self.kv_pages:
            return self.kv_pages // self.shards
        return (self.slots // self.shards) * self.pages_per_slot(P)

    def pool_capacity(self, P: int, free_bytes: float) -> dict:
        """The largest pool a chip's `free_bytes` more would hold: with
        rollout.kv_pages = 0 the pool's pages grow with its slots (every
        slot's longest prompt and response), so more slots; with kv_pages set
        the slots wait on the pages, so more pages (and the slots those pages
        hold at their longest samples)."""
        if not self.kv_pages:
            return super().pool_capacity(P, free_bytes)
        page = self.page_bytes()
        more = int(free_bytes // (self.shards * page)) * self.shards if free_bytes > 0 else 0
        pages = self.kv_pages + more
        return {"kv_pages": pages, "kv_pages_now": self.kv_pages,
                "slots_at_longest": pages // self.pages_per_slot(P) // self.shards * self.shards,
                "page_bytes": page}

    def page_bytes(self) -> float:
        """One page of the pool, per chip: page_size KV entries over all
        layers, split over the data shards and the KV heads' tensor shards
        as `kv_entry_bytes`."""
        return self.page_size * self.kv_entry_bytes()

    def cache_length(self, P: int) -> int:
        """Entries one slot's page table can name."""
        return self.pages_per_slot(P) * self.page_size

    def _writes(self, Q: int, P: int) -> int:
        """Page writes an insert of Q prompts makes on each shard, at most:
        the whole pages of each prompt it places a sample of there (the
        stash's and the Q new ones), and each new slot's first page."""
        local = self.slots // self.shards
        return min(local, 1 + Q) * self.prompt_pages(P) + local

    # ------------------------------------------------------------------ state

    def _empty_cache(self, n: int, P: int) -> PagedCache:
        """Every shard's pages, and n empty page tables."""
        cfg = self.cfg
        pages = tuple(jnp.zeros((self.shards * self.pages_per_shard(P), self.page_size,
                                 2 * cfg.num_kv_heads, cfg.head_dim), cfg.jnp_compute_dtype)
                      for _ in range(cfg.num_layers))
        return PagedCache(pages, jnp.zeros((n, self.pages_per_slot(P)), jnp.int32),
                          jnp.zeros((n,), jnp.int32))

    def _cache_axes(self, L: int) -> PagedCache:
        """Pages over the data shards (heads over the tensor axis), page
        tables and lengths with their slots."""
        return PagedCache((("rows", None, "act_kv_heads", None),) * L, ("batch", None),
                          ("batch",))

    # ------------------------------------------------------------------ programs

    def _scatter(self, pages, blocks, ids):
        """pages.at[ids].set(blocks), each data shard into its own pages
        (ids local; a scatter by global ids would make the partitioner
        gather every shard's pages)."""
        write = lambda p, b, i: p.at[i].set(b, mode="drop")
        sh = self.sharding
        if sh is None or sh.mesh.size == 1:
            return write(pages, blocks, ids)
        from jax.sharding import PartitionSpec as PS
        rows, heads = paged_attention.shard_axes(sh, pages.shape[2] // 2)
        spec = PS(rows, None, heads, None)
        return jax.shard_map(write, mesh=sh.mesh, in_specs=(spec, spec, PS(rows)),
                             out_specs=spec, check_vma=False)(pages, blocks, ids)

    def _make_insert(self, R, P, per_call, Q, n):
        ps = self.page_size

        def insert(s: PoolState, params, head, tokens, mask, src, sample, keep, table,
                   kv_len, w_row, w_start, w_page):
            """tokens / mask [Q, T], src, sample, keep: the continuous engine's
            insert's. table int32[slots, pages per slot], kv_len int32[slots]:
            the new slots' page tables and prompt lengths. w_row / w_start /
            w_page int32[shards * W]: page writes, shard d's in chunk d, each
            the page_size entries of row w_row of [stash, prompts] from entry
            w_start (of its P, padded) into page w_page of that shard (out of
            range: none). Each shard scatters only into its own pages."""
            self._count()
            st = self._prefill(s.stash, params, head, tokens, mask, Q, P)

            def put(pages, k, v):
                # Rows' entries as [rows, P + ps, 2Nk, K], padded so a block never runs off.
                kv = paged_attention.interleave(k.transpose(0, 3, 1, 2), v.transpose(0, 2, 1, 3))
                kv = jnp.pad(kv, ((0, 0), (0, ps), (0, 0), (0, 0))).astype(pages.dtype)
                # One gather of the W blocks' entries (a vmap of row-then-slice
                # made XLA copy the whole row for every block: ~0.4 GB a layer
                # per chip at the 1.5B plan's insert of 4 prompts).
                blocks = kv[w_row[:, None], w_start[:, None] + jnp.arange(ps)[None, :]]
                blocks = self._constrain(blocks, ("rows", None, "act_kv_heads", None))
                return self._scatter(pages, blocks, w_page)

            c = s.cache
            new = src >= 0
            cache = PagedCache(tuple(map(put, c.pages, st.k, st.v)),
                               jnp.where(new[:, None], table, c.table),
                               jnp.where(new, kv_len, c.kv_len))
            return self._begin(dataclasses.replace(s, cache=cache), st, src, sample, keep, R, n)

        return self._jit(insert, self._abstract_state(R, P), donate=True)

    def _make_shrink(self, R, P, per_call, Q, n):
        """The pool of n slots halved (the continuous engine's shrink):
        shrink(state without its pages, pages, keep int32[n / 2]), keep
        naming slots of the shard each new slot lies on (`shard_keep`). Only
        the slots' rows move, page tables with them; the pages pass through,
        donated (the smaller pool's other leaves cannot reuse the larger
        one's buffers, and pages not donated would be copied)."""
        def shrink(s: PoolState, pages, keep):
            self._count()
            take = lambda a: jnp.take(a, keep, axis=0)
            c = s.cache
            return take_slots(s, take, PagedCache(pages, take(c.table), take(c.kv_len)))

        shardings = self._state_shardings(self._abstract_state(R, P, n // 2))
        kw = dict(donate_argnums=(1,), compiler_options=xla_options.for_steps())
        if shardings is not None:
            kw["out_shardings"] = shardings
        return jax.jit(shrink, **kw)

    def _shrink(self, state: PoolState, R: int, P: int, n: int, keep) -> PoolState:
        return self._program("shrink", R, P, n=n)(
            *self._shrink_args(state, np.asarray(keep, np.int32)))

    def _step(self, R: int, P: int, n: int):
        cfg, sh = self.cfg, self.sharding
        stationary = model_lib.decode_sharding(cfg, sh)

        def step(params, head, s: PoolState) -> PoolState:
            c, live = s.cache, s.live
            h, pages = model_lib.decode_paged(params, cfg, s.last, s.positions, c.pages,
                                              c.table, c.kv_len, live, sharding=stationary,
                                              impl=self.attention)
            cache = PagedCache(pages, c.table, c.kv_len + live.astype(jnp.int32))
            return self._advance(s, h, head, cache, R)

        return step

    def lower_decode_step(self, params, num_prompts: int, longest_prompt: int, n: int = 0):
        """One decode step lowered by itself (for `erpo plan`)."""
        B, P = self.batch_shape(num_prompts, longest_prompt)
        R, n = B * self.sampling.num_samples, n or self.slots
        state = self._abstract_pool(R, P, n)
        w, head = self._abstract_weights(params)
        step = self._step(R, P, n)
        if self.sharding is None:
            return jax.jit(step, donate_argnums=(2,)).lower(w, head, state)
        fn = jax.jit(step, donate_argnums=(2,),
                     out_shardings=jax.tree_util.tree_map(lambda a: a.sharding, state),
                     compiler_options=xla_options.for_steps())
        return fn.lower(w, head, state)

    def programs(self, params, num_prompts: int, longest_prompt: int, max_prompts: int = 0,
                 every: bool = False) -> list:
        """[(name, shapes, lower function)]: each insert size and the decode
        loop at each pool size; every=True adds start, weights and the
        pool's shrinks."""
        B, P = self.batch_shape(num_prompts, longest_prompt)
        R, n = B * self.sampling.num_samples, self.slots
        per_call = max_prompts if 0 < max_prompts < num_prompts else 0
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        at = lambda n: self._abstract_pool(R, P, n)
        state = at(n)
        w, head = self._abstract_weights(params)
        out = []
        if every:
            out += self._setup_programs(params, R, P, per_call)
        pps = self.pages_per_slot(P)
        for Q, T in self._insert_shapes(B, P):
            rows = lambda dtype, Q=Q, T=T: jax.ShapeDtypeStruct(
                (Q, T), dtype, sharding=self._named(("batch", None)) if Q else None)
            W = self.shards * self._writes(Q, P)
            out.append((insert_part(Q, T, P), f"{Q} prompts x {T} tokens into {n} slots",
                        lambda Q=Q, rows=rows, W=W: self._program("insert", R, P, 0, Q).lower(
                            state, w, head, rows(jnp.int32), rows(jnp.bool_), i32(n), i32(n),
                            i32(), i32(n, pps), i32(n), i32(W), i32(W), i32(W))))
        return out + self._pool_programs(R, P, at, w, head, every)

    def _decode_shapes(self, n: int, P: int, R: int) -> str:
        return (f"{n} slots x {self.pages_per_slot(P)} pages of {self.page_size}, "
                f"{self.shards * self.pages_per_shard(P)} pages, {R} samples")

    def _shrink_args(self, state: PoolState, keep) -> tuple:
        """The state without its pages, the pages (donated), keep."""
        return _without_pages(state), state.cache.pages, keep

    def step_programs(self, params, num_prompts: int, longest_prompt: int,
                      max_prompts: int = 0, brief: bool = False):
        """The continuous engine's (`types.Engine.step_programs`), its decode
        loop not the one `erpo plan` reports a step's traffic for against the
        whole cache: the compiled step leaves the kernel's reads out
        (`tools.hbm.paged_kernel_pages`), and `plan_estimate` adds them from
        the page book and sets them against the KV the slots hold."""
        out = super().step_programs(params, num_prompts, longest_prompt, max_prompts, brief)
        return [p._replace(loops=tuple(x._replace(full=False) for x in p.loops)) for p in out]

    def plan_estimate(self, lengths, num_prompts: int, longest_prompt: int, max_prompts: int,
                      run_ms, step_ms, step_cost=None, roofline_ms=None,
                      prompt_lengths=None) -> dict | None:
        """`erpo plan`'s rollout time (`types.Engine.plan_estimate`): the paged
        `schedule` of these response lengths after prompts of prompt_lengths
        tokens (default: every prompt longest_prompt long), its steps at each
        pool size as the pool drains. Each decode step is the roofline of
        that size's compiled step (whose counts leave the kernel
        out: its page pool by `tools.hbm.paged_kernel_pages`, its FLOPs
        because the custom call declares none) with the kernel's work added,
        counted from the page book: it reads ceil(held / page_size) pages of
        each live slot, each page_size x (key + value) x KV heads x head size
        x layers, per chip (slots over the data shards, heads over the tensor
        shards where they divide), and spends `kv_entry_flops` on each entry
        a slot holds (the mean over that size's steps). Inserts as the
        continuous engine's. Also the full pool's mean step's bytes against
        the minimum, weights (`weights_bytes`) plus the KV the slots hold,
        both per chip."""
        if step_cost is None or roofline_ms is None:
            return None
        B, _ = self.batch_shape(num_prompts, longest_prompt)
        P, plen = self._plan_prompts(num_prompts, longest_prompt, prompt_lengths)
        G = self.sampling.num_samples
        sched = schedule(lengths, plen, G, self.slots, self.shards, self.pages_per_shard(P),
                         self.page_size, self.sampling.max_new_tokens, self.refill,
                         self._query_buckets(B), lambda longest: self.prefill_length(P, longest),
                         self.pool_sizes())
        by_size = sched["steps_by_size"]
        compiled = {n: step_cost(f"decode {n}") for n in {self.slots, *by_size}}
        insert, inserts = self._costed_inserts(sched["inserts"], P, run_ms)
        if None in compiled.values() or insert is None:
            return None
        entry, entry_flops = self.kv_entry_bytes(), self.kv_entry_flops()

        def per_step(n):   # (FLOPs, HBM bytes, KV read, KV held) of a mean step at pool size n
            k = max(by_size.get(n, 0), 1)
            read = sched["read_by_size"].get(n, 0) * entry / k
            held = sched["held_by_size"].get(n, 0) * entry / k
            flops = sched["held_by_size"].get(n, 0) * entry_flops / k
            return compiled[n][0] + flops, compiled[n][1] + read, read, held, flops

        decode = sum(k * roofline_ms(*per_step(n)[:2]) for n, k in by_size.items())
        # The full pool's step: its traffic is set against the minimum.
        step_flops, step_bytes, read, held, flops = per_step(self.slots)
        step = roofline_ms(step_flops, step_bytes)
        weights = self.weights_bytes()
        useful = int((np.asarray(lengths) - 1).sum())
        return {"decode_steps": sched["steps"], "slot_utilization": useful / sched["slot_steps"],
                "estimated_ms": decode + insert, "decode_ms": decode, "insert_ms": insert,
                "slots": self.slots, "max_live": sched["max_live"],
                "pages_per_shard": self.pages_per_shard(P), "peak_pages": sched["peak_pages"],
                "page_size": self.page_size, "mean_prompt_length": float(plen.mean()),
                "kv_read_per_step_bytes": read, "kv_held_per_step_bytes": held,
                "kv_flops_per_step": flops, "step_ms": step,
                "step_compiled_ms": roofline_ms(*compiled[self.slots]),
                "step_flops": step_flops,
                "step_bytes": step_bytes, "step_minimum_bytes": weights + held,
                "step_ratio": step_bytes / (weights + held),
                "steps_by_size": {str(k): v for k, v in sched["steps_by_size"].items()},
                "inserts": inserts}

    def weights_bytes(self) -> float:
        """The weights a decode step reads per chip, in the compute dtype: the
        model over every chip of the mesh (the weight-stationary step reads
        each chip's own shard)."""
        chips = self.sharding.mesh.size if self.sharding is not None else 1
        item = jnp.dtype(self.cfg.jnp_compute_dtype).itemsize
        return self.cfg.num_params() * item / chips

    # ------------------------------------------------------------------ host loop

    def run(self, params, prompts: Sequence[Sequence[int]], rng: jax.Array,
            max_prompts: int = 0) -> tuple[Rollout, int]:
        """(Rollout of device arrays over B' * G rows, real rows B * G), as
        `ContinuousEngine.run`, with the page book kept here."""
        tokens, mask, B = self.prepare(prompts)
        self.last_inserts = {}
        Bp, P = tokens.shape
        sc, n, ps = self.sampling, self.slots, self.page_size
        G, N = sc.num_samples, sc.max_new_tokens
        R, real = Bp * G, B * G
        per_call = max_prompts if 0 < max_prompts < B else 0
        book = PageBook(self.shards, n, self.pages_per_shard(P), ps,
                        own_pages(ps, N), self.pages_per_slot(P))
        lengths = mask.sum(axis=1).astype(np.int64)
        state = self._program("start", R, P, per_call)(rng)
        w, head = self._program("weights", R, P)(params)
        buckets = self._query_buckets(Bp)
        occupied = np.full(n, -1)                 # the slot's sample, -1 free
        live = np.zeros(n, bool)
        nxt, stashed, steps, slot_steps = 0, -1, 0, 0
        sizes = self.pool_sizes()
        while True:
            # Samples that ended (in the last decode, or at token 0) give their pages back.
            for slot in np.flatnonzero((occupied >= 0) & ~live):
                book.release(slot, int(occupied[slot]) // G)
                occupied[slot] = -1
            inserted = False
            if nxt < real:
                placed = book.place(nxt, real, G, lengths, occupied)
                if placed:
                    slots_, ids = np.array([p[0] for p in placed]), np.array([p[1] for p in placed])
                    prompt = ids // G
                    fresh = np.unique(prompt[prompt != stashed])
                    Q = next(q for q in buckets if q >= fresh.size)
                    row_of = lambda b: 0 if b == stashed else 1 + int(np.searchsorted(fresh, b))
                    src = np.full(n, -1, np.int32)
                    sample = np.full(n, R, np.int32)
                    table = np.zeros((n, book.per_slot), np.int32)
                    kv_len = np.zeros(n, np.int32)
                    writes = [[] for _ in range(book.shards)]
                    for slot, r in zip(slots_, ids):
                        b = int(r) // G
                        src[slot], sample[slot] = row_of(b), r
                        table[slot], kv_len[slot] = book.table(slot), lengths[b]
                        start = P - int(lengths[b])
                        d = book.shard(slot)
                        for i, page in book.pending_prompt_writes(slot, b):
                            writes[d].append((row_of(b), start + i * ps, page))
                        full = int(lengths[b]) // ps
                        writes[d].append((row_of(b), start + full * ps, book.first_own(slot)))
                        occupied[slot] = r
                    keep = row_of(int(prompt[-1]))
                    W = self._writes(Q, P)
                    wr = np.zeros((3, book.shards, W), np.int32)
                    wr[2] = book.per_shard                        # out of range: no write
                    for d, ws in enumerate(writes):
                        if ws:
                            wr[:, d, :len(ws)] = np.array(ws, np.int32).T
                    wr = wr.reshape(3, -1)
                    q_tok, q_mask = self._insert_rows(tokens, mask, fresh, Q)
                    state = self._program("insert", R, P, 0, Q)(
                        state, w, head, q_tok, q_mask, src, sample, np.int32(keep), table,
                        kv_len, wr[0], wr[1], wr[2])
                    stashed, nxt = int(prompt[-1]), nxt + len(placed)
                    live = live | (src >= 0)     # till the decode says otherwise
                    inserted = True
            pending = real - nxt
            if not pending and not inserted:
                # The drain: halve the pool while every shard has at most half its slots live.
                while n > sizes[-1] and (keep := shard_keep(live, book.shards)) is not None:
                    state = self._shrink(state, R, P, n, keep)
                    live, occupied, n = live[keep], occupied[keep], n // 2
                    book.shrink(keep)
            free = int(np.sum(occupied < 0))
            refill = drain_refill(free, n, pending, inserted, self.refill, n > sizes[-1])
            state, (live_dev, steps_dev) = self._program("decode", R, P, n=n)(
                state, w, head, np.int32(refill))
            live, total = to_host((live_dev, steps_dev))
            live = np.asarray(live)
            slot_steps += (int(total) - steps) * n
            steps = int(total)
            if nxt == real and not live.any():
                break
        out = self._collect(state, tokens, mask, real, steps, slot_steps)
        self.last_pages = {"pages_per_shard": book.per_shard,
                           "peak_pages_used": int(book.peak), "page_size": ps}
        return out, real


def drain_refill(free: int, n: int, pending: int, inserted: bool, refill: int,
                 smaller: bool) -> int:
    """The free slots at which the next decode call of a pool of n slots
    (free of them idle) stops: waiting for pages (samples pending, none
    inserted), when one more sample ends; with samples pending, the
    engine's refill; draining with a smaller pool left, when half the pool
    is free, or one more sample ends if it already is (a shard with more
    than half its slots live holds the shrink back); else when none is live."""
    if pending and not inserted and free:
        return free + 1
    if pending:
        return min(refill, pending)
    if smaller:
        return n - n // 2 if free < n - n // 2 else free + 1
    return n + 1


def sample_pages(page_size: int, sc: SamplingConfig) -> int:
    """Pages one sample can need on its shard: the longest prompt's
    (sc.max_prompt_len) and its own (`own_pages`)."""
    return -(-sc.max_prompt_len // page_size) + own_pages(page_size, sc.max_new_tokens)


def check_page_size(page_size: int) -> None:
    if page_size < 1 or page_size & (page_size - 1) or page_size > 1024:
        raise ValueError(f"rollout.page_size is {page_size}; it must be a power of two up to "
                         "1024, so that it divides the cache's length (e.g. 16).")


def check_pages(page_size: int, kv_pages: int, sc: SamplingConfig,
                sharding: Sharding | None) -> None:
    """One sentence per bad page setting, before anything compiles."""
    check_page_size(page_size)
    if platform_of(sharding) == "tpu" and page_size < 8:
        raise ValueError(f"rollout.page_size is {page_size}; on TPU the attention kernel's tile "
                         "is 8 entries: set it to a multiple of 8 (e.g. 16).")
    shards = sharding.data_size if sharding is not None else 1
    if kv_pages < 0 or kv_pages % shards:
        raise ValueError(f"rollout.kv_pages is {kv_pages}; it must be 0 (automatic) or a "
                         f"positive multiple of the {shards} data shards the pages lie over.")
    if kv_pages:
        need = sample_pages(page_size, sc)
        if kv_pages // shards < need:
            raise ValueError(
                f"rollout.kv_pages is {kv_pages} ({kv_pages // shards} per data shard); one "
                f"sample needs {need} on a shard (the longest prompt, {sc.max_prompt_len} "
                f"tokens, and a response of up to {sc.max_new_tokens} tokens, in pages of "
                f"{page_size}): raise it to at least {need * shards}, or set 0 for automatic.")


class PageBook:
    """The host's record of the pages: per shard a free list, each prompt's
    whole pages on the shard and how many of its samples there use them, and
    each slot's own pages. Slots [d * slots / shards, (d + 1) * slots / shards)
    lie on shard d; page ids are local to a shard."""

    def __init__(self, shards: int, slots: int, per_shard: int, page_size: int,
                 own: int, per_slot: int):
        self.shards, self.slots, self.per_shard = shards, slots, per_shard
        self.page_size, self.own, self.per_slot = page_size, own, per_slot
        self.free = [list(range(per_shard - 1, -1, -1)) for _ in range(shards)]
        self.prompts: list[dict] = [{} for _ in range(shards)]   # b -> [pages, users, written]
        self.slot_pages: dict[int, list[int]] = {}
        self.slot_prompt: dict[int, int] = {}
        self.peak = 0

    def shard(self, slot: int) -> int:
        return slot // (self.slots // self.shards)

    def _need(self, d: int, b: int, length: int) -> int:
        return self.own + (0 if b in self.prompts[d] else length // self.page_size)

    def place(self, nxt: int, real: int, G: int, lengths, occupied) -> list[tuple[int, int]]:
        """[(slot, sample)]: the pending samples from `nxt` on, in order, each
        in a free slot of a shard with pages for it (its own, and its
        prompt's there if not yet), taking those pages; stops at the first
        sample no free slot can take."""
        out = []
        free_slots = [s for s in range(self.slots) if occupied[s] < 0]
        for r in range(nxt, real):
            b = r // G
            fit = next((s for s in free_slots
                        if len(self.free[self.shard(s)]) >= self._need(self.shard(s), b,
                                                                       int(lengths[b]))), None)
            if fit is None:
                break
            free_slots.remove(fit)
            self._take(fit, b, int(lengths[b]))
            out.append((fit, r))
        used = sum(self.per_shard - len(f) for f in self.free)
        self.peak = max(self.peak, used)
        return out

    def _take(self, slot: int, b: int, length: int) -> None:
        d = self.shard(slot)
        if b not in self.prompts[d]:
            whole = length // self.page_size
            self.prompts[d][b] = [[self.free[d].pop() for _ in range(whole)], 0, False]
        self.prompts[d][b][1] += 1
        self.slot_pages[slot] = [self.free[d].pop() for _ in range(self.own)]
        self.slot_prompt[slot] = b

    def table(self, slot: int) -> np.ndarray:
        """The slot's page table: its prompt's whole pages, then its own."""
        d, b = self.shard(slot), self.slot_prompt[slot]
        row = self.prompts[d][b][0] + self.slot_pages[slot]
        return np.array(row + [0] * (self.per_slot - len(row)), np.int32)

    def pending_prompt_writes(self, slot: int, b: int) -> list[tuple[int, int]]:
        """[(page index in the prompt, local page id)] of the prompt's whole
        pages this insert writes on the slot's shard (once per shard)."""
        d = self.shard(slot)
        rec = self.prompts[d][b]
        if rec[2]:
            return []
        rec[2] = True
        return list(enumerate(rec[0]))

    def first_own(self, slot: int) -> int:
        """The slot's first own page (it receives the prompt's partial last
        page), local to its shard."""
        return self.slot_pages[slot][0]

    def shrink(self, keep) -> None:
        """The pool halved to the slots `keep` names (`shard_keep`): slot j
        is the old slot keep[j], on the same shard."""
        remap = lambda d: {j: d[int(k)] for j, k in enumerate(keep) if int(k) in d}
        self.slot_pages, self.slot_prompt = remap(self.slot_pages), remap(self.slot_prompt)
        self.slots = len(keep)

    def release(self, slot: int, b: int) -> None:
        d = self.shard(slot)
        self.free[d].extend(reversed(self.slot_pages.pop(slot)))
        self.slot_prompt.pop(slot)
        rec = self.prompts[d][b]
        rec[1] -= 1
        if rec[1] == 0:
            self.free[d].extend(reversed(rec[0]))
            del self.prompts[d][b]


def schedule(lengths: Sequence[int], prompt_lengths: Sequence[int], group: int, slots: int,
             shards: int, pages_per_shard: int, page_size: int, max_new_tokens: int,
             refill: int = 0, buckets: Sequence[int] | None = None, prefill=None,
             sizes: Sequence[int] | None = None) -> dict:
    """What `PagedEngine.run` does for samples of these response lengths (in
    sample order, `group` per prompt of prompt_lengths[b] tokens): its host
    loop and page book, replayed without a model (`erpo plan` estimates a
    rollout from it).

    buckets (`_query_buckets`), prefill (longest prompt -> prefill length)
    and sizes (`pool_sizes()`, default the pool alone): the engine's, as the
    continuous `schedule` takes them.
    Returns the continuous `schedule`'s keys ('steps', 'slot_steps',
    'steps_by_size', 'inserts' as (prompts prefilled, rounded up to
    buckets; prefill length or 0): calls) and
    'entries_held' / 'entries_read': summed over the decode steps, the KV
    entries the live slots hold (their prompt's real tokens and the tokens
    fed so far) and the entries of the pages the attention kernel copies
    (ceil(held / page_size) pages a slot), and the same by pool size
    ('held_by_size', 'read_by_size'); 'max_live', the most samples decoding
    at once; 'peak_pages', the most pages in use on a shard.
    """
    refill = refill or max(1, slots // 16)
    sizes = list(sizes or [slots])
    lengths = np.asarray(lengths, np.int64)
    plen = np.asarray(prompt_lengths, np.int64)
    need = np.maximum(lengths - 1, 0)              # decode steps: token 0 comes from the insert
    book = PageBook(shards, slots, pages_per_shard, page_size, own_pages(page_size,
                                                                          max_new_tokens),
                    0)
    left = np.zeros(slots, np.int64)               # decode steps each slot still needs
    pos = np.zeros(slots, np.int64)                # entries each slot holds before its next step
    occupied = np.full(slots, -1)
    nxt, total, n, max_live, stashed = 0, lengths.size, slots, 0, -1
    inserts: dict = {}
    by_size: dict = {}
    held_by: dict = {}
    read_by: dict = {}
    while True:
        for s in np.flatnonzero((occupied >= 0) & (left == 0)):
            book.release(int(s), int(occupied[s]) // group)
            occupied[s] = -1
        inserted = False
        if nxt < total:
            placed = book.place(nxt, total, group, plen, occupied)
            if placed:
                for s, r in placed:
                    occupied[s], left[s], pos[s] = r, need[r], plen[r // group]
                # As the engine: prefill the prompts not in the one-prompt stash.
                prompt = np.array([r for _, r in placed]) // group
                fresh = np.unique(prompt[prompt != stashed])
                q = next(b for b in buckets if b >= fresh.size) if buckets else fresh.size
                t = prefill(int(plen[fresh].max())) if q and fresh.size and prefill else 0
                inserts[q, t] = inserts.get((q, t), 0) + 1
                stashed = int(prompt[-1])
                nxt, inserted = nxt + len(placed), True
        pending = total - nxt
        if not pending and not inserted:
            while n > sizes[-1] and (keep := shard_keep(left > 0, shards)) is not None:
                left, pos, occupied, n = left[keep], pos[keep], occupied[keep], n // 2
                book.shrink(keep)
        live = left > 0
        # Slots that ended at token 0 count as free once released.
        free_now = int(np.sum(~live))
        stop = drain_refill(int(np.sum(occupied < 0)), n, pending, inserted, refill,
                            n > sizes[-1])
        if live.any() and free_now < stop:
            ends = np.sort(left[live])
            run = int(ends[min(stop - free_now, ends.size) - 1])
            k = np.minimum(left[live], run)               # steps each live slot runs
            p0 = pos[live]
            # Entries held at step i: p0 + i + 1 (the fed token written first).
            held_by[n] = held_by.get(n, 0) + int(np.sum(k * p0 + k * (k + 1) // 2))
            read = 0
            for a, b in zip(p0, k):
                e = np.arange(a + 1, a + b + 1)
                read += int(np.sum(-(-e // page_size)) * page_size)
            read_by[n] = read_by.get(n, 0) + read
            max_live = max(max_live, int(live.sum()))
            left[live] -= k
            pos[live] += k
            by_size[n] = by_size.get(n, 0) + run
        elif pending and not inserted and not live.any() and not (occupied >= 0).any():
            raise ValueError("paged schedule: an empty pool has no pages for the next sample.")
        if nxt == total and not (occupied >= 0).any():
            return {"steps": sum(by_size.values()),
                    "slot_steps": sum(k * v for k, v in by_size.items()),
                    "steps_by_size": by_size, "inserts": inserts,
                    "entries_held": sum(held_by.values()), "entries_read": sum(read_by.values()),
                    "held_by_size": held_by, "read_by_size": read_by,
                    "max_live": max_live, "peak_pages": int(book.peak)}
