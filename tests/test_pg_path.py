"""The trainer's policy-gradient path under rewards that vary within groups.

The run starts from the session's SFT model (tests/tiny_runs.py), which
answers about two thirds of its training prompts, so step 0's groups hold
both rewarded and unrewarded responses. Everything the trainer derives from
the rollout is recomputed here without it: the rewards from the decoded
texts, GRPO advantages by the closed form in numpy, the per-query weights
from the reference pass, and the gradient with `jax.grad` of `loss_fn`.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from erpo_jax.rewards.arithmetic_reward import arithmetic_rewards
from erpo_jax.rl.loss import loss_fn
from erpo_jax.train import train_step as step_lib
from erpo_jax.train.config import load_config
from erpo_jax.train.loop import Trainer
from tiny_runs import ANSWERING, rl_args

LR = 1e-3
ADAM_EPS = 1e-8  # optax.adamw's default
W1, W2 = 2.5, 0.4  # the weights of the two-query test


def _grpo(rewards: np.ndarray, G: int, eps: float) -> np.ndarray:
    """(r - mean) / (std_ddof1 + eps) per group of G; exactly 0 for flat groups."""
    r = rewards.reshape(-1, G).astype(np.float64)
    c = r - r.mean(axis=1, keepdims=True)
    c[r.max(axis=1) == r.min(axis=1)] = 0.0
    std = np.sqrt((c * c).sum(axis=1, keepdims=True) / (G - 1))
    return (c / (std + eps)).reshape(-1)


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module")
def step0(sft_model, tmp_path_factory):
    """Step 0 of an ERPO run (GRPO, likelihood weights, beta_query 0.1):
    its batch, a second batch of the same rollout with two-query weights, and
    the parameters before and after the trainer's own update."""
    out = tmp_path_factory.mktemp("pg") / "run"
    cfg = load_config(None, rl_args(sft_model, out, *ANSWERING, "train.steps=1",
                                    f"optim.lr={LR}", "loss.beta_query=0.1",
                                    "algo.weight_scheme=likelihood",
                                    "rollout.engine=continuous", "rollout.slots=8"))
    t = Trainer(cfg)
    try:
        idx = np.asarray(t.iterator.batch_at(0))
        batch, cb, info, _, ro = t._rl_batch(0)
        # The same rollout (same parameters, same key) with weights W1, W2 on
        # two mixed-reward queries and 0 on every other.
        G = t.G
        texts = t.tokenizer.decode_responses(ro.response_tokens, ro.response_mask)
        rewards, _ = arithmetic_rewards(list(zip(texts, [t.task.train[i].answer for i in idx
                                                         for _ in range(G)])))
        mixed = np.flatnonzero(rewards.reshape(-1, G).std(axis=1) > 0)
        assert len(mixed) >= 2, f"only {len(mixed)} of {len(idx)} groups have mixed rewards"
        two = mixed[:2]
        custom = np.zeros(len(t.task.train), np.float32)
        custom[idx[two]] = (W1, W2)
        trainer_weights, t.weights = t.weights, custom
        try:
            batch_two = t._rl_batch(0)[0]
        finally:
            t.weights = trainer_weights
        np.testing.assert_array_equal(batch_two.tokens, batch.tokens)  # the same rollout
        params0 = jax.device_get(t.state.params)
        metrics = t._update(batch, cb, 0)
        params1 = jax.device_get(t.state.params)
        ref_weights = t.ref_cache.weights(cfg.algo.weight_scheme, cfg.algo.weight_tau,
                                          cfg.algo.weight_min, cfg.algo.weight_max)
        yield types.SimpleNamespace(
            cfg=cfg, model_cfg=t.model_cfg, G=G, idx=idx, batch=batch, batch_two=batch_two,
            two=two, info=info, rewards=rewards, ref_weights=ref_weights,
            params0=params0, params1=params1, metrics=metrics,
            logp_fn=step_lib.make_logprob_fn(t.model_cfg, cfg.rollout.temperature,
                                             cfg.model.logprob_chunk))
    finally:
        t.close()


def _expected_batch(s):
    """Step 0's batch with advantages and weights recomputed outside the trainer."""
    a = s.cfg.algo
    adv = _grpo(s.rewards, s.G, a.adv_eps).astype(np.float32)
    w = s.ref_weights[np.repeat(s.idx, s.G)]
    return s.batch._replace(advantages=adv, query_weight=w)


