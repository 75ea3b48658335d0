"""Edge cases from the review against ERPO_METHOD.md (issue 17): each test here
failed on the code before its fix.

- ReferenceCache.scores() with a one-token last query (np.add.reduceat IndexError);
- k3 at large drift: the log-ratio is clipped before exp, so value and gradient
  stay finite on the Policy-KL and the Query-KL paths, with and without kl_clamp.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.model.logprobs import TokenLogprobs
from erpo_jax.rl import kl
from erpo_jax.rl.batch import RLBatch
from erpo_jax.rl.loss import LossConfig, loss_terms
from erpo_jax.rl.reference import ReferenceCache


@pytest.mark.parametrize("lengths", [[1, 3, 4], [3, 1, 4], [3, 4, 1], [1], [4, 1, 1]])
def test_scores_with_a_one_token_query_anywhere(lengths):
    """A one-token query (no target) gets the set's mean score wherever it sits,
    including last (reduceat's index == len(logp) used to raise IndexError)."""
    rng = np.random.default_rng(0)
    rows = [-rng.random(max(n - 1, 0)).astype(np.float32) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    logp = np.concatenate(rows) if offsets[-1] else np.zeros(0, np.float32)
    s = ReferenceCache(logp, offsets, "k").scores()
    real = [r.astype(np.float64).mean() for r in rows if len(r)]
    fill = np.mean(real) if real else 0.0
    want = [r.astype(np.float64).mean() if len(r) else fill for r in rows]
    np.testing.assert_allclose(s, want, rtol=1e-12)
    assert np.all(np.isfinite(ReferenceCache(logp, offsets, "k").weights("likelihood")))


# ----------------------------------------------------------------------------- clamp before exp

DRIFTS = (20.0, 100.0, 1e4)
LIMIT = 20.0   # verl clips the log-ratio at +-20 before exp
K3_AT_LIMIT = math.expm1(LIMIT) - LIMIT   # 4.85e8


def _drift_batch(d: float):
    """One query (2 targets) + 2 response tokens; the reference is d above the
    policy on every position (ref - logp = d): a policy that moved far away."""
    N, T = 2, 6
    qm = np.zeros((N, T - 1), bool)
    rm = np.zeros((N, T - 1), bool)
    qm[:, 0:2] = True
    rm[:, 2:4] = True
    logp = np.full((N, T - 1), -d - 1.0, np.float32)   # policy log-probs
    ref = np.full((N, T - 1), -1.0, np.float32)         # reference = policy + d
    batch = RLBatch(tokens=jnp.ones((N, T), jnp.int32), attn_mask=jnp.ones((N, T), bool),
                    query_mask=jnp.asarray(qm), response_mask=jnp.asarray(rm),
                    old_logp=jnp.asarray(logp), advantages=jnp.asarray([1.0, -1.0]),
                    ref_query_logp=jnp.asarray(ref), query_weight=jnp.ones(N),
                    group_id=jnp.zeros(N, jnp.int32), ref_logp=jnp.asarray(ref))
    return jnp.asarray(logp), batch


@pytest.mark.parametrize("clamp", [None, 10.0])
@pytest.mark.parametrize("d", DRIFTS)
@pytest.mark.parametrize("path", ["policy_kl", "query_kl"])
def test_k3_at_large_drift_is_finite_and_bounded(path, d, clamp):
    logp, batch = _drift_batch(d)
    cfg = LossConfig(beta_policy=1.0 if path == "policy_kl" else 0.0,
                     beta_query=1.0 if path == "query_kl" else 0.0, kl_clamp=clamp)

    def term(lp):
        stats = TokenLogprobs(lp, jnp.zeros_like(lp), lp)
        return loss_terms(stats, batch, cfg)[0][path]

    value, grad = jax.value_and_grad(term)(logp)
    assert np.isfinite(float(value)) and bool(jnp.all(jnp.isfinite(grad))), (value, grad)
    bound = K3_AT_LIMIT if clamp is None else clamp
    assert 0 < float(value) <= bound * (1 + 1e-6)
    if d > LIMIT or clamp is not None:
        # Past the limit (or the clamp) the estimate is flat: no gradient.
        assert float(jnp.max(jnp.abs(grad))) == 0.0
    else:   # d == 20: still finite, and pointing the policy back toward the reference
        own = batch.response_mask if path == "policy_kl" else batch.query_mask
        assert bool(jnp.all(jnp.where(own, grad < 0, grad == 0)))


def test_k3_below_the_limit_is_unchanged():
    d = jnp.asarray([-19.5, -3.0, 0.0, 0.5, 19.5])
    want = np.expm1(np.float64(d)) - np.float64(d)
    np.testing.assert_allclose(np.asarray(kl.k3(d)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: jnp.sum(kl.k3(x)))(d)),
                               np.expm1(np.float64(d)), rtol=1e-6)


# ----------------------------------------------------------------------------- cache key


def test_reference_cache_key_includes_the_numerics(tmp_path):
    """A bf16 run must not read the f32 run's cache (nor one made with other chunking
    or batch layout); the same numerics reuse it."""
    import dataclasses

    from erpo_jax.model import model as M
    from erpo_jax.model.config import ModelConfig
    from erpo_jax.rl import reference as ref_lib
    cfg = ModelConfig(vocab_size=64)
    params = M.init_params(cfg, jax.random.key(0))
    queries = [[3, 4, 5, 6], [7, 8, 9]]
    kw = dict(tokenizer_id="t", template="plain", batch_size=2, progress=False)
    f32, computed = ref_lib.load_or_compute(params, cfg, queries, tmp_path, **kw)
    assert computed
    _, computed = ref_lib.load_or_compute(params, cfg, queries, tmp_path, **kw)
    assert not computed
    bf16 = dataclasses.replace(cfg, compute_dtype="bfloat16")
    other, computed = ref_lib.load_or_compute(params, bf16, queries, tmp_path, **kw)
    assert computed and other.key != f32.key
    _, computed = ref_lib.load_or_compute(params, cfg, queries, tmp_path,
                                          **dict(kw, chunk_size=2))
    assert computed
    _, computed = ref_lib.load_or_compute(params, cfg, queries, tmp_path,
                                          **dict(kw, batch_size=4))
    assert computed


# ----------------------------------------------------------------------------- token-level returns


def _rollout(seed=0, R=4, T1=7):
    """Rewards, masks and log-probs of R responses of different lengths."""
    rs = np.random.default_rng(seed)
    m = np.zeros((R, T1), bool)
    for i, (start, n) in enumerate([(2, 4), (2, 2), (2, 5), (2, 1)][:R]):
        m[i, start:start + n] = True
    rewards = np.array([1.0, 0.0, 1.0, 0.0][:R], np.float32)
    old = -rs.random((R, T1)).astype(np.float32) * 2
    ref = old + rs.normal(0, 0.3, (R, T1)).astype(np.float32)
    return rewards, m, old, ref


def _hand_token_rewards(rewards, m, old, ref, beta):
    """Per-token rewards by hand: -beta * k3(ref - old) per response token, + r at the last."""
    out = np.zeros(m.shape)
    for i in range(m.shape[0]):
        pos = np.flatnonzero(m[i])
        for t in pos:
            d = float(ref[i, t]) - float(old[i, t])
            out[i, t] = -beta * (math.exp(d) - d - 1)
        out[i, pos[-1]] += rewards[i]
    return out


def _algo(advantage, **kw):
    from erpo_jax.train.config import AlgoSection
    return AlgoSection(advantage=advantage, **kw)


def test_gae_in_reward_mode_uses_the_per_token_penalty():
    """GAE on shaped rewards equals a hand loop whose rewards carry -beta * k3 on
    every response token (the old code put the summed penalty on the last token)."""
    from erpo_jax.rl import advantages as A
    from erpo_jax.rl.shaping import shaped_advantages
    rewards, m, old, ref = _rollout()
    beta, gamma, lam = 0.5, 0.9, 0.8
    cfg = LossConfig(beta_policy=beta, policy_kl_estimator="k3", policy_kl_mode="reward")
    shaped, adv = shaped_advantages(jnp.asarray(rewards), jnp.asarray(m), jnp.asarray(old),
                                    jnp.asarray(ref), loss_cfg=cfg, algo=_algo("gae"),
                                    group_size=2)
    assert adv is None and shaped.shape == m.shape
    hand_r = _hand_token_rewards(rewards, m, old, ref, beta)
    np.testing.assert_allclose(np.asarray(shaped), hand_r, rtol=1e-5, atol=1e-7)
    values = np.random.default_rng(1).normal(size=m.shape).astype(np.float32)
    got, ret = A.gae(shaped, jnp.asarray(values), jnp.asarray(m), gamma=gamma, lam=lam)
    want = np.zeros(m.shape)
    for i in range(m.shape[0]):
        pos = np.flatnonzero(m[i])
        a_next, v_next = 0.0, 0.0
        for t in pos[::-1]:
            delta = hand_r[i, t] + gamma * v_next - values[i, t]
            a_next = delta + gamma * lam * a_next
            want[i, t], v_next = a_next, values[i, t]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), np.where(m, want + values, 0), rtol=1e-5,
                               atol=1e-6)


