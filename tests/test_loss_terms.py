"""Registered pieces: a fifth loss term is one registration (the loss, the
update's micro-batch shares and the gradient inspector all see it), the
advantage estimators' properties drive validation, and the covariance policy
losses (Clip-Cov, KL-Cov) match hand loops of their definition while Query-KL's
exact zeros still hold."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from erpo_jax.model.config import ModelConfig
from erpo_jax.model import model as M
from erpo_jax.rl import estimators, grad_flow
from erpo_jax.rl.loss import LossConfig, loss_from_stats, loss_terms, stats_from_logits
from erpo_jax.rl.recipe import recipe
from erpo_jax.rl.synthetic import synthetic_batch
from erpo_jax.rl.terms import TERMS, Term, register
from erpo_jax.train import train_step as S
from erpo_jax.train.config import AlgoSection, ConfigError, RunConfig, validate
from test_loss import TEMP, term_grad, toy_batch

KEY = jax.random.key(3)


# ----------------------------------------------------------------------------- a fifth term


def _square_logp(inputs):
    """agg(logp^2) over the response positions (a made-up penalty)."""
    return inputs.agg(jnp.square(inputs.logp)), {"square_logp": jnp.zeros(())}


@pytest.fixture
def fifth_term():
    """A term registered for one test, with every trace made under it dropped after."""
    jax.clear_caches()
    term = register(Term("square_logp", _square_logp, coef="entropy_coef", sign=0.5,
                         normaliser="response", active=lambda c: c.entropy_coef == 0.125))
    try:
        yield term
    finally:
        del TERMS["square_logp"]
        jax.clear_caches()


def test_a_registered_term_enters_the_loss_the_shares_and_the_inspector(fifth_term):
    cfg = LossConfig(beta_query=0.5, entropy_coef=0.125)
    logits, batch = toy_batch(seed=4)
    st = stats_from_logits(logits, batch.tokens[:, 1:], TEMP)
    terms, metrics = loss_terms(st, batch, cfg)
    assert list(terms) == ["pg", "policy_kl", "query_kl", "entropy", "square_logp"]
    rm = np.asarray(batch.response_mask)
    want = 0.5 * 0.125 * np.square(np.asarray(st.logp))[rm].mean()
    np.testing.assert_allclose(float(terms["square_logp"]), want, rtol=1e-6)
    assert "square_logp" in metrics and "square_logp" in recipe(
        RunConfig(loss=cfg)).terms
    loss, _ = loss_from_stats(st, batch, cfg)
    np.testing.assert_allclose(float(loss), float(sum(terms.values())), rtol=1e-6)
    # The term's gradient stays on the response positions it reads.
    _, g = term_grad("square_logp", logits, batch, cfg)
    g = np.abs(np.asarray(g)).sum(-1)
    assert np.all(g[~rm] == 0) and np.all(g[rm] > 0)

    # The inspector has its row; its query-position gradient is exactly 0.
    mcfg = ModelConfig()
    params = M.init_params(mcfg, jax.random.key(0))
    b = synthetic_batch(params, mcfg, 0, num_queries=2, group_size=2, query_width=5,
                        response_width=5)
    rep = grad_flow.inspect_gradients(params, mcfg, b, cfg, 1.0)
    assert list(rep["terms"]) == ["pg", "policy_kl", "query_kl", "entropy", "square_logp",
                                  "total"]
    row = rep["terms"]["square_logp"]
    assert row["logit_grad_query"] == 0.0 and row["logit_grad_response"] > 0

    # The update weighs it by its normaliser: 4 micro-batches give the 1-batch update.
    outs = []
    b4 = synthetic_batch(params, mcfg, 1, num_queries=4, group_size=2, query_width=5,
                         response_width=5)
    for micro in (1, 4):
        tx = optax.sgd(1.0)
        upd = S.build_update(mcfg, cfg, AlgoSection(), tx, micro_batches=micro, group_size=2)
        state = S.init_state(jax.tree.map(jnp.copy, params), tx)   # donated
        outs.append(upd(state, b4, None))
    (s1, m1), (s4, m4) = outs
    np.testing.assert_allclose(float(m4["term_square_logp"]), float(m1["term_square_logp"]),
                               rtol=1e-5)
    assert float(m1["term_square_logp"]) > 0
    for a, b in zip(jax.tree_util.tree_leaves(s1.params), jax.tree_util.tree_leaves(s4.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_a_term_name_is_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        register(Term("pg", _square_logp))
    with pytest.raises(ValueError, match="normaliser"):
        Term("x", _square_logp, normaliser="tokens")


# ----------------------------------------------------------------------------- estimators


def test_estimator_properties_drive_the_recipe_and_validation():
    assert {n: (e.min_group, e.needs_critic) for n, e in estimators.ESTIMATORS.items()} == {
        "grpo": (2, False), "dr_grpo": (1, False), "rloo": (2, False), "reinforce": (2, False),
        "reinforce_pp": (1, False), "gae": (1, True)}
    a = AlgoSection(advantage="reinforce_pp")
    assert recipe(RunConfig(algo=a)).token_level
    assert not recipe(RunConfig(algo=dataclasses.replace(a, reinforce_pp_whiten="response"))
                      ).token_level
    assert recipe(RunConfig(algo=AlgoSection(advantage="gae"))).needs_critic
    cfg = lambda adv, g: RunConfig(model=dataclasses.replace(RunConfig().model, init="random"),
                                   algo=AlgoSection(advantage=adv),
                                   rollout=dataclasses.replace(RunConfig().rollout, group_size=g))
    validate(cfg("dr_grpo", 1))
    with pytest.raises(ConfigError, match="at least 2 responses"):
        validate(cfg("rloo", 1))
    # A new estimator is one registration; its minimum group is read from it.
    entry = estimators.register_estimator(estimators.Estimator(
        "median_baseline", lambda r, m, a, g: r - jnp.median(r.reshape(-1, g), axis=1).repeat(g),
        min_group=3))
    try:
        validate(cfg("median_baseline", 3))
        with pytest.raises(ConfigError, match="at least 3 responses"):
            validate(cfg("median_baseline", 2))
    finally:
        del estimators.ESTIMATORS[entry.name]


# ----------------------------------------------------------------------------- Clip-Cov, KL-Cov


def _hand_inputs(logits, batch, cfg):
    st = stats_from_logits(logits, batch.tokens[:, 1:], TEMP)
    rm = np.asarray(batch.response_mask)
    lp = np.asarray(st.logp, np.float64)
    adv = np.where(rm, np.asarray(batch.advantages)[:, None], 0.0)
    log_r = np.where(rm, lp - np.asarray(batch.old_logp), 0.0)
    ratio = np.exp(log_r)
    cov = (adv - adv[rm].mean()) * (lp - lp[rm].mean())
    w = np.asarray(batch.query_weight)[:, None]
    return rm, adv, log_r, ratio, cov, w


def _hand_clip_cov(logits, batch, cfg, key):
    rm, adv, log_r, ratio, cov, w = _hand_inputs(logits, batch, cfg)
    unc, clp = -adv * ratio, -adv * np.clip(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
    pg = np.maximum(unc, clp)
    clipped = rm & (clp > unc)
    eligible = rm & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    draw = np.asarray(jax.random.uniform(key, rm.shape))
    k = max(int(cfg.clip_cov_ratio * rm.sum()), 1)
    cand = sorted((draw[n, t], n * rm.shape[1] + t, (n, t)) for n, t in zip(*np.nonzero(eligible)))
    chosen = np.zeros_like(rm)
    for _, _, (n, t) in cand[:k]:
        chosen[n, t] = True
    pg = np.where(chosen, 0.0, pg)
    return (pg * w)[rm].sum() / rm.sum(), chosen


def _hand_kl_cov(logits, batch, cfg):
    rm, adv, log_r, ratio, cov, w = _hand_inputs(logits, batch, cfg)
    k = max(int(cfg.kl_cov_ratio * rm.sum()), 1)
    order = sorted((-cov[n, t], n * rm.shape[1] + t, (n, t)) for n, t in zip(*np.nonzero(rm)))
    chosen = np.zeros_like(rm)
    for _, _, (n, t) in order[:k]:
        chosen[n, t] = True
    pg = -adv * ratio + np.where(chosen, cfg.kl_cov_coef * np.abs(log_r), 0.0)
    return (pg * w)[rm].sum() / rm.sum(), chosen


@pytest.mark.parametrize("seed", [0, 5])
def test_clip_cov_matches_a_hand_loop_and_detaches_exactly_the_chosen_tokens(seed):
    logits, batch = toy_batch(seed=seed, B=3, G=4, R=6)
    cfg = LossConfig(pg_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-0.5, clip_cov_ub=3.0,
                     beta_query=0.5)
    want, chosen = _hand_clip_cov(logits, batch, cfg, KEY)
    assert 1 < chosen.sum() < batch.response_mask.sum()
    st = stats_from_logits(logits, batch.tokens[:, 1:], TEMP)
    terms, metrics = loss_terms(st, batch, cfg, key=KEY)
    np.testing.assert_allclose(float(terms["pg"]), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["cov_selected_frac"]),
                               chosen.sum() / batch.response_mask.sum(), rtol=1e-6)

    grads = jax.jit(lambda lg: jax.grad(lambda x: loss_terms(
        stats_from_logits(x, batch.tokens[:, 1:], TEMP), batch, cfg, key=KEY)[0]["pg"])(lg))
    plain = dataclasses.replace(cfg, pg_loss="ppo_clip")
    _, g_plain = term_grad("pg", logits, batch, plain)
    g = np.asarray(grads(logits))
    g_plain = np.asarray(g_plain)
    rm, qm = np.asarray(batch.response_mask), np.asarray(batch.query_mask)
    assert np.all(g[chosen] == 0) and np.abs(g_plain[chosen]).sum() > 0
    np.testing.assert_array_equal(g[rm & ~chosen], g_plain[rm & ~chosen])
    assert np.all(g[qm] == 0) and np.all(g[~(qm | rm)] == 0)
    # Query-KL's gradient still never reaches a response position.
    _, gq = term_grad("query_kl", logits, batch, cfg)
    assert np.all(np.asarray(gq)[rm] == 0) and np.abs(np.asarray(gq)[qm]).sum() > 0


@pytest.mark.parametrize("seed", [0, 6])
def test_kl_cov_matches_a_hand_loop_and_penalises_only_the_top_covariance_tokens(seed):
    logits, batch = toy_batch(seed=seed, B=3, G=4, R=6)
    cfg = LossConfig(pg_loss="kl_cov", kl_cov_ratio=0.15, kl_cov_coef=0.7, beta_query=0.5)
    want, chosen = _hand_kl_cov(logits, batch, cfg)
    assert 1 < chosen.sum() < batch.response_mask.sum()
    st = stats_from_logits(logits, batch.tokens[:, 1:], TEMP)
    terms, _ = loss_terms(st, batch, cfg)
    np.testing.assert_allclose(float(terms["pg"]), want, rtol=1e-5, atol=1e-7)
    # d/dlogp: -A r everywhere, plus coef * sign(log r) on the chosen tokens only.
    rm, adv, log_r, ratio, cov, w = _hand_inputs(logits, batch, cfg)
    f = lambda lp: loss_terms(st._replace(logp=lp), batch, cfg)[0]["pg"]
    g = np.asarray(jax.grad(f)(st.logp))
    want_g = (-adv * ratio + np.where(chosen, cfg.kl_cov_coef * np.sign(log_r), 0.0)) * w
    np.testing.assert_allclose(g[rm], want_g[rm] / rm.sum(), rtol=1e-5, atol=1e-8)
    assert np.all(g[~rm] == 0)
    _, gq = term_grad("query_kl", logits, batch, cfg)
    assert np.all(np.asarray(gq)[rm] == 0)


@pytest.mark.parametrize("rounding", [0.0, 3e-5])
def test_kl_cov_on_a_fresh_on_policy_batch_is_the_plain_policy_gradient(rounding):
    # The first pass over a rollout: old_logp are the policy's own log-probs,
    # exactly or to the sampler's rounding. The penalty must push nowhere:
    # loss and gradient are those of -A r, and on the selected tokens the
    # gradient is -A w / n (n response tokens, token mean).
    logits, batch = toy_batch(seed=2, B=3, G=4, R=6)
    st = stats_from_logits(logits, batch.tokens[:, 1:], TEMP)
    rm = np.asarray(batch.response_mask)
    jitter = np.random.default_rng(1).choice([-rounding, rounding], rm.shape)
    batch = batch._replace(old_logp=np.where(rm, np.asarray(st.logp) + jitter, 0.0)
                           .astype(np.float32))
    cfg = LossConfig(pg_loss="kl_cov", kl_cov_ratio=0.3, kl_cov_coef=1.0)
    plain = LossConfig(pg_loss="kl_cov", kl_cov_ratio=0.3, kl_cov_coef=0.0)
    f = lambda c: lambda lp: loss_terms(st._replace(logp=lp), batch, c)[0]["pg"]
    (v, g), (v0, g0) = (jax.value_and_grad(f(c))(st.logp) for c in (cfg, plain))
    assert float(v) == float(v0)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))
    _, chosen = _hand_kl_cov(logits, batch, cfg)
    assert chosen.sum() > 3
    adv = np.asarray(batch.advantages)[:, None] * np.ones(rm.shape)
    w = np.asarray(batch.query_weight)[:, None] * np.ones(rm.shape)
    ratio = np.exp(np.asarray(st.logp) - np.asarray(batch.old_logp))
    np.testing.assert_allclose(np.asarray(g)[chosen], (-adv * ratio * w)[chosen] / rm.sum(),
                               rtol=1e-6)
    # Off-policy (a later mini-batch) the penalty acts: |log r| beyond the band.
    far = batch._replace(old_logp=np.where(rm, np.asarray(st.logp) - 0.05, 0.0)
                         .astype(np.float32))
    f_far = lambda c: jax.grad(lambda lp: loss_terms(st._replace(logp=lp), far, c)[0]["pg"])
    diff = np.asarray(f_far(cfg)(st.logp)) - np.asarray(f_far(plain)(st.logp))
    np.testing.assert_allclose(diff[chosen], np.asarray(w)[chosen] / rm.sum(), rtol=1e-5)


def test_covariance_losses_refuse_what_they_cannot_mean():
    with pytest.raises(ValueError, match="pg_loss is 'cispo'"):
        LossConfig(pg_loss="cispo")
    with pytest.raises(ValueError, match="clip_cov_lb"):
        LossConfig(pg_loss="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        LossConfig(pg_loss="kl_cov", kl_cov_ratio=0.0)
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(pg_loss="kl_cov", dual_clip=3.0)
    with pytest.raises(ValueError, match="kl_cov_tol"):
        LossConfig(pg_loss="kl_cov", kl_cov_tol=-1e-4)
    LossConfig(pg_loss="ppo_clip", clip_cov_lb=5.0, clip_cov_ub=1.0)   # unused: not checked


def test_inspector_shows_the_covariance_losses_with_query_kl_zeros():
    mcfg = ModelConfig()
    params = M.init_params(mcfg, jax.random.key(0))
    b = synthetic_batch(params, mcfg, 2, num_queries=2, group_size=4, query_width=6,
                        response_width=6)
    for pg_loss in ("clip_cov", "kl_cov"):
        cfg = LossConfig(beta_query=0.3, pg_loss=pg_loss, clip_cov_lb=-10.0,
                         clip_cov_ratio=0.1, kl_cov_ratio=0.1)
        rep = grad_flow.inspect_gradients(params, mcfg, b, cfg, 1.0)["terms"]
        assert rep["query_kl"]["logit_grad_response"] == 0.0 < rep["query_kl"]["logit_grad_query"]
        assert rep["pg"]["logit_grad_query"] == 0.0 < rep["pg"]["logit_grad_response"]


# ----------------------------------------------------------------------------- rollout correction

@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_rollout_correction_removes_exactly_the_out_of_band_tokens(mode):
    """Masked importance sampling against the sampler: d PG / d logp is
    exactly 0 on the response tokens (token_mask) or the sequences
    (sequence_mask, geometric-mean ratio) outside [low, high], and exactly the
    uncorrected term's on every other token (masked tokens stay in the
    token-mean's denominator); Query-KL's gradient still never reaches a
    response position, nor PG's a query position."""
    logits, batch = toy_batch(seed=4, B=3, G=4, R=6)
    st = stats_from_logits(logits, batch.tokens[:, 1:], TEMP)
    rm, qm = np.asarray(batch.response_mask), np.asarray(batch.query_mask)
    # log r = logp - old_logp: 0.9 and -1.2 leave [log 0.5, log 2]; 0.3, -0.4 do not.
    log_r = np.random.default_rng(0).choice([-1.2, -0.4, 0.0, 0.3, 0.9], rm.shape)
    batch = batch._replace(old_logp=np.where(rm, np.asarray(st.logp) - log_r, 0.0)
                           .astype(np.float32))
    log_r = np.where(rm, np.asarray(st.logp, np.float64) - np.asarray(batch.old_logp), 0.0)
    lo, hi = np.log(0.5), np.log(2.0)
    if mode == "token_mask":
        inside = (log_r >= lo) & (log_r <= hi)
    else:
        geo = log_r.sum(-1) / np.maximum(rm.sum(-1), 1)
        inside = np.broadcast_to(((geo >= lo) & (geo <= hi))[:, None], rm.shape)
    masked = rm & ~inside
    assert 1 < masked.sum() < rm.sum() - 1, masked.sum()
    # A clip range wide enough that no token's PG gradient is clipped to 0.
    plain = LossConfig(eps_low=0.9, eps_high=10.0, beta_query=0.5)
    cfg = dataclasses.replace(plain, rollout_correction=mode)
    grad = lambda c: np.asarray(jax.grad(
        lambda lp: loss_terms(st._replace(logp=lp), batch, c)[0]["pg"])(st.logp))
    g, g0 = grad(cfg), grad(plain)
    assert np.all(g[masked] == 0) and np.all(g0[masked] != 0)
    np.testing.assert_array_equal(g[rm & ~masked], g0[rm & ~masked])
    assert np.all(g[~rm] == 0)
    # The kept tokens' gradient is -A w r / n, n every response token (masked included).
    adv = np.asarray(batch.advantages)[:, None] * np.ones(rm.shape)
    w = np.asarray(batch.query_weight)[:, None] * np.ones(rm.shape)
    keep = rm & ~masked
    np.testing.assert_allclose(g[keep], (-adv * np.exp(log_r) * w)[keep] / rm.sum(), rtol=1e-5)
    _, metrics = loss_terms(st, batch, cfg)
    np.testing.assert_allclose(float(metrics["rollout_correction_masked_frac"]),
                               masked.sum() / rm.sum(), rtol=1e-6)
    # Through the logits: PG never reaches a query position, Query-KL never a response one.
    _, g_pg = term_grad("pg", logits, batch, cfg)
    _, gq = term_grad("query_kl", logits, batch, cfg)
    assert np.all(np.asarray(g_pg)[qm] == 0) and np.abs(np.asarray(g_pg)[rm]).sum() > 0
    assert np.all(np.asarray(gq)[rm] == 0) and np.abs(np.asarray(gq)[qm]).sum() > 0


