"""The paged rollout engine draws the static engine's samples (same tokens,
log-probs to float rounding, same masks, lengths and truncation flags)
whatever its pool, page size, page count and refill order, sharded or not,
keyed as the static engine's calls of max_prompts_per_call; a pool short of
pages waits instead of failing; the bad page settings it refuses."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding, make_mesh
from erpo_jax.rollout.paged import PagedEngine, own_pages, schedule
from erpo_jax.rollout.static import StaticEngine
from erpo_jax.rollout.types import SamplingConfig

from engine_checks import assert_same_samples

CFG = ModelConfig()          # the tiny preset: vocab 256, 2 layers
KEY = jax.random.key(7)
EOS = tuple(range(5, 21))    # lengths about geometric, mean 16 (test_engines.py)
SC = SamplingConfig(max_new_tokens=40, num_samples=4, eos_ids=EOS, top_k=50)


@pytest.fixture(scope="module")
def params():
    p = model_lib.init_params(CFG, jax.random.key(0))
    return {**p, "lm_head": p["lm_head"] * 0.5}


def _prompts(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(21, CFG.vocab_size, size=k).tolist() for k in rng.integers(2, 14, size=n)]


PROMPTS = _prompts(7)     # 28 samples; prompts of 2 to 13 tokens: whole and partial pages


@pytest.fixture(scope="module")
def static_out(params):
    out = StaticEngine(CFG, SC).sample(params, PROMPTS, KEY)
    assert out.lengths.min() == 1 and out.lengths.max() == SC.max_new_tokens
    return out


@pytest.mark.long(when=lambda p: p["slots"] in (9, 64))
@pytest.mark.parametrize("slots, page_size", [(1, 4), (4, 8), (9, 2), (64, 16)])
def test_paged_equals_static_for_any_pool_and_page_size(params, static_out, slots, page_size):
    engine = PagedEngine(CFG, SC, slots=slots, page_size=page_size)
    out = engine.sample(params, PROMPTS, KEY)
    assert_same_samples(static_out, out, f"slots={slots} page_size={page_size}")
    pages = engine.last_pages
    assert 0 < pages["peak_pages_used"] <= pages["pages_per_shard"]


def test_a_pool_short_of_pages_waits_for_pages_and_draws_the_same_samples(params, static_out):
    """16 slots but pages for about 8 samples' longest responses: inserting
    waits for pages to free (fewer samples run at once than slots), and the
    samples do not change."""
    sc = SamplingConfig(**{**SC.__dict__, "max_prompt_len": 16})
    per_sample = own_pages(4, SC.max_new_tokens)                 # 11 pages of 4
    kv_pages = 4 * 4 + 8 * per_sample                            # prompts' pages + 8 samples
    roomy = PagedEngine(CFG, sc, slots=16, page_size=4)
    tight = PagedEngine(CFG, sc, slots=16, page_size=4, kv_pages=kv_pages)
    a, b = roomy.sample(params, PROMPTS, KEY), tight.sample(params, PROMPTS, KEY)
    assert_same_samples(static_out, b, "kv_pages short")
    assert_same_samples(a, b, "kv_pages short against roomy")
    assert tight.last_pages["peak_pages_used"] <= kv_pages
    # Fewer samples at once: more decode steps than the roomy pool's.
    assert tight.last_stats["decode_steps"] > roomy.last_stats["decode_steps"]
    # The schedule `erpo plan` replays from lengths alone is the one each engine ran.
    for engine, out in ((roomy, a), (tight, b)):
        plan = schedule(out.lengths, [len(x) for x in PROMPTS], SC.num_samples, 16, 1,
                        engine.last_pages["pages_per_shard"], 4, SC.max_new_tokens,
                        sizes=engine.pool_sizes())
        assert plan["steps"] == engine.last_stats["decode_steps"]
        assert plan["peak_pages"] == engine.last_pages["peak_pages_used"]
    assert plan["max_live"] < 16


@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_inserts_prefill_at_the_shortest_length_holding_their_prompts(params, static_out, kind):
    """With the prefill floor lowered to 1, the inserts of a call whose
    bucket is 16 prefill at 2, 4, 8 or 16 tokens (the last columns of the
    left-padded rows; the first, of prompts of 12, 9 and 8 tokens, at 16):
    the samples are the static engine's, and the
    schedule `erpo plan` replays from the lengths alone makes the same
    inserts at the same prefill lengths."""
    from erpo_jax.rollout import continuous
    plen = [len(x) for x in PROMPTS]
    if kind == "paged":
        engine = PagedEngine(CFG, SC, slots=9, page_size=4)
    else:
        engine = continuous.ContinuousEngine(CFG, SC, slots=9)
    engine.prefill_floor = 1
    assert engine.prefill_lengths(16) == [2, 4, 8, 16]
    out = engine.sample(params, PROMPTS, KEY)
    assert_same_samples(static_out, out, f"{kind}, prefill below the bucket")
    lengths = {t for (q, t) in engine.last_inserts if q}
    assert min(lengths) < 8 and max(lengths) <= 16 and len(lengths) > 1
    prefill = lambda longest: engine.prefill_length(16, longest)
    if kind == "paged":
        plan = schedule(out.lengths, plen, SC.num_samples, 9, 1,
                        engine.last_pages["pages_per_shard"], 4, SC.max_new_tokens, 0,
                        engine._query_buckets(len(PROMPTS)), prefill, engine.pool_sizes())
    else:
        plan = engine.schedule(out.lengths, len(PROMPTS), plen, 16)
    assert plan["inserts"] == engine.last_inserts


@pytest.mark.long(when=lambda p: p["change"].get("max_new_tokens") == 1)
@pytest.mark.parametrize("change", [dict(greedy=True, min_new_tokens=3),
                                    dict(max_new_tokens=1)])
def test_paged_equals_static_other_samplings(params, change):
    sc = SamplingConfig(**{**SC.__dict__, **change})
    want = StaticEngine(CFG, sc).sample(params, PROMPTS, KEY)
    got = PagedEngine(CFG, sc, slots=5, page_size=4).sample(params, PROMPTS, KEY)
    assert_same_samples(want, got, str(change))


@pytest.mark.long(when=lambda p: p["max_prompts"] == 3)
@pytest.mark.parametrize("max_prompts", [3, len(PROMPTS)])
def test_max_prompts_keys_as_the_static_calls(params, max_prompts):
    want = StaticEngine(CFG, SC).sample(params, PROMPTS, KEY, max_prompts=max_prompts)
    got = PagedEngine(CFG, SC, slots=6, page_size=4).sample(params, PROMPTS, KEY,
                                                            max_prompts=max_prompts)
    assert_same_samples(want, got, f"max_prompts={max_prompts}")


@pytest.mark.parametrize("mesh", [(4, 2, 1), (2, 1, 2)])
def test_sharded_equals_static(params, static_out, mesh):
    """Slots, page tables and pages over the data axis (page ids local to
    each shard, a prompt's pages written on every shard that runs one of
    its samples); on (2, 1, 2) the attention's heads over the tensor axis."""
    sh = Sharding(make_mesh(mesh, jax.devices()[:int(np.prod(mesh))]))
    p = jax.device_put(params, model_lib.param_shardings(CFG, sh))
    engine = PagedEngine(CFG, SC, sh, slots=8, page_size=4)
    out = engine.sample(p, PROMPTS, KEY)
    assert_same_samples(static_out, out, f"mesh={mesh}")