def _hand_reinforce_pp(token_r, m, gamma):
    """Returns-to-go, whitened over every response token (mean, unbiased std), by hand."""
    g = np.zeros(m.shape)
    for i in range(m.shape[0]):
        run = 0.0
        for t in np.flatnonzero(m[i])[::-1]:
            run = token_r[i, t] + gamma * run
            g[i, t] = run
    vals = g[m]
    return np.where(m, (g - vals.mean()) / (vals.std(ddof=1) + 1e-6), 0.0)


@pytest.mark.parametrize("reward_mode", [False, True])
def test_reinforce_pp_whitens_over_response_tokens(reward_mode):
    """REINFORCE++ advantages: per-token returns-to-go (with the per-token penalty in
    reward mode), whitened over the response tokens, unbiased variance."""
    from erpo_jax.rl.shaping import shaped_advantages
    rewards, m, old, ref = _rollout()
    beta, gamma = 0.5, 0.95
    cfg = LossConfig(beta_policy=beta if reward_mode else 0.0, policy_kl_mode="reward")
    args = (jnp.asarray(old), jnp.asarray(ref)) if reward_mode else (None, None)
    _, adv = shaped_advantages(jnp.asarray(rewards), jnp.asarray(m), *args, loss_cfg=cfg,
                               algo=_algo("reinforce_pp", gamma=gamma), group_size=2)
    token_r = (_hand_token_rewards(rewards, m, old, ref, beta) if reward_mode else
               np.where(m & (np.cumsum(m, 1) == m.sum(1, keepdims=True)), rewards[:, None], 0))
    np.testing.assert_allclose(np.asarray(adv), _hand_reinforce_pp(token_r, m, gamma),
                               rtol=1e-5, atol=1e-6)
    tokens = np.asarray(adv)[m]
    assert abs(tokens.mean()) < 1e-6 and tokens.std(ddof=1) == pytest.approx(1.0, rel=1e-5)


