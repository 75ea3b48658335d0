"""Sampler: parity with transformers' greedy generate, log-probs that match the
teacher-forced recompute, the sampling distribution itself, prefix sharing,
sharding invariance, truncation sets, stop flags, bucketing and errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.hf import load_hf
from erpo_jax.model.logprobs import token_logprobs
from erpo_jax.model.sharding import Sharding, make_mesh
from erpo_jax.rollout.decode import decode_responses, response_lengths, truncate_responses
from erpo_jax.rollout.choice import kth_largest, truncate_logits
from erpo_jax.rollout.prompts import bucket_length
from erpo_jax.rollout.static import MIN_PHASE_TOKENS, StaticEngine, cache_phase_lengths
from erpo_jax.rollout.types import SamplingConfig, rollout_key
from engine_checks import all_gather_sizes as _all_gather_sizes
from hf_models import build_tiny_hf

CFG = ModelConfig()  # the tiny preset: vocab 256, 2 layers
SEED = jax.random.key(1234)


@pytest.fixture(scope="module")
def params():
    return model_lib.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def sharp_params(params):
    """A peaked next-token distribution (a few dozen likely tokens), so that a
    change of temperature is clearly visible in sampled frequencies."""
    return {**params, "lm_head": params["lm_head"] * 12.0}


def _prompts(rng: np.random.Generator, lengths, vocab=CFG.vocab_size):
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def _full_sequences(out):
    """Prompt + response as one left-padded batch: tokens, mask [R, P + N]."""
    tokens = np.concatenate([out.prompt_tokens, out.response_tokens], axis=1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], axis=1)
    return jnp.asarray(tokens), jnp.asarray(mask)


# ----------------------------------------------------------------------------- transformers


def _hf_greedy(model, prompts, n_new, pad_id, eos_id):
    import torch
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id)
    gen = out[:, T:].numpy()
    return np.pad(gen, ((0, 0), (0, n_new - gen.shape[1])), constant_values=pad_id)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_greedy_matches_transformers_generate(kind, tmp_path):
    torch = pytest.importorskip("torch")
    model = build_tiny_hf(kind, tmp_path)
    with torch.no_grad():  # larger weights: varied continuations, no near-ties in the argmax
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(4.0)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, params = load_hf(tmp_path)
    assert cfg.family == kind
    prompts = _prompts(np.random.default_rng(3), (5, 11, 2, 8), cfg.vocab_size)
    n_new, pad = 64, 0     # three cache phases (`cache_phase_lengths`)
    # An EOS id that greedy decoding emits mid-way through a row, and not
    # earlier in that row, so that stopping and padding are compared too.
    free = _hf_greedy(model, prompts, n_new, pad, eos_id=None)
    row, eos = next((r, int(t)) for r in range(len(prompts))
                    for i, t in enumerate(free[r]) if i >= 4 and t not in free[r, :i])
    ref = _hf_greedy(model, prompts, n_new, pad, eos_id=eos)

    sampler = StaticEngine(cfg, SamplingConfig(max_new_tokens=n_new, greedy=True, eos_ids=(eos,),
                                               pad_id=pad, max_prompt_len=32))
    assert len(sampler.cache_phases(len(prompts), 11)) == 3
    out = sampler(params, prompts, SEED)
    np.testing.assert_array_equal(out.response_tokens, ref)
    stopped = np.isin(ref, [eos]).any(axis=1)
    assert stopped[row] and np.array_equal(out.truncated, ~stopped)


# ----------------------------------------------------------------------------- shared samples

MAIN = SamplingConfig(max_new_tokens=10, num_samples=4, temperature=0.8, top_p=0.8,
                      eos_ids=(9,), max_prompt_len=16)


@jax.jit
def _forward_logits(params, tokens, mask):
    return model_lib.forward(params, CFG, tokens, attn_mask=mask)[0]


@pytest.fixture(scope="module")
def main_sampler():
    return StaticEngine(CFG, MAIN)


@pytest.fixture(scope="module")
def main_prompts():
    return _prompts(np.random.default_rng(2), (6, 3, 8))


@pytest.fixture(scope="module")
def main_out(main_sampler, sharp_params, main_prompts):
    return main_sampler(sharp_params, main_prompts, SEED)


def test_logp_equals_teacher_forced_recompute(sharp_params, main_out):
    tokens, mask = _full_sequences(main_out)
    P, N = main_out.prompt_tokens.shape[1], MAIN.max_new_tokens
    recompute = jax.jit(token_logprobs, static_argnums=(1,),
                        static_argnames=("temperature", "chunk_size"))
    ref = recompute(sharp_params, CFG, tokens, mask, temperature=MAIN.temperature, chunk_size=None)
    ref = np.asarray(ref.logp)[:, P - 1:P - 1 + N]
    m = main_out.response_mask
    assert m.sum() > 20
    np.testing.assert_allclose(main_out.logp[m], ref[m], atol=1e-5, rtol=0)
    assert np.all(main_out.logp[~m] == 0.0)
    # The recompute at temperature 1 disagrees: the comparison has teeth.
    other = recompute(sharp_params, CFG, tokens, mask, temperature=1.0, chunk_size=None).logp
    assert np.abs(np.asarray(other)[:, P - 1:P - 1 + N][m] - main_out.logp[m]).max() > 1e-2


def _check_kept(params, out, sc: SamplingConfig):
    """Every sampled token lies in the top-k / top-p set of its own step's
    logits, recomputed teacher-forced."""
    tokens, mask = _full_sequences(out)
    P, N = out.prompt_tokens.shape[1], sc.max_new_tokens
    z = np.asarray(_forward_logits(params, tokens, mask), np.float64)
    z = z[:, P - 1:P - 1 + N] / sc.temperature                          # [R, N, V]
    m, tok = out.response_mask, out.response_tokens
    order = np.argsort(-z, axis=-1)
    rank = np.argmax(order == tok[..., None], axis=-1)
    if sc.top_k:
        assert rank[m].max() < sc.top_k
    if sc.top_p < 1:
        desc = np.take_along_axis(z, order, axis=-1)
        if sc.top_k:
            desc = desc[..., :sc.top_k]
        p = np.exp(desc - desc[..., :1])
        p /= p.sum(-1, keepdims=True)
        mass_before = np.take_along_axis(np.cumsum(p, -1) - p, rank[..., None], -1)[..., 0]
        assert mass_before[m].max() < sc.top_p + 1e-5
        # ... and the bound is not vacuous: some step had tokens cut off.
        assert (p.shape[-1] - (np.cumsum(p, -1) - p < sc.top_p).sum(-1))[m].max() > 0
    assert len(np.unique(tok[:, 0])) > 1                               # really sampling


def test_top_p_only_emits_the_nucleus(sharp_params, main_out):
    _check_kept(sharp_params, main_out, MAIN)


def test_top_k_and_top_p_only_emit_kept_tokens(sharp_params):
    sc = dataclasses.replace(MAIN, top_k=5, top_p=0.6, temperature=1.0, eos_ids=())
    out = StaticEngine(CFG, sc)(sharp_params, _prompts(np.random.default_rng(1), (4, 7, 2)), SEED)
    _check_kept(sharp_params, out, sc)


def test_truncate_logits_keeps_the_nucleus():
    z = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    kept = np.isfinite(np.asarray(truncate_logits(z, 0, 0.75)))
    np.testing.assert_array_equal(kept, [[1, 1, 0, 0], [0, 0, 1, 1]])
    kept = np.isfinite(np.asarray(truncate_logits(z, 3, 0.9)))   # 0.5/0.95, 0.8/0.95 < 0.9
    np.testing.assert_array_equal(kept, [[1, 1, 1, 0], [0, 1, 1, 1]])
    kept = np.isfinite(np.asarray(truncate_logits(z, 2, 1.0)))
    np.testing.assert_array_equal(kept, [[1, 1, 0, 0], [0, 0, 1, 1]])
    kept = np.isfinite(np.asarray(truncate_logits(z, 0, 0.01)))  # the argmax always survives
    np.testing.assert_array_equal(kept.sum(-1), [1, 1])



def test_kth_largest_is_lax_top_k_bit_for_bit():
    """The CPU's top-k threshold (bisection on the float bits) equals lax.top_k's
    k-th value on rows with repeats (bfloat16-rounded logits), both signs,
    signed zeros and -inf (masked tokens), for k from 1 to V."""
    rng = np.random.default_rng(0)
    z = rng.normal(0, 4, (6, 1000)).astype(np.float32)
    z[1] = np.asarray(jnp.asarray(z[1]).astype(jnp.bfloat16).astype(jnp.float32))  # many ties
    z[2, :500] = -np.inf
    z[3, ::2], z[3, 1::2] = 0.0, -0.0
    z[4] = -np.abs(z[4])
    z[5] = 3.0                                                                   # one value
    z = jnp.asarray(z)
    for k in (1, 2, 50, 499, 500, 501, 999, 1000):
        want = jax.lax.top_k(z, k)[0][:, -1:]
        got = kth_largest(z, k)
        np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(want).view(np.int32),
                                      err_msg=f"k={k}")
        np.testing.assert_array_equal(np.asarray(truncate_logits(z, k, 1.0, "cpu")),
                                      np.asarray(truncate_logits(z, k, 1.0, "tpu")))


def test_kth_largest_candidate_blocks_are_lax_top_k_bit_for_bit():
    """Rows long enough for the candidate pass (V >= 4 k b for blocks of b),
    built to break it: block maxima tied at the k-th one, the k-th largest
    repeated across and within blocks, the top entries crowded into few
    blocks, a length that is no multiple of the block, and -inf."""
    from erpo_jax.rollout.choice import kth_block
    rng = np.random.default_rng(1)
    V = 8192 + 7
    b = kth_block(V)
    assert V >= 4 * 64 * b                          # every k below takes the pass
    z = rng.normal(0, 3, (7, V)).astype(np.float32)
    z[1] = np.round(z[1])                                   # few values, many ties
    z[2] = -5.0
    z[2, :3 * b] = rng.normal(10, 1, 3 * b)  # the top crowded into 3 blocks
    z[3] = 1.0
    z[3, ::b] = 2.0                                 # every block's maximum ties
    z[4, V // 2:] = -np.inf
    z[5] = np.asarray(jnp.asarray(z[5]).astype(jnp.bfloat16).astype(jnp.float32))
    z[6] = 0.0                                              # one value
    z = jnp.asarray(z)
    for k in (1, 7, 50, 64):
        want = jax.lax.top_k(z, k)[0][:, -1:]
        got = kth_largest(z, k)
        np.testing.assert_array_equal(np.asarray(got).view(np.int32),
                                      np.asarray(want).view(np.int32), err_msg=f"k={k}")


# ----------------------------------------------------------------------------- distribution


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit, pooling cells with expected count < 5."""
    from scipy import stats
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep])
    return float(stats.chi2.sf(stat, df=keep.sum() - 1))


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