def test_rollout_correction_refuses_bad_bounds_naming_the_field():
    for kw, field in ((dict(rollout_correction="tis"), "rollout_correction is 'tis'"),
                      (dict(rollout_correction_low=2.0, rollout_correction_high=0.5),
                       r"rollout_correction_low is 2.0, not below .*rollout_correction_high "
                       r"\(0.5\).*empty or inverted"),
                      (dict(rollout_correction_low=1.5, rollout_correction_high=1.5),
                       "rollout_correction_low is 1.5, not below"),
                      (dict(rollout_correction_low=0.0), r"rollout_correction_low must be in "
                                                         r"\(0, 1\)"),
                      (dict(rollout_correction_high=1.0), "rollout_correction_high must be > 1")):
        with pytest.raises(ValueError, match="LossConfig." + field):
            LossConfig(**{"rollout_correction": "token_mask", **kw})
    from erpo_jax.train.config import apply_overrides
    with pytest.raises(ConfigError, match=r"config field loss.rollout_correction_high: must be "
                                          r"> 1"):
        validate(apply_overrides(RunConfig(), ["loss.rollout_correction=sequence_mask",
                                               "loss.rollout_correction_high=0.9"]))


def test_the_run_header_names_the_rollout_correction_when_on():
    from erpo_jax.train.config import apply_overrides
    from erpo_jax.train.methods import describe
    line = describe(apply_overrides(RunConfig(), ["loss.rollout_correction=token_mask",
                                                  "loss.rollout_correction_low=0.8"]))
    assert "rollout_correction=token_mask [0.8, 2]" in line, line
    assert "rollout_correction" not in describe(RunConfig())
