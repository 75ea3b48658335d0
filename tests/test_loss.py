"""The loss: PG surrogate numbers, aggregation modes, exact gradient routing with
respect to the logits, Query-KL counting and temperature, config and batch errors,
and `loss_fn` (one chunked forward) against `loss_from_stats` on full logits."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.model.config import ModelConfig
from erpo_jax.model.logprobs import TokenLogprobs, logprobs_from_logits
from erpo_jax.model.model import forward
from erpo_jax.rl.batch import RLBatch, as_jax, group_ids, masks_from_layout, validate_batch
from erpo_jax.rl.loss import (LossConfig, loss_fn, loss_from_stats, loss_terms,
                              stats_from_logits)
from erpo_jax.rl.query_kl import query_kl
from erpo_jax.rl.synthetic import random_params, synthetic_batch

TEMP = 0.7
ERPO_ALL = LossConfig(beta_policy=0.1, beta_query=0.5, entropy_coef=0.01, eps_high=0.28,
                      dual_clip=3.0)


@functools.partial(jax.jit, static_argnums=(2, 3))
def terms_of_logits(logits, batch, cfg, temperature=TEMP):
    """(terms, metrics) of `loss_terms` on statistics built from logits (jitted)."""
    return loss_terms(stats_from_logits(logits, batch.tokens[:, 1:], temperature), batch, cfg)


def toy_batch(seed=0, B=2, G=2, Q=5, R=4, V=11, temperature=TEMP):
    """(logits f32[N, T-1, V], RLBatch): random logits; reference and old log-probs near them."""
    rs = np.random.default_rng(seed)
    N, T = B * G, Q + R
    tokens = np.zeros((N, T), np.int32)
    attn = np.zeros((N, T), bool)
    for b in range(B):
        qlen = 3 + b % 2
        query = rs.integers(1, V, qlen)
        for g in range(G):
            n, rlen = b * G + g, 1 + (b + g) % R
            tokens[n, Q - qlen:Q] = query
            tokens[n, Q:Q + rlen] = rs.integers(1, V, rlen)
            attn[n, Q - qlen:Q + rlen] = True
    qm, rm = masks_from_layout(attn, Q)
    logits = jnp.asarray(2.0 * rs.standard_normal((N, T - 1, V)), jnp.float32)
    st = jax.jit(stats_from_logits, static_argnums=2)(logits, jnp.asarray(tokens[:, 1:]),
                                                      temperature)
    noise = lambda: 0.3 * rs.standard_normal((N, T - 1)).astype(np.float32)
    batch = RLBatch(
        tokens=tokens, attn_mask=attn, query_mask=qm, response_mask=rm,
        old_logp=np.where(rm, np.asarray(st.logp) + noise(), 0.0),
        advantages=rs.standard_normal(N).astype(np.float32),
        ref_query_logp=np.where(qm, np.asarray(st.logp_t1) + noise(), 0.0),
        query_weight=rs.uniform(0.5, 1.5, N).astype(np.float32),
        group_id=group_ids(B, G),
        ref_logp=np.where(rm, np.asarray(st.logp) + noise(), 0.0))
    validate_batch(batch, needs_ref_logp=True)
    return logits, as_jax(batch)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def term_grad(name, logits, batch, cfg, temperature=TEMP):
    """(value, d term / d logits) for one term ('total' = loss_from_stats)."""
    targets = batch.tokens[:, 1:]

    def f(lg):
        st = stats_from_logits(lg, targets, temperature)
        if name == "total":
            return loss_from_stats(st, batch, cfg)[0]
        return loss_terms(st, batch, cfg)[0][name]

    return jax.value_and_grad(f)(logits)


@functools.partial(jax.jit, static_argnums=2)
def all_term_grads(logits, batch, cfg, temperature=TEMP):
    """{term: d term / d logits} for every term and 'total' (= loss_from_stats), one compile."""
    names = ("pg", "policy_kl", "query_kl", "entropy")

    def stacked(lg):
        st = stats_from_logits(lg, batch.tokens[:, 1:], temperature)
        terms, _ = loss_terms(st, batch, cfg)
        return jnp.stack([terms[n] for n in names] + [loss_from_stats(st, batch, cfg)[0]])

    jac = jax.jacrev(stacked)(logits)
    return dict(zip(names + ("total",), jac))


# ----------------------------------------------------------------------------- gradient routing


def test_exact_zero_gradients_where_required():
    logits, batch = toy_batch()
    qm, rm = np.asarray(batch.query_mask), np.asarray(batch.response_mask)
    pad = ~(qm | rm)
    g = {n: np.asarray(x) for n, x in all_term_grads(logits, batch, ERPO_ALL).items()}
    # QKL: exactly 0.0 at every response and padding position, non-zero on queries.
    assert np.all(g["query_kl"][rm] == 0) and np.all(g["query_kl"][pad] == 0)
    assert np.abs(g["query_kl"][qm]).sum(-1).min() > 0
    # PG, Policy-KL, entropy: exactly 0.0 at every query and padding position.
    for n in ("pg", "policy_kl", "entropy"):
        assert np.all(g[n][qm] == 0), n
        assert np.all(g[n][pad] == 0), n
        assert np.abs(g[n][rm]).sum() > 0, n
    # The total gradient is the sum of its terms' gradients.
    parts = g["pg"] + g["policy_kl"] + g["query_kl"] + g["entropy"]
    np.testing.assert_allclose(g["total"], parts, rtol=1e-5, atol=1e-7)
    assert np.all(g["total"][pad] == 0)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_qkl_zero_with_zero_gradient_at_reference(estimator):
    logits, batch = toy_batch(seed=1)
    st = stats_from_logits(logits, batch.tokens[:, 1:], TEMP)
    batch = batch._replace(ref_query_logp=jnp.where(batch.query_mask, st.logp_t1, 0.0))
    cfg = LossConfig(beta_query=1.0, query_kl_estimator=estimator)
    val, g = term_grad("query_kl", logits, batch, cfg)
    assert float(val) == 0.0
    assert np.all(np.asarray(g) == 0)
    # ... and away from the reference both are non-zero
    val2, g2 = term_grad("query_kl", logits + 0.3 * jnp.sin(jnp.arange(11.0)), batch, cfg)
    assert float(val2) > 0 and np.abs(np.asarray(g2)).sum() > 0


def test_qkl_counted_once_per_query():
    logits, batch = toy_batch(seed=2)
    cfg = LossConfig(beta_query=1.0)
    idx = jnp.array([0, 1, 0, 1, 2, 3])  # every response of query 0 twice, query 1 once
    dup = jax.tree.map(lambda x: x[idx], batch)
    dup = dup._replace(group_id=jnp.array([0, 0, 0, 0, 1, 1], jnp.int32))

    @jax.jit
    def qkl(lg, b, i):
        st = stats_from_logits(lg[i], b.tokens[:, 1:], TEMP)
        return loss_terms(st, b, cfg)[0]["query_kl"]

    v0, g0 = jax.value_and_grad(qkl)(logits, batch, jnp.arange(4))
    v1, g1 = jax.value_and_grad(qkl)(logits, dup, idx)
    assert float(v1) == pytest.approx(float(v0), rel=1e-6)
    np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-9)
    # counting rows instead of queries would have changed it
    rows = qkl(logits, dup._replace(group_id=jnp.arange(6, dtype=jnp.int32)), idx)
    assert abs(float(rows) - float(v0)) > 1e-4


def test_qkl_uses_temperature_one():
    logits, batch = toy_batch(seed=3)
    cfg = LossConfig(beta_query=1.0)
    terms, metrics = terms_of_logits(logits, batch, cfg)
    lp1, _ = logprobs_from_logits(logits, batch.tokens[:, 1:], 1.0)
    lpt, _ = logprobs_from_logits(logits, batch.tokens[:, 1:], TEMP)
    args = (batch.ref_query_logp, batch.query_mask, batch.group_id)
    assert float(terms["query_kl"]) == pytest.approx(float(query_kl(lp1, *args)), rel=1e-6)
    assert abs(float(query_kl(lpt, *args)) - float(terms["query_kl"])) > 1e-3
    assert float(metrics["query_kl_k1"]) == pytest.approx(float(query_kl(lp1, *args, "k1")),
                                                          rel=1e-5)


# ----------------------------------------------------------------------------- values


HAND_N, HAND_T1 = 4, 4  # every hand-computed batch has this shape (eager ops compile once)


def _pad(a, dtype=np.float32):
    """Zero-pad the leading axis of `a` to HAND_N rows."""
    a = np.asarray(a, dtype)
    return np.concatenate([a, np.zeros((HAND_N - len(a),) + a.shape[1:], dtype)])


def _hand_batch(x_rows, adv=None, weight=None):
    """Rows of response lengths len(x_rows[n]) (missing rows have no response). With
    the default per-token advantages -x and ratio 1, the PG loss of a token is x."""
    rm = np.zeros((HAND_N, HAND_T1), bool)
    adv_tok = np.zeros((HAND_N, HAND_T1), np.float32)
    for n, xs in enumerate(x_rows):
        rm[n, :len(xs)] = True
        adv_tok[n, :len(xs)] = -np.asarray(xs)
    z = np.zeros((HAND_N, HAND_T1), np.float32)
    batch = RLBatch(tokens=np.ones((HAND_N, HAND_T1 + 1), np.int32),
                    attn_mask=np.ones((HAND_N, HAND_T1 + 1), bool),
                    query_mask=np.zeros((HAND_N, HAND_T1), bool), response_mask=rm,
                    old_logp=z, advantages=adv_tok if adv is None else _pad(adv),
                    ref_query_logp=z,
                    query_weight=np.ones(HAND_N) if weight is None else _pad(weight),
                    group_id=np.arange(HAND_N, dtype=np.int32))
    return as_jax(batch)


def _stats(logp, entropy=None):
    logp = jnp.asarray(_pad(logp))
    ent = jnp.zeros_like(logp) if entropy is None else jnp.asarray(_pad(entropy))
    return TokenLogprobs(logp, ent, logp)


def test_aggregation_modes_hand_computed():
    # Response lengths 1, 2, 3 and an empty row; per-token PG values x.
    batch = _hand_batch([[1.0], [2.0, 4.0], [3.0, 3.0, 6.0], []])
    st = _stats(np.zeros((HAND_N, HAND_T1)))
    agg = lambda mode, **kw: float(loss_from_stats(st, batch, LossConfig(agg_mode=mode, **kw))[0])
    assert agg("token_mean") == pytest.approx(19 / 6, rel=1e-6)
    # the empty row is not a sequence to average over ...
    assert agg("seq_mean_token_mean") == pytest.approx((1 + 3 + 4) / 3, rel=1e-6)
    # ... but Dr. GRPO divides by the constant N * C whatever the lengths
    assert agg("seq_sum_norm", seq_sum_norm_const=4.0) == pytest.approx(19 / (4 * 4), rel=1e-6)
    weighted = batch._replace(query_weight=jnp.array([2.0, 1.0, 0.5, 1.0]))
    w = float(loss_from_stats(st, weighted, LossConfig(agg_mode="seq_mean_token_mean"))[0])
    assert w == pytest.approx((2 * 1 + 3 + 0.5 * 4) / 3, rel=1e-6)


def test_pg_surrogate_clip_and_dual_clip():
    ratio = np.array([[1.5, 0.5, 1.1, 5.0]])
    batch = _hand_batch([[0, 0, 0, 0]], adv=[[1.0, -1.0, 1.0, -1.0]])
    st = _stats(np.log(ratio))
    loss, m = loss_from_stats(st, batch, LossConfig())
    # per token: -min(1.5, 1.2) = -1.2 (clipped), max(0.5, 0.8) = 0.8 (clipped), -1.1, 5.0
    assert float(loss) == pytest.approx((-1.2 + 0.8 - 1.1 + 5.0) / 4, rel=1e-6)
    assert float(m["clip_frac"]) == 0.5
    assert float(m["ratio_max"]) == pytest.approx(5.0, rel=1e-6)
    assert float(m["ratio_min"]) == pytest.approx(0.5, rel=1e-6)
    loss, m = loss_from_stats(st, batch, LossConfig(dual_clip=3.0, eps_high=0.28))
    assert float(loss) == pytest.approx((-1.28 + 0.8 - 1.1 + 3.0) / 4, rel=1e-6)
    assert float(m["dual_clip_frac"]) == 0.25


@pytest.mark.parametrize("adv, ratio, want, clipped", [
    (1.0, 1.5, -1.28, 1.0),    # A > 0 above the clip: -A (1 + eps_high)
    (-1.0, 0.5, 0.8, 1.0),     # A < 0 below the clip: max(0.5, 0.8) = -A (1 - eps_low)
    (1.0, 1.25, -1.25, 0.0),   # inside [1 - eps_low, 1 + eps_high]: -A r, no clip
    (-1.0, 0.75, 0.8, 1.0),    # below 1 - eps_low = 0.8 (not below 1 - eps_high = 0.72)
])
def test_clip_higher_one_token_at_a_time(adv, ratio, want, clipped):
    """Clip-higher's asymmetric clip [1 - eps_low, 1 + eps_high] = [0.8, 1.28] on a
    single response token (token_mean, weight 1), so no other token can offset
    it: swapping eps_low and eps_high gives -1.2, 0.72, -1.2 and 0.75 instead."""
    batch = _hand_batch([[0.0]], adv=[[adv, 0.0, 0.0, 0.0]])
    st = _stats(np.log([[ratio, 1.0, 1.0, 1.0]]))
    loss, m = loss_from_stats(st, batch, LossConfig(eps_low=0.2, eps_high=0.28))
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(m["clip_frac"]) == clipped


def test_policy_kl_and_entropy_terms():
    batch = _hand_batch([[0.0, 0.0], [0.0]], adv=np.zeros((HAND_N, HAND_T1)))
    ref = np.zeros((HAND_N, HAND_T1), np.float32)
    ref[0, :2] = [0.2, -1.0]
    ref[1, 0] = 1.0
    batch = batch._replace(ref_logp=jnp.asarray(ref))
    st = _stats(np.zeros((HAND_N, HAND_T1)), entropy=np.full((HAND_N, HAND_T1), 2.0))
    cfg = LossConfig(beta_policy=0.5, entropy_coef=0.1)
    terms, m = loss_terms(st, batch, cfg)
    k3 = [np.exp(0.2) - 1.2, np.exp(-1.0), np.exp(1.0) - 2.0]
    assert float(m["policy_kl"]) == pytest.approx(np.mean(k3), rel=1e-5)
    assert float(terms["policy_kl"]) == pytest.approx(0.5 * np.mean(k3), rel=1e-5)
    assert float(terms["entropy"]) == pytest.approx(-0.2, rel=1e-6)
    assert float(m["entropy"]) == pytest.approx(2.0)


# ----------------------------------------------------------------------------- Policy-KL off


def test_policy_kl_off_never_reads_reference():
    logits, batch = toy_batch(seed=4)
    poisoned = batch._replace(ref_logp=jnp.full(batch.old_logp.shape, jnp.nan))
    cfg = LossConfig(beta_query=0.5)
    for b in (poisoned, batch._replace(ref_logp=None)):
        val, g = term_grad("total", logits, b, cfg)
        assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(g)))
    with pytest.raises(ValueError, match="needs batch.ref_logp"):
        term_grad("total", logits, batch._replace(ref_logp=None), LossConfig(beta_policy=0.1))
    # "kl in reward" mode: the trainer shapes the reward; the loss needs no ref_logp
    reward_mode = LossConfig(beta_policy=0.1, policy_kl_mode="reward")
    assert reward_mode.needs_ref_logp and not reward_mode.policy_kl_in_loss
    val, _ = term_grad("total", logits, batch._replace(ref_logp=None), reward_mode)
    assert np.isfinite(float(val))


# ----------------------------------------------------------------------------- bad input


def test_loss_config_errors():
    with pytest.raises(ValueError, match="query_kl_estimator='k1' cannot be a loss"):
        LossConfig(query_kl_estimator="k1")
    with pytest.raises(ValueError, match="LossConfig.agg_mode is 'mean'"):
        LossConfig(agg_mode="mean")
    with pytest.raises(ValueError, match="seq_sum_norm_const must be a positive"):
        LossConfig(agg_mode="seq_sum_norm")
    with pytest.raises(ValueError, match="LossConfig.eps_low"):
        LossConfig(eps_low=1.0)
    with pytest.raises(ValueError, match="LossConfig.dual_clip"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="LossConfig.beta_query must be >= 0"):
        LossConfig(beta_query=-1.0)
    with pytest.raises(ValueError, match="policy_kl_mode"):
        LossConfig(policy_kl_mode="advantage")


def _np(batch):
    return jax.tree.map(np.asarray, batch)


def test_validate_batch_errors():
    _, batch = toy_batch(seed=5)
    b = _np(batch)
    validate_batch(b, needs_ref_logp=True)
    qm = b.query_mask.copy()
    qm[0] |= b.response_mask[0]
    with pytest.raises(ValueError, match="query_mask and response_mask overlap"):
        validate_batch(b._replace(query_mask=qm))
    with pytest.raises(ValueError, match="no response tokens"):
        validate_batch(b._replace(response_mask=np.zeros_like(b.response_mask)))
    with pytest.raises(ValueError, match=r"RLBatch.old_logp has shape \(4, 7\)"):
        validate_batch(b._replace(old_logp=b.old_logp[:, :-1]))
    with pytest.raises(ValueError, match="RLBatch.advantages has shape"):
        validate_batch(b._replace(advantages=np.zeros((4, 3), np.float32)))
    pad_q = b.query_mask.copy()
    pad_q[0, 0] = True  # the prediction from a left-padding slot
    with pytest.raises(ValueError, match="padding"):
        validate_batch(b._replace(query_mask=pad_q))
    with pytest.raises(ValueError, match="ref_logp is None"):
        validate_batch(b._replace(ref_logp=None), needs_ref_logp=True)
    bad = b.old_logp.copy()
    bad[b.response_mask] = np.nan
    with pytest.raises(ValueError, match="old_logp has non-finite"):
        validate_batch(b._replace(old_logp=bad))


def test_trace_time_shape_errors_and_nan_free_empty_batch():
    logits, batch = toy_batch(seed=6)
    st = stats_from_logits(logits, batch.tokens[:, 1:], TEMP)
    jitted = jax.jit(loss_from_stats, static_argnums=2)
    with pytest.raises(ValueError, match="batch.old_logp has shape"):
        jitted(st, batch._replace(old_logp=batch.old_logp[:, :-1]), ERPO_ALL)
    with pytest.raises(ValueError, match="batch.query_weight has shape"):
        jitted(st, batch._replace(query_weight=batch.query_weight[:2]), ERPO_ALL)
    with pytest.raises(ValueError, match="one column fewer than tokens"):
        jitted(st, batch._replace(tokens=batch.tokens[:, :-1]), ERPO_ALL)
    empty = batch._replace(response_mask=jnp.zeros_like(batch.response_mask),
                           query_mask=jnp.zeros_like(batch.query_mask))
    for mode in ("token_mean", "seq_mean_token_mean"):
        cfg = dataclasses.replace(ERPO_ALL, agg_mode=mode)
        val, g = term_grad("total", logits, empty, cfg)
        assert float(val) == 0.0 and np.all(np.asarray(g) == 0)
        _, metrics = loss_from_stats(st, empty, cfg)
        assert all(np.isfinite(float(v)) for v in metrics.values())


def test_masks_from_layout():
    attn = np.array([[0, 0, 1, 1, 1, 1, 1, 0]], bool)  # [pad pad x1 x2 x3 | y1 y2 pad]
    qm, rm = masks_from_layout(attn, query_width=5)
    np.testing.assert_array_equal(qm[0], [0, 0, 1, 1, 0, 0, 0])  # targets x2, x3
    np.testing.assert_array_equal(rm[0], [0, 0, 0, 0, 1, 1, 0])  # targets y1, y2


# ----------------------------------------------------------------------------- the real model


def test_loss_fn_matches_full_logits():
    cfg = ModelConfig()
    params = random_params(cfg, 0)
    batch = synthetic_batch(params, cfg, 0, num_queries=2, group_size=2, query_width=6,
                            response_width=6, temperature=TEMP)
    validate_batch(_np(batch), needs_ref_logp=True)

    @functools.partial(jax.jit, static_argnames=("loss_cfg",))
    @chex.assert_max_traces(n=1)
    def both(params, batch, loss_cfg):
        chunked = loss_fn(params, cfg, batch, loss_cfg, TEMP, chunk_size=4)
        logits, _ = forward(params, cfg, batch.tokens, attn_mask=batch.attn_mask)
        full = loss_from_stats(stats_from_logits(logits[:, :-1], batch.tokens[:, 1:], TEMP),
                               batch, loss_cfg)
        return chunked, full

    (l1, m1), (l2, m2) = both(params, batch, ERPO_ALL)
    assert float(l1) == pytest.approx(float(l2), rel=1e-5, abs=1e-7)
    for k in m1:
        assert float(m1[k]) == pytest.approx(float(m2[k]), rel=1e-4, abs=1e-6), k
    assert float(m1["query_kl"]) > 0 and float(m1["policy_kl"]) > 0
    # a new batch of the same shapes reuses the compiled step (no retrace)
    (l3, _), _ = both(params, batch._replace(advantages=-batch.advantages), ERPO_ALL)
    assert float(l3) != float(l1)