DIST_PROMPT = [11, 42, 7, 99, 3]


@pytest.fixture(scope="module")
def dist_logits(sharp_params):
    return np.asarray(_forward_logits(sharp_params, jnp.asarray([DIST_PROMPT]),
                                      jnp.ones((1, 5), bool))[0, -1], np.float64)


@pytest.mark.parametrize("method", ["inverse_cdf", "gumbel"])
def test_sampled_frequencies_match_tempered_softmax(sharp_params, dist_logits, method):
    sc = SamplingConfig(max_new_tokens=1, num_samples=4096, temperature=0.8, max_prompt_len=8,
                        method=method)
    out = StaticEngine(CFG, sc)(sharp_params, [DIST_PROMPT], SEED)
    counts = np.bincount(out.response_tokens[:, 0], minlength=CFG.vocab_size)
    assert (_softmax(dist_logits / 0.8) > 0.01).sum() >= 5   # a spread, not a near-argmax
    assert _chi2_pvalue(counts, _softmax(dist_logits / 0.8)) > 1e-3
    # The same test rejects nearby wrong temperatures overwhelmingly.
    for wrong in (0.65, 1.0):
        assert _chi2_pvalue(counts, _softmax(dist_logits / wrong)) < 1e-8
    # Without EOS ids every row runs to max_new_tokens and is truncated.
    assert out.truncated.all() and (out.lengths == 1).all() and int(out.num_steps) == 1