def test_the_pool_drains_shard_by_shard_and_draws_the_same_samples(params, static_out):
    """Once nothing is pending the pool halves while every shard has at most
    half its slots live, each slot staying on its shard (its table names
    that shard's pages): 8 slots over 2 data shards drain to 4 and 2 (a
    pool halved by its live slots alone would move one to the other shard).
    The samples are the static engine's, and the schedule `erpo plan`
    replays from the lengths makes the same steps at the same pool sizes."""
    sh = Sharding(make_mesh((2, 1, 1), jax.devices()[:2]))
    p = jax.device_put(params, model_lib.param_shardings(CFG, sh))
    engine = PagedEngine(CFG, SC, sh, slots=8, page_size=4)
    assert engine.pool_sizes() == [8, 4, 2]
    out = engine.sample(p, PROMPTS, KEY)
    assert_same_samples(static_out, out, "a draining pool over 2 shards")
    plan = schedule(out.lengths, [len(x) for x in PROMPTS], SC.num_samples, 8, 2,
                    engine.last_pages["pages_per_shard"], 4, SC.max_new_tokens, 0,
                    engine._query_buckets(len(PROMPTS)),
                    lambda longest: engine.prefill_length(16, longest), engine.pool_sizes())
    assert len(plan["steps_by_size"]) > 2, plan["steps_by_size"]
    stats = engine.last_stats
    assert plan["steps"] == stats["decode_steps"]
    useful = int((static_out.lengths - 1).sum())
    assert stats["slot_utilization"] == pytest.approx(useful / plan["slot_steps"])