def test_reinforce_pp_per_response_is_a_named_option():
    """algo.reinforce_pp_whiten='response' keeps the per-response whitening (one
    advantage per response, population std over responses)."""
    from erpo_jax.rl import advantages as A
    from erpo_jax.rl.shaping import shaped_advantages
    rewards, m, _, _ = _rollout()
    _, adv = shaped_advantages(jnp.asarray(rewards), jnp.asarray(m), loss_cfg=LossConfig(),
                               algo=_algo("reinforce_pp", reinforce_pp_whiten="response"),
                               group_size=2)
    np.testing.assert_array_equal(np.asarray(adv),
                                  np.asarray(A.reinforce_pp(rewards, 2, eps=1e-6)).reshape(-1))


# ----------------------------------------------------------------------------- algo.method


def _cfg(*overrides):
    from erpo_jax.train.config import RunConfig, apply_overrides
    return apply_overrides(RunConfig(), list(overrides))


def test_query_kl_alone_is_not_called_erpo():
    """The review's case: loss.beta_query=0.1 on a config that names no scheme ran
    Query-KL with uniform weights; it now resolves to method 'custom', and saying
    'erpo' brings ERPO's likelihood weights."""
    from erpo_jax.train.config import validate
    from erpo_jax.train.methods import describe
    plain = validate(_cfg("loss.beta_query=0.1"))
    assert plain.algo.method == "custom" and plain.algo.weight_scheme == "uniform"
    assert describe(plain).startswith("[erpo] method=custom")
    erpo = validate(_cfg("algo.method=erpo"))
    assert erpo.algo.weight_scheme == "likelihood"
    assert erpo.loss.beta_query == 0.1 and erpo.loss.beta_policy == 0
    assert "method=erpo" in describe(erpo) and "weights=likelihood" in describe(erpo)
    assert validate(_cfg("algo.method=erpo", "loss.beta_query=0.3")).loss.beta_query == 0.3
    base = validate(_cfg("algo.method=grpo_policy_kl"))
    assert (base.loss.beta_policy, base.loss.beta_query, base.algo.weight_scheme) == (
        0.04, 0.0, "uniform")
    off = validate(_cfg("algo.method=no_kl"))
    assert (off.loss.beta_policy, off.loss.beta_query, off.algo.weight_scheme) == (
        0.0, 0.0, "uniform")
    for cfg in (plain, erpo, base, off):   # idempotent: config.json resolves to itself
        assert validate(cfg) == cfg


@pytest.mark.parametrize("overrides,field", [
    (("algo.method=erpo", "loss.beta_policy=0.04"), "loss.beta_policy"),
    (("algo.method=erpo", "algo.weight_scheme=uniform"), "algo.weight_scheme"),
    (("algo.method=grpo_policy_kl", "loss.beta_query=0.1"), "loss.beta_query"),
    (("algo.method=grpo_policy_kl", "algo.weight_scheme=likelihood"), "algo.weight_scheme"),
    (("algo.method=no_kl", "loss.beta_query=0.1"), "loss.beta_query"),
    (("algo.method=no_kl", "loss.beta_policy=0.1"), "loss.beta_policy"),
    (("algo.method=ppo",), "algo.method"),
])
def test_method_contradictions_name_the_field(overrides, field):
    from erpo_jax.train.config import validate
    with pytest.raises(ValueError, match=f"config field {field}:.*"):
        validate(_cfg(*overrides))
    custom = [o for o in overrides if not o.startswith("algo.method")]
    if field != "algo.method":   # the same settings are a valid ablation under 'custom'
        validate(_cfg("algo.method=custom", *custom))


def test_library_and_config_weight_bounds_agree():
    import inspect

    from erpo_jax.rl.weights import query_weights
    from erpo_jax.train.config import AlgoSection
    p = inspect.signature(query_weights).parameters
    assert (p["w_min"].default, p["w_max"].default) == (AlgoSection().weight_min,
                                                        AlgoSection().weight_max)
    p = inspect.signature(ReferenceCache.weights).parameters
    assert (p["w_min"].default, p["w_max"].default) == (AlgoSection().weight_min,
                                                        AlgoSection().weight_max)