def test_inverse_cdf_boundaries_and_zero_probability_tokens():
    """u is located exactly in the cumulative probabilities; a token of
    probability zero (truncated, -inf) is never drawn, even at u -> 1 where
    float rounding could reach the end of the vocabulary."""
    from erpo_jax.rollout.choice import inverse_cdf_sample
    probs = np.zeros(300)
    probs[[3, 17, 150, 299 - 40]] = [0.25, 0.25, 0.25, 0.25]   # trailing zeros, several blocks
    with np.errstate(divide="ignore"):
        z = jnp.asarray(np.log(probs), jnp.float32)[None].repeat(6, 0)
    u = jnp.asarray([0.0, 0.2499, 0.2501, 0.6, 0.9999, 1 - 2.0 ** -24], jnp.float32)
    np.testing.assert_array_equal(np.asarray(inverse_cdf_sample(z, u)), [3, 3, 17, 150, 259, 259])
    # Random logits with random -inf holes: every draw has positive probability,
    # and a dense grid of u reproduces the probabilities.
    rng = np.random.RandomState(0)
    logits = rng.normal(size=(4, 1000)) * 3
    logits[rng.rand(4, 1000) < 0.7] = -np.inf
    logits[:, 0] = 0.0
    grid = (np.arange(20000) + 0.5) / 20000
    zz = jnp.asarray(np.repeat(logits, len(grid), 0), jnp.float32)
    uu = jnp.asarray(np.tile(grid, 4), jnp.float32)
    tok = np.asarray(inverse_cdf_sample(zz, uu)).reshape(4, -1)
    for r in range(4):
        p = np.exp(logits[r] - logits[r].max())
        p /= p.sum()
        assert np.all(p[tok[r]] > 0)
        freq = np.bincount(tok[r], minlength=1000) / len(grid)
        assert np.abs(freq - p).max() <= 2 / len(grid) + 1e-5