def test_the_plan_costs_each_pool_size_by_its_own_step():
    """`plan_estimate` with a draining pool: each size's steps at that size's
    compiled step plus the KV its slots read there (counted from the page
    book by size), not every step at the full pool's cost."""
    engine = PagedEngine(CFG, SC, slots=16, page_size=4)
    sizes = engine.pool_sizes()
    assert sizes == [16, 8, 4, 2]
    compiled = {n: (1e6 * n, 1e5 + 1e3 * n) for n in sizes}      # (FLOPs, bytes) of a step
    roofline = lambda flops, nbytes: max(flops / 1e12, nbytes / 1e9) * 1e3
    lengths = np.random.default_rng(3).integers(1, SC.max_new_tokens + 1, size=64)
    plen = [4, 9, 2, 13] * 4
    est = engine.plan_estimate(lengths, 16, 13, 0, lambda part: 1.0, None,
                               step_cost=lambda key: compiled[int(key.split()[1])],
                               roofline_ms=roofline, prompt_lengths=plen)
    sched = schedule(lengths, plen, SC.num_samples, 16, 1, engine.pages_per_shard(16), 4,
                     SC.max_new_tokens, 0, engine._query_buckets(16),
                     lambda longest: engine.prefill_length(16, longest), sizes)
    assert len(sched["steps_by_size"]) > 2
    entry = engine.kv_entry_bytes()
    at = lambda n, m, k: roofline(  # k steps at size n, costed by size m's compiled step
        compiled[m][0] + sched["held_by_size"][n] * engine.kv_entry_flops() / k,
        compiled[m][1] + sched["read_by_size"][n] * entry / k)
    by_size = sched["steps_by_size"].items()
    assert est["decode_ms"] == pytest.approx(sum(k * at(n, n, k) for n, k in by_size),
                                             rel=1e-12)
    assert est["decode_ms"] < sum(k * at(n, 16, k) for n, k in by_size)
    assert est["steps_by_size"] == {str(n): k for n, k in sched["steps_by_size"].items()}
    k = sched["steps_by_size"][16]
    assert est["kv_read_per_step_bytes"] == pytest.approx(sched["read_by_size"][16] * entry / k)


def test_bfloat16_rows_whose_tokens_differ_are_counted(params):
    """In bfloat16 the paged attention sums in another order than the static
    engine's: a draw may flip where rounding moves it across a token
    boundary. Count the rows that differ, and check the log-probs up to
    each row's first difference."""
    cfg = ModelConfig(compute_dtype="bfloat16")
    want = StaticEngine(cfg, SC).sample(params, PROMPTS, KEY)
    got = PagedEngine(cfg, SC, slots=8, page_size=4).sample(params, PROMPTS, KEY)
    differ = np.any(want.response_tokens != got.response_tokens, axis=1)
    print(f"bfloat16: {int(differ.sum())} of {differ.size} rows differ")
    assert differ.sum() <= differ.size // 4
    for w, g, wl, gl in zip(want.response_tokens, got.response_tokens, want.logp, got.logp):
        same = np.cumprod(w == g).astype(bool)
        np.testing.assert_allclose(wl[same], gl[same], atol=0.1)


def test_bad_page_settings_are_refused_naming_the_field():
    sh = Sharding(make_mesh((4, 1, 1)))
    for kw, match in ((dict(page_size=3), r"rollout.page_size is 3; .*power of two"),
                      (dict(page_size=0), r"rollout.page_size is 0"),
                      (dict(kv_pages=10), r"rollout.kv_pages is 10; .*multiple of the 4 data "),
                      (dict(kv_pages=40), r"rollout.kv_pages is 40 \(10 per data shard\); one "
                                          r"sample needs 36 on a shard")):
        with pytest.raises(ValueError, match=match):
            PagedEngine(CFG, SC, sh, slots=8, **kw)
    with pytest.raises(ValueError, match=r"rollout.slots \(6\).*multiple of the data-parallel"):
        PagedEngine(CFG, SC, sh, slots=6)
    with pytest.raises(ValueError, match="rollout.paged_attention is 'flash'"):
        PagedEngine(CFG, SC, slots=4, attention="flash")