def _grad(s, batch, params, loss_cfg=None):
    """(loss, gradient) of `loss_fn`, by jax.grad, at `params` on `batch`."""
    c = s.cfg
    f = lambda p, b: loss_fn(p, s.model_cfg, b, loss_cfg or c.loss,
                             temperature=c.rollout.temperature,
                             chunk_size=c.model.logprob_chunk)[0]
    return jax.jit(jax.value_and_grad(f))(params, jax.tree_util.tree_map(jnp.asarray, batch))


def _sgd_update(s, batch, params=None):
    """(gradient, metrics) of the train step's update built from the run's
    config with plain SGD at lr 1, so the parameter change is the gradient."""
    c = s.cfg
    params = s.params0 if params is None else params
    upd = step_lib.build_update(s.model_cfg, c.loss, c.algo, optax.sgd(1.0),
                                micro_batches=c.optim.micro_batches, group_size=s.G,
                                temperature=c.rollout.temperature,
                                chunk_size=c.model.logprob_chunk)
    state = step_lib.init_state(jax.tree_util.tree_map(jnp.asarray, params), optax.sgd(1.0))
    new, m = upd(state, jax.tree_util.tree_map(jnp.asarray, batch), None)
    g = [p - q for p, q in zip(_leaves(params), _leaves(new.params))]
    return g, jax.device_get(m)


def _max_abs(leaves) -> float:
    return max(float(np.max(np.abs(x))) for x in leaves)


def test_rewards_vary_within_groups_and_become_the_advantages(step0):
    s = step0
    assert s.info["zero_var_group_frac"] < 1.0 and 0.0 < s.info["reward_mean"] < 1.0
    assert s.info["accuracy"] == pytest.approx(float(np.mean(s.rewards)))
    want = _expected_batch(s)
    assert np.any(want.advantages != 0)
    np.testing.assert_allclose(s.batch.advantages, want.advantages, atol=1e-5,
                               err_msg="the trainer's advantages are not GRPO of the rewards")
    # The weights are the reference pass's likelihood weights of each row's
    # query, and they are not all equal (so ignoring them would show).
    assert np.std(s.ref_weights) > 0.05
    np.testing.assert_allclose(s.batch.query_weight, want.query_weight, rtol=1e-6,
                               err_msg="the trainer's per-query weights are not the reference "
                                       "pass's weights")


def test_update_gradient_is_jax_grad_of_the_loss_with_the_weights(step0):
    s = step0
    want = _expected_batch(s)
    loss, g = _grad(s, want, s.params0)
    g = _leaves(g)
    gnorm = float(np.sqrt(sum(np.sum(x * x) for x in g)))
    assert gnorm > 0
    # The train step's gradient (its update with SGD at lr 1), exactly.
    g_step, m = _sgd_update(s, s.batch)
    assert float(m["loss"]) == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
    scale = _max_abs(g)
    for a, b in zip(g_step, g):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * scale)
    # The trainer's own update: AdamW's first step moves every parameter by
    # lr * gc / (|gc| + eps), gc the gradient clipped to max_grad_norm.
    assert s.metrics["grad_norm"] == pytest.approx(gnorm, rel=1e-4)
    clip = min(1.0, s.cfg.optim.max_grad_norm / gnorm) if s.cfg.optim.max_grad_norm > 0 else 1.0
    checked = 0
    for p0, p1, x in zip(_leaves(s.params0), _leaves(s.params1), g):
        gc = x * clip
        big = np.abs(gc) > 1e-5
        step = (p0 - p1) / LR
        np.testing.assert_allclose(step[big], (gc / (np.abs(gc) + ADAM_EPS))[big], atol=2e-2)
        checked += int(big.sum())
    assert checked > 0.5 * sum(x.size for x in g)