def test_unknown_sampling_method_is_named():
    with pytest.raises(ValueError, match="method"):
        SamplingConfig(method="multinomial")


def test_topk_frequencies_match_renormalised_topk(sharp_params, dist_logits):
    k, temp = 4, 0.8
    sc = SamplingConfig(max_new_tokens=1, num_samples=4096, temperature=temp, top_k=k,
                        max_prompt_len=8)
    out = StaticEngine(CFG, sc)(sharp_params, [DIST_PROMPT], SEED)
    z = dist_logits / temp
    top = np.argsort(-z)[:k]
    probs = np.zeros_like(z)
    probs[top] = _softmax(z[top])
    counts = np.bincount(out.response_tokens[:, 0], minlength=CFG.vocab_size)
    assert set(np.flatnonzero(counts)) <= set(top)
    assert _chi2_pvalue(counts, probs) > 1e-3
    # logp is that of the untruncated tempered distribution, not renormalised.
    full = np.log(_softmax(z))
    np.testing.assert_allclose(out.logp[:, 0], full[out.response_tokens[:, 0]], atol=1e-5)


# ----------------------------------------------------------------------------- structure


def test_prefix_sharing_equals_repeated_prompts(sharp_params, main_prompts, main_out):
    G = MAIN.num_samples
    repeated = StaticEngine(CFG, dataclasses.replace(MAIN, num_samples=1))(
        sharp_params, [p for p in main_prompts for _ in range(G)], SEED)
    np.testing.assert_array_equal(main_out.response_tokens, repeated.response_tokens)
    for a, b in zip(main_out, repeated):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # The G samples of one prompt differ from each other.
    assert len({tuple(r) for r in main_out.response_tokens[:G]}) == G


def test_sharded_equals_unsharded(sharp_params, main_prompts, main_out):
    sharding = Sharding(make_mesh((2, 2, 2)))
    assert sharding.data_size == 4
    params = jax.device_put(sharp_params, model_lib.param_shardings(CFG, sharding))
    sampler = StaticEngine(CFG, MAIN, sharding)
    device_out, n_real = sampler.run(params, main_prompts, SEED)    # 3 prompts, padded to 4
    assert n_real == 12 and device_out.response_tokens.shape[0] == 16
    assert device_out.response_tokens.sharding.spec[0] == ("data", "fsdp")
    multi = sampler(params, main_prompts, SEED)
    np.testing.assert_array_equal(multi.response_tokens, main_out.response_tokens)
    np.testing.assert_array_equal(multi.lengths, main_out.lengths)
    np.testing.assert_allclose(multi.logp, main_out.logp, atol=1e-5)