def test_update_gradient_carries_the_query_kl_term(step0):
    """Away from the reference (parameters perturbed by 5% of each leaf's
    spread) Query-KL has a gradient: the train step's gradient is still
    jax.grad's, and it differs from the gradient without Query-KL."""
    import dataclasses
    s = step0
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(
        lambda x: (x + 0.05 * (np.std(x) + 1e-3) * rng.standard_normal(x.shape)).astype(x.dtype),
        s.params0)
    want = _expected_batch(s)
    loss, g = _grad(s, want, params)
    _, g_no_qkl = _grad(s, want, params, dataclasses.replace(s.cfg.loss, beta_query=0.0))
    g, g_no_qkl = _leaves(g), _leaves(g_no_qkl)
    scale = _max_abs(g)
    assert _max_abs([a - b for a, b in zip(g, g_no_qkl)]) > 0.05 * scale
    g_step, m = _sgd_update(s, s.batch, params)
    assert float(m["term_query_kl"]) > 0
    assert float(m["loss"]) == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
    for a, b in zip(g_step, g):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * scale)


def test_update_raises_the_log_prob_of_the_rewarded_responses(step0):
    """PG sign: after one update the log-probability of each response moves
    with its (recomputed) weighted advantage, and rewarded responses gain on
    unrewarded ones of the same groups."""
    s = step0
    b = s.batch
    rm = np.asarray(b.response_mask, bool)
    logp = lambda p: np.where(rm, np.asarray(s.logp_fn(p, jnp.asarray(b.tokens),
                                                       jnp.asarray(b.attn_mask))), 0.0)
    d = (logp(s.params1) - logp(s.params0)).sum(axis=1)   # per-response change of log pi(y|x)
    want = _expected_batch(s)
    gain = float(np.sum(want.advantages * want.query_weight * d))
    assert gain > 0, f"the update lowered the weighted surrogate: sum(w A dlogp) = {gain}"
    mixed = np.repeat(s.rewards.reshape(-1, s.G).std(axis=1) > 0, s.G)
    up, down = d[mixed & (s.rewards == 1)], d[mixed & (s.rewards == 0)]
    assert up.size and down.size
    assert up.mean() > down.mean(), (up.mean(), down.mean())


def test_pg_term_scales_with_the_query_weights(step0):
    """Weights W1, W2 on two queries (0 elsewhere), placed by the trainer:
    the PG term and its gradient are W1 x query 1's plus W2 x query 2's."""
    s = step0
    b = s.batch_two
    rows = np.repeat(s.idx, s.G)
    w_rows = np.zeros(len(rows), np.float32)
    for j, w in zip(s.two, (W1, W2)):
        w_rows[j * s.G:(j + 1) * s.G] = w
    np.testing.assert_array_equal(b.query_weight, w_rows)

    def with_weights(w1, w2):
        w = np.zeros(len(rows), np.float32)
        for j, x in zip(s.two, (w1, w2)):
            w[j * s.G:(j + 1) * s.G] = x
        return _sgd_update(s, b._replace(query_weight=w))

    g12, m12 = _sgd_update(s, b)
    g1, m1 = with_weights(1.0, 0.0)
    g2, m2 = with_weights(0.0, 1.0)
    g0, m0 = with_weights(0.0, 0.0)
    # (A group's PG term can be ~0 in value, when its responses have equal
    # lengths, since its advantages sum to 0; its gradient is not.)
    pg1, pg2 = float(m1["term_pg"]), float(m2["term_pg"])
    assert float(m0["term_pg"]) == 0.0
    # The term is a float32 token mean whose parts (advantages of order 1) nearly
    # cancel: its rounding is absolute, about 1e-7 here (an AMD EPYC host gave
    # 9.6e-8, 2e-5 of the ~5e-3 value), so the tolerance is too.
    assert float(m12["term_pg"]) == pytest.approx(W1 * pg1 + W2 * pg2, rel=1e-5, abs=1e-6)
    # The gradient is affine in the weights: the Query-KL part (g0) does not scale.
    scale = max(float(np.max(np.abs(x))) for x in g12)
    for a, x1, x2, x0 in zip(g12, g1, g2, g0):
        np.testing.assert_allclose(a, W1 * x1 + W2 * x2 + (1 - W1 - W2) * x0,
                                   atol=1e-4 * scale)
    for gq in (g1, g2):   # each query's PG gradient is there to be scaled
        assert max(float(np.max(np.abs(x - x0))) for x, x0 in zip(gq, g0)) > 1e-2 * scale