def test_seeding_and_no_recompile(main_sampler, sharp_params, main_prompts, main_out):
    again = main_sampler(sharp_params, main_prompts, SEED)
    np.testing.assert_array_equal(again.response_tokens, main_out.response_tokens)
    other = main_sampler(sharp_params, main_prompts, rollout_key(SEED, 1))
    assert (other.response_tokens != main_out.response_tokens).mean() > 0.3
    # New prompts of the same lengths bucket and count: no new trace.
    main_sampler(sharp_params, _prompts(np.random.default_rng(8), (2, 8, 5)), SEED)
    assert main_sampler.num_traces == 1
    out = main_sampler(sharp_params, _prompts(np.random.default_rng(8), (9, 16, 1)), SEED)
    assert out.prompt_tokens.shape == (12, 16) and main_sampler.num_traces == 2
    assert [bucket_length(n, 8, 32) for n in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    assert bucket_length(40, 8, 48) == 48


def test_prompt_padding_layout(main_out, main_prompts):
    G = MAIN.num_samples
    P = main_out.prompt_tokens.shape[1]
    for b, p in enumerate(main_prompts):
        for g in range(G):
            row = main_out.prompt_tokens[b * G + g]
            np.testing.assert_array_equal(row[P - len(p):], p)
            assert np.all(row[:P - len(p)] == MAIN.pad_id)
            assert main_out.prompt_mask[b * G + g].sum() == len(p)


def test_eos_min_new_tokens_and_flags(params):
    min_new = 3
    eos = tuple(range(2, CFG.vocab_size, 3))        # a third of the vocabulary
    N, pad = 12, 1
    sc = SamplingConfig(max_new_tokens=N, num_samples=16, eos_ids=eos, min_new_tokens=min_new,
                        pad_id=pad, max_prompt_len=8)
    out = StaticEngine(CFG, sc)(params, _prompts(np.random.default_rng(6), (3, 7)), SEED)
    tok, mask = out.response_tokens, out.response_mask
    is_eos = np.isin(tok, eos) & mask
    has_eos = is_eos.any(1)
    first = np.where(has_eos, is_eos.argmax(1), N)
    np.testing.assert_array_equal(out.lengths, np.minimum(first + 1, N))
    np.testing.assert_array_equal(mask, np.arange(N)[None] < out.lengths[:, None])
    np.testing.assert_array_equal(out.truncated, ~has_eos)
    assert np.all(tok[~mask] == pad)
    assert is_eos.sum(1).max() <= 1                # nothing is sampled after the EOS
    assert not np.isin(tok[:, :min_new], eos).any()
    assert out.lengths.min() == min_new + 1         # the first step an EOS is allowed
    if not out.truncated.any():                     # the loop stopped when all rows were done
        assert int(out.num_steps) == out.lengths.max() < N


def test_errors(params):
    sampler = StaticEngine(CFG, SamplingConfig(max_new_tokens=4, max_prompt_len=8))
    with pytest.raises(ValueError, match="prompt list is empty"):
        sampler(params, [], SEED)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler(params, [[1, 2], []], SEED)
    with pytest.raises(ValueError, match="prompt 2 has 9 tokens.*max_prompt_len=8"):
        sampler(params, [[1], [2, 3], list(range(1, 10))], SEED)
    with pytest.raises(ValueError, match="prompt 0 holds token id 256"):
        sampler(params, [[1, 256]], SEED)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingConfig(max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(ValueError, match="eos_ids"):
        StaticEngine(CFG, SamplingConfig(eos_ids=(300,), max_prompt_len=8))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        StaticEngine(CFG, SamplingConfig(max_new_tokens=100, max_prompt_len=4096))
    assert sampler.num_traces == 0


# ----------------------------------------------------------------------------- cache phases


def test_cache_phase_lengths():
    for P, N, phases, platform in [(64, 128, 4, "cpu"), (1024, 3072, 4, "tpu"), (8, 70, 4, "cpu"),
                                   (16, 50, 8, "cpu"), (5, 33, 2, "gpu")]:
        lengths = cache_phase_lengths(P, N, phases, platform)
        S, align = P + N - 1, 8 if platform == "cpu" else 128
        assert lengths[-1] == S and list(lengths) == sorted(set(lengths)) and lengths[0] > P
        assert len(lengths) <= min(phases, (N - 1) // MIN_PHASE_TOKENS)
        assert all(L % align == 0 for L in lengths[:-1])
    assert cache_phase_lengths(64, 128, 4, "cpu") == (96, 128, 160, 191)
    assert cache_phase_lengths(1024, 3072, 4, "tpu") == (1792, 2560, 3328, 4095)
    # One phase, or too few new tokens for more: the whole cache from the start.
    assert cache_phase_lengths(64, 128, 1, "cpu") == (191,)
    assert cache_phase_lengths(32, 32, 4, "cpu") == (63,)
    assert cache_phase_lengths(8, 1, 4, "cpu") == (8,)
    with pytest.raises(ValueError, match="cache_phases must be >= 1"):
        SamplingConfig(cache_phases=0)


PHASED = SamplingConfig(max_new_tokens=70, num_samples=4, temperature=0.8, top_k=20,
                        eos_ids=tuple(range(2, CFG.vocab_size, 32)), min_new_tokens=10,
                        max_prompt_len=16, cache_phases=4)


@pytest.fixture(scope="module")
def phased_out(sharp_params, main_prompts):
    assert len(cache_phase_lengths(8, PHASED.max_new_tokens, PHASED.cache_phases, "cpu")) == 4
    return StaticEngine(CFG, PHASED)(sharp_params, main_prompts, SEED)


def test_cache_phases_equal_one_phase_and_the_recompute(sharp_params, main_prompts, phased_out):
    """Four phases of cache growth draw what one loop over the whole cache
    draws, with the log-probs of the teacher-forced recompute; rows end in
    three of the four phases, some run to the end."""
    out = phased_out
    whole = StaticEngine(CFG, dataclasses.replace(PHASED, cache_phases=1))(sharp_params,
                                                                            main_prompts, SEED)
    np.testing.assert_array_equal(out.response_tokens, whole.response_tokens)
    np.testing.assert_array_equal(out.lengths, whole.lengths)
    np.testing.assert_allclose(out.logp, whole.logp, atol=1e-5, rtol=0)
    P = out.prompt_tokens.shape[1]
    stops = [L - P + 1 for L in cache_phase_lengths(P, PHASED.max_new_tokens, 4, "cpu")]
    assert len(set(np.searchsorted(stops, out.lengths).tolist())) >= 3
    assert out.truncated.any() and not out.truncated.all()
    tokens, mask = _full_sequences(out)
    N = PHASED.max_new_tokens
    ref = jax.jit(token_logprobs, static_argnums=(1,), static_argnames=("temperature",))(
        sharp_params, CFG, tokens, mask, temperature=PHASED.temperature).logp
    m = out.response_mask
    np.testing.assert_allclose(out.logp[m], np.asarray(ref)[:, P - 1:P - 1 + N][m], atol=1e-5)
    # Every row done inside the first phase: the later loops run no step.
    early = StaticEngine(CFG, dataclasses.replace(PHASED, min_new_tokens=0, eos_ids=tuple(
        range(2, CFG.vocab_size))))(sharp_params, main_prompts, SEED)
    assert int(early.num_steps) == 1 and np.all(early.lengths == 1)


def test_cache_phases_sharded_equal_unsharded(sharp_params, main_prompts, phased_out):
    sharding = Sharding(make_mesh((2, 2, 2)))
    params = jax.device_put(sharp_params, model_lib.param_shardings(CFG, sharding))
    multi = StaticEngine(CFG, PHASED, sharding)(params, main_prompts, SEED)
    np.testing.assert_array_equal(multi.response_tokens, phased_out.response_tokens)
    np.testing.assert_allclose(multi.logp, phased_out.logp, atol=1e-5)


# ----------------------------------------------------------------------------- decode


def test_decode_stops_at_first_eos():
    ids = np.array([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 6, 6, 6, 6], [6, 3, 0, 0, 0]])
    mask = np.array([[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], bool)
    table = [chr(ord("a") + i) for i in range(8)]
    np.testing.assert_array_equal(response_lengths(ids, [2, 3]), [2, 5, 0, 1])
    np.testing.assert_array_equal(response_lengths(ids, [2], include_eos=True), [3, 5, 1, 5])
    np.testing.assert_array_equal(response_lengths(ids, [], mask), [3, 5, 1, 2])
    assert decode_responses(ids, [2, 3], token_strings=table) == ["fg", "fffff", "", "g"]
    assert decode_responses(ids, [2], token_strings=table, mask=mask) == ["fg", "fffff", "", "gd"]
    assert [r.tolist() for r in truncate_responses(ids, [2], include_eos=True)][:2] == \
        [[5, 6, 2], [5, 5, 5, 5, 5]]

    class Tok:
        def batch_decode(self, rows, skip_special_tokens=False):
            return ["|".join(map(str, r)) + ("!" if skip_special_tokens else "") for r in rows]

    assert decode_responses(ids, [2], tokenizer=Tok(), skip_special_tokens=True) == \
        ["5|6!", "5|5|5|5|5!", "!", "6|3|0|0|0!"]
    with pytest.raises(ValueError, match="exactly one"):
        decode_responses(ids, [2])



def test_decode_step_moves_activations_not_weights(params, monkeypatch):
    """On an FSDP mesh one decode step gathers no weight: every all-gather is
    activation-sized (rows x hidden, rows x vocab / chips), far below the
    smallest weight matrix. The training rules (FSDP: gather the weights)
    would gather every one of them each step; the test checks that too, so
    it can tell the two apart."""
    sharding = Sharding(make_mesh((1, 4, 1), jax.devices()[:4]))
    sc = dataclasses.replace(MAIN, num_samples=2)
    sampler = StaticEngine(CFG, sc, sharding)
    abstract = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        params, model_lib.param_shardings(CFG, sharding))
    per_layer = [a.shape[1:] for a in jax.tree_util.tree_leaves(params["layers"])]
    smallest_matrix = min(int(np.prod(s)) for s in per_layer if len(s) >= 2)
    rows = 4 * sc.num_samples
    assert rows * CFG.hidden_size <= smallest_matrix / 2, "shapes too close to tell apart"

    hlo = sampler.lower_decode_step(abstract, 4, 8).compile().as_text()
    gathered = _all_gather_sizes(hlo)
    assert gathered and max(gathered) < smallest_matrix, (gathered, smallest_matrix)

    monkeypatch.setattr(Sharding, "weight_stationary", lambda self, mlp_axes=None: self)
    hlo = sampler.lower_decode_step(abstract, 4, 8).compile().as_text()
    assert sum(n >= smallest_matrix for n in _all_gather_sizes(hlo)) >= 4 * CFG.num_layers


def test_head_choose_on_a_vocabulary_split_head_is_choose_on_the_logits():
    """A decode step's draw on the head's vocabulary slices (8 chips of 32
    tokens, blocks of 16; `head.split_draw`) takes the same tokens as
    `choose` on the gathered logits, for a dense grid of uniforms, with EOS
    masked on the rows still under min_new_tokens; logp agree to rounding."""
    from erpo_jax.rollout.choice import choose
    from erpo_jax.rollout.head import decode_head_axes, head_choose, head_logits
    sharding = Sharding(make_mesh((2, 2, 2)))
    assert decode_head_axes(CFG, sharding) == (None, "head_vocab")
    rng = np.random.RandomState(0)
    R, N = 512, 4
    h = jnp.asarray(np.repeat(rng.normal(size=(4, CFG.hidden_size)), R // 4, 0), jnp.float32)
    head = jnp.asarray(rng.normal(size=(CFG.hidden_size, CFG.vocab_size)) * 0.5, jnp.float32)
    grid = (np.arange(R // 4) + 0.5) / (R // 4)
    uniforms = jnp.asarray(np.repeat(np.tile(grid, 4)[:, None], N, 1), jnp.float32)
    step = jnp.asarray(np.arange(R) % 2 * 3, jnp.int32)            # rows at steps 0 and 3
    keys = jax.random.split(jax.random.key(0), R)
    sc = SamplingConfig(max_new_tokens=N, temperature=0.7, eos_ids=(5, 200), min_new_tokens=2)
    want_tok, want_lp = choose(head_logits(h, head, CFG), keys, uniforms, step, sc)
    split = jax.jit(lambda h, w: head_choose(
        h, sharding.constrain(w, decode_head_axes(CFG, sharding)), keys, uniforms, step, sc,
        CFG, sharding))
    tok, lp = split(h, head)
    assert lp.sharding.spec[0] == ("data", "fsdp")                  # on the rows' chips
    tok, want_tok = np.asarray(tok), np.asarray(want_tok)
    assert (tok != want_tok).sum() <= 1                             # a rounding flip at most
    np.testing.assert_allclose(np.asarray(lp)[tok == want_tok],
                               np.asarray(want_lp)[tok == want_tok], atol=2e-5)
    blocked = np.asarray(step) < 2
    assert not np.isin(tok[blocked], [5, 200]).any()
    assert len(set(tok.tolist())) > 20                              # the grid spans many tokens
    # Greedy (and top-k / top-p) draws keep to `choose` on the logits.
    greedy = dataclasses.replace(sc, greedy=True)
    g_tok, _ = jax.jit(lambda h, w: head_choose(h, w, keys, uniforms, step, greedy, CFG,
                                                sharding))(h, head)
    np.testing.assert_array_equal(np.asarray(g_tok), np.asarray(
        choose(head_logits(h, head, CFG), keys, uniforms, step, greedy)[0]))
